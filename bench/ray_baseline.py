"""Ray baseline for bench/dispatch.py: the same scalar all-reduce (max) + add, driven through Ray actors.

Each actor holds one gloo group made from a FileStore (as our executors and the
multi-controller baseline do), one compute thread. OpByOp: one awaited
``ray.get`` over all actors per computation; Fused: one call runs CHAIN of them.
Run it where Ray is importable (a separate environment is fine):

    PYTHONPATH=/path/to/ray/site-packages .venv/bin/python -m bench.ray_baseline --sizes 1,2,4,8
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from bench.common import add_run_arguments, write_results

CHAIN = 128


def _actor_class(ray):
    @ray.remote(num_cpus=0)
    class Worker:
        def __init__(self, rank: int, size: int, store_path: str):
            import torch
            import torch.distributed as dist

            from executor.collectives import make_gloo_group

            torch.set_num_threads(1)
            self.group = make_gloo_group(store_path, "ray-baseline", rank, size, 60.0)
            self.reduce_max = dist.AllreduceOptions()
            self.reduce_max.reduceOp = dist.ReduceOp.MAX
            self.x = torch.zeros(())

        def step(self) -> None:
            out = self.x.clone()
            self.group.allreduce([out], self.reduce_max).wait()
            self.x = out + 1

        def steps(self, count: int) -> None:
            for _ in range(count):
                self.step()

    return Worker


def measure(size: int, steps: int, repeats: int) -> dict:
    import ray

    worker = _actor_class(ray)
    with tempfile.TemporaryDirectory(prefix="pathways-ray-") as tmp:
        actors = [worker.remote(rank, size, os.path.join(tmp, "store")) for rank in range(size)]
        ray.get([a.steps.remote(5) for a in actors])             # warm-up (and group rendezvous)
        began = time.perf_counter()
        for _ in range(steps):
            ray.get([a.step.remote() for a in actors])
        op_by_op = steps / (time.perf_counter() - began)
        began = time.perf_counter()
        for _ in range(repeats):
            ray.get([a.steps.remote(CHAIN) for a in actors])
        fused = repeats * CHAIN / (time.perf_counter() - began)
        for a in actors:
            ray.kill(a)
    return {"executors": size, "OpByOp": op_by_op, "Fused": fused}


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, sizes="1,2,4,8", steps=200, repeats=4)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = [measure(int(s), args.steps, args.repeats) for s in args.sizes.split(",")]
    for row in rows:
        print(f"Ray N={row['executors']}: OpByOp {row['OpByOp']:,.0f}/s, Fused {row['Fused']:,.0f}/s")
    write_results("ray_baseline", {"ray": ray.__version__, "rows": rows})


if __name__ == "__main__":
    main()
