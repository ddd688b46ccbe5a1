"""Where a collective should run on the XLA route: between two executables, or inside one through a host callback.

Issue 32 asks for a ``pathways::`` collective inside the compiled step, "through an XLA FFI custom call into
gloo, or through a host callback if that measures faster here". This measures the Chained node
(``x = all_reduce(x, max) + 1`` on a 0-d float32, `bench.gloo_loop`), 128 in a row, on N ranks of one gloo group
(made as executors make theirs), with no runtime around it, four ways per rank:

- ``eager``: torch, as `GlooLoop` (the floor);
- ``cut``: what the default backend does today: the collective as a host stage on a torch view of the jax
  value, then the ``+ 1`` as an ahead-of-time compiled XLA executable called on the numpy result;
- ``callback per node``: one executable per node, the collective inside it through ``jax.pure_callback``;
- ``callback, 128 fused``: one executable for all 128 nodes, 128 callbacks inside it (what fusion would build).

Rounds interleave the four (a barrier before each); per round, µs per node; medians over rounds, and each way's
extra µs over eager per round. Prints a table, writes bench/results/collective_in_step.json.

    .venv/bin/python -m bench.collective_in_step [--ranks 2] [--rounds 30]
"""

from __future__ import annotations

import argparse
import os
import time

from bench.common import median, print_table, run_ranks, write_results

WAYS = ("eager", "cut", "callback per node", "callback, 128 fused", "ffi per node", "ffi, 128 fused")


def _rank(rank: int, size: int, steps: int, rounds: int, store_path: str, results) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import torch.distributed as dist

    from executor.collectives import make_gloo_group

    jax.config.update("jax_cpu_enable_async_dispatch", False)   # as the executors run it
    torch.set_num_threads(1)
    group = make_gloo_group(store_path, "collective-in-step", rank, size, 120.0)
    reduce_max = dist.AllreduceOptions()
    reduce_max.reduceOp = dist.ReduceOp.MAX

    def all_reduce(tensor):
        group.allreduce([tensor], reduce_max).wait()
        return tensor

    def all_reduce_numpy(array):
        return all_reduce(torch.from_numpy(np.array(array))).numpy()

    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    plus_one = jax.jit(lambda a: a + 1).lower(scalar).compile()

    def node(a):
        return jax.pure_callback(all_reduce_numpy, scalar, a) + 1

    def chain(a):
        for _ in range(steps):
            a = node(a)
        return a

    one_node = jax.jit(node).lower(scalar).compile()
    fused = jax.jit(chain).lower(scalar).compile()
    ffi_node, ffi_fused = _ffi_executables(group, steps)

    def eager():
        x = torch.zeros(())
        for _ in range(steps):
            x = all_reduce(x.clone()) + 1
        return x

    def cut():
        x = jnp.zeros((), jnp.float32)
        for _ in range(steps):
            x = plus_one(all_reduce(torch.from_numpy(np.asarray(x)).clone()).numpy())
        return x

    def per_node():
        x = jnp.zeros((), jnp.float32)
        for _ in range(steps):
            x = one_node(x)
        return x

    def ffi_per_node():
        x = jnp.zeros((), jnp.float32)
        for _ in range(steps):
            x = ffi_node(x)
        return x

    ways = dict(zip(WAYS, (eager, cut, per_node, lambda: fused(jnp.zeros((), jnp.float32)), ffi_per_node,
                           lambda: ffi_fused(jnp.zeros((), jnp.float32)))))
    for name, run in ways.items():     # warm-up, and the oracle: every way counts to `steps`
        value = float(np.asarray(run()))
        if value != steps:
            raise AssertionError(f"{name}: expected {steps} after {steps} nodes, got {value}")
    per_round = {name: [] for name in WAYS}
    for _ in range(rounds):
        for name, run in ways.items():
            group.barrier().wait()
            began = time.perf_counter()
            run()
            per_round[name].append((time.perf_counter() - began) / steps * 1e6)
    results.put((rank, per_round))


def _ffi_executables(group, steps: int):
    """The node as one executable with the collective as an XLA FFI custom call into ``group``
    (executor/backends/xla_collectives.py), and 128 nodes as one such executable."""
    import jax
    import jax.numpy as jnp

    from executor.backends import xla_collectives

    module = xla_collectives.ensure_built()
    xla_collectives.register_targets()
    module.bind([(xla_collectives.axis_id("data"), module.register_group(group), False, "")])
    scalar = jax.ShapeDtypeStruct((), jnp.float32)

    def node(a):
        return xla_collectives.all_reduce(a, "data", "max") + 1

    def chain(a):
        xla_collectives.reset_order()
        for _ in range(steps):
            a = node(a)
        return a

    def one(a):
        xla_collectives.reset_order()
        return node(a)

    return jax.jit(one).lower(scalar).compile(), jax.jit(chain).lower(scalar).compile()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    rows = run_ranks(_rank, args.ranks, (args.ranks, args.steps, args.rounds), "pathways-bench-collective-")
    # A node ends when its slowest rank's does: per round, the slowest rank's time.
    slowest = {name: [max(r[1][name][i] for r in rows) for i in range(args.rounds)] for name in WAYS}
    table, summary = [], {}
    for name in WAYS:
        extra = [t - e for t, e in zip(slowest[name], slowest["eager"])]
        summary[name] = {"us_per_node": median(slowest[name]), "extra_over_eager_us": median(extra),
                         "extra_range_us": [min(extra), max(extra)]}
        table.append([name, f"{median(slowest[name]):,.0f}", f"{median(extra):+,.0f}",
                      f"{min(extra):+,.0f} .. {max(extra):+,.0f}"])
    print_table(["way", "µs per node (median)", "over eager (median)", "over eager (range)"], table)
    print("written to", write_results("collective_in_step", {"ranks": args.ranks, "steps": args.steps,
                                                             "rounds": args.rounds, "ways": summary,
                                                             "per_round_us": slowest}))


if __name__ == "__main__":
    main()
