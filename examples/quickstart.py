"""The quickstart: per-shard functions on 4 local executors, checked against eager PyTorch."""

import torch

import pathways_torch as pw


def main() -> None:
    torch.manual_seed(0)
    x_host, w_host, v_host = torch.randn(64, 32), torch.randn(32, 16), torch.randn(16, 16)
    with pw.Context(num_executors=4) as ctx:          # embedded default: controller + 4 local CPU executors
        mesh = ctx.mesh({"data": 4})
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
