"""The quickstart: per-shard functions on 4 local executors, checked against eager PyTorch."""

import argparse

import torch

import pathways_torch as pw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="xla", choices=["xla", "eager", "inductor"])
    parser.add_argument("--executors", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    x_host, w_host, v_host = torch.randn(64, 32), torch.randn(32, 16), torch.randn(16, 16)
    # embedded default: controller + local CPU executors (XLA on PJRT CPU unless told otherwise)
    with pw.Context(num_executors=args.executors, backend=args.backend) as ctx:
        mesh = ctx.mesh({"data": args.executors})
        x = ctx.put(x_host, mesh, [pw.Shard(0)])      # a global-shape array; shards live on executors
        w = ctx.put(w_host, mesh, [pw.Replicate()])
        v = ctx.put(v_host, mesh, [pw.Replicate()])

        @pw.function                                  # per-shard semantics: runs on each executor's local block
        def layer(x, w):
            return torch.relu(x @ w)

        y = layer(x, w)          # returns at once: a future with known global shape, dtype, sharding
        z = layer(y, v)          # futures feed later calls before they are computed
        print(z.shape, z.sharding)   # known without waiting
        result = z.result()          # the shards, assembled into one torch.Tensor on the client
        print(result)

    expected = torch.relu(torch.relu(x_host @ w_host) @ v_host)
    torch.testing.assert_close(result, expected)
    print(f"quickstart OK: {tuple(result.shape)} matches eager PyTorch "
          f"(max abs diff {(result - expected).abs().max().item():.2e})")


if __name__ == "__main__":
    main()
