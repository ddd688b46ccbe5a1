"""Monarch baseline for bench/dispatch.py: the same scalar all-reduce (max) + add, driven through Monarch actors.

A proc mesh of N processes on this host, one actor in each; every actor holds one
gloo group made from a FileStore (as our executors and the Ray baseline do), one
compute thread. OpByOp: one mesh-wide ``step.call().get()`` per computation;
Fused: one mesh-wide call runs CHAIN of them on each actor. Run it where Monarch
(PyPI ``torchmonarch``) is importable; a separate directory is fine, and the project's
torch is the one used (torchmonarch 0.7.0 does not require torch, so pip leaves it alone):

    pip install --target DIR torchmonarch==0.7.0
    PYTHONPATH=DIR:. .venv/bin/python -m bench.monarch_baseline --sizes 1,2,4,8
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import tempfile
import time

from monarch.actor import Actor, current_rank, current_size, endpoint, this_host

from bench.common import add_run_arguments, write_results

CHAIN = 128


class Worker(Actor):
    """One executor: its gloo group and its scalar. Defined at module level so procs can import it."""

    @endpoint
    def setup(self, store_path: str) -> None:
        # A setup endpoint rather than __init__: spawn hands every actor the same
        # arguments, the rank comes from the message; and the mesh-wide call reaches
        # all actors at once, which the blocking rendezvous needs.
        import torch
        import torch.distributed as dist

        from executor.collectives import make_gloo_group

        torch.set_num_threads(1)
        size = current_size()["procs"]
        self.group = make_gloo_group(store_path, "monarch-baseline", current_rank().rank, size, 60.0)
        self.reduce_max = dist.AllreduceOptions()
        self.reduce_max.reduceOp = dist.ReduceOp.MAX
        self.x = torch.zeros(())

    def _step(self) -> None:
        out = self.x.clone()
        self.group.allreduce([out], self.reduce_max).wait()
        self.x = out + 1

    @endpoint
    def step(self) -> None:
        self._step()

    @endpoint
    def steps(self, count: int) -> None:
        for _ in range(count):
            self._step()


def measure(size: int, steps: int, repeats: int) -> dict:
    procs = this_host().spawn_procs(per_host={"procs": size})
    try:
        actors = procs.spawn("worker", Worker)
        with tempfile.TemporaryDirectory(prefix="pathways-monarch-") as tmp:
            actors.setup.call(os.path.join(tmp, "store")).get()
            actors.steps.call(5).get()                            # warm-up
            began = time.perf_counter()
            for _ in range(steps):
                actors.step.call().get()
            op_by_op = steps / (time.perf_counter() - began)
            began = time.perf_counter()
            for _ in range(repeats):
                actors.steps.call(CHAIN).get()
            fused = repeats * CHAIN / (time.perf_counter() - began)
    finally:
        procs.stop().get()                                        # the N processes exit before the next N
    return {"executors": size, "OpByOp": op_by_op, "Fused": fused}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, sizes="1,2,4,8", steps=200, repeats=4)
    args = parser.parse_args()
    rows = [measure(int(s), args.steps, args.repeats) for s in args.sizes.split(",")]
    for row in rows:
        print(f"Monarch N={row['executors']}: OpByOp {row['OpByOp']:,.0f}/s, Fused {row['Fused']:,.0f}/s")
    write_results("monarch_baseline", {"monarch": importlib.metadata.version("torchmonarch"), "rows": rows})


if __name__ == "__main__":
    main()
