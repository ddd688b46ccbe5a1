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

import os
import tempfile

from bench.baseline_server import serve, serve_size
from bench.gloo_loop import CHAIN, GlooLoop, timed_window


def _actor_class(ray):
    @ray.remote(num_cpus=0)
    class Worker:
        def __init__(self, rank: int, size: int, store_path: str):
            self.loop = GlooLoop(store_path, "ray-baseline", rank, size)

        def step(self) -> None:
            self.loop.step()

        def steps(self, count: int) -> None:
            self.loop.steps(count)

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
        return timed_window(mode, count, lambda: self._ray.get([a.step.remote() for a in self.actors]),
                            lambda: self._ray.get([a.steps.remote(CHAIN) for a in self.actors]))

    def close(self) -> None:
        for a in self.actors:
            self._ray.kill(a)
        self._tmp.cleanup()


def main() -> None:
    import ray

    size = serve_size(__doc__.splitlines()[0])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    workers = RayWorkers(size)
    serve(workers.window, workers.close)


if __name__ == "__main__":
    main()
