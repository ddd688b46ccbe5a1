"""Ray baseline for bench/dispatch.py: the same scalar all-reduce (max) + add, driven through Ray actors.

Each actor holds one gloo group made from a FileStore (as our executors and the
multi-controller baseline do), one compute thread. OpByOp: one awaited
``ray.get`` over all actors per computation; Fused: one call runs CHAIN of them.
`bench/dispatch.py` runs it as a server for one N at a time (see
`bench/baseline_server.py`) where Ray is importable — a separate directory is fine:

    pip install --target DIR ray msgpack click jsonschema aiosignal frozenlist
    PATHWAYS_RAY_PYTHONPATH=DIR .venv/bin/python -m bench.dispatch
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from bench.baseline_server import serve

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


class RayWorkers:
    """``size`` actors with their gloo group, warmed up; timed windows of either loop."""

    def __init__(self, size: int):
        import ray

        self._ray = ray
        self._tmp = tempfile.TemporaryDirectory(prefix="pathways-ray-")
        worker = _actor_class(ray)
        self.actors = [worker.remote(rank, size, os.path.join(self._tmp.name, "store")) for rank in range(size)]
        ray.get([a.steps.remote(5) for a in self.actors])            # warm-up (and group rendezvous)

    def window(self, mode: str, count: int) -> float:
        """Computations per second: ``OpByOp`` (``count`` awaited calls) or ``Fused`` (``count`` x CHAIN)."""
        began = time.perf_counter()
        if mode == "OpByOp":
            for _ in range(count):
                self._ray.get([a.step.remote() for a in self.actors])
            return count / (time.perf_counter() - began)
        for _ in range(count):
            self._ray.get([a.steps.remote(CHAIN) for a in self.actors])
        return count * CHAIN / (time.perf_counter() - began)

    def close(self) -> None:
        for a in self.actors:
            self._ray.kill(a)
        self._tmp.cleanup()


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", type=int, required=True, metavar="N",
                        help="serve timed windows of N actors (see bench/baseline_server.py)")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    workers = RayWorkers(args.serve)
    serve(workers.window, workers.close)


if __name__ == "__main__":
    main()
