"""Monarch baseline for bench/dispatch.py: the same scalar all-reduce (max) + add, driven through Monarch actors.

A proc mesh of N processes on this host, one actor in each; every actor holds one
gloo group made from a FileStore (as our executors and the Ray baseline do), one
compute thread. OpByOp: one mesh-wide ``step.call().get()`` per computation;
Fused: one mesh-wide call runs CHAIN of them on each actor. `bench/dispatch.py` runs
it as a server for one N at a time (see `bench/baseline_server.py`) where Monarch
(PyPI ``torchmonarch``) is importable; a separate directory is fine, and the project's
torch is the one used (torchmonarch 0.7.0 does not require torch, so pip leaves it alone):

    pip install --target DIR torchmonarch==0.7.0
    PATHWAYS_MONARCH_PYTHONPATH=DIR .venv/bin/python -m bench.dispatch
"""

from __future__ import annotations

import os
import tempfile

from monarch.actor import Actor, current_rank, current_size, endpoint, this_host

from bench.baseline_server import serve, serve_size
from bench.gloo_loop import CHAIN, GlooLoop, timed_window


class Worker(Actor):
    """One executor: its gloo loop. Defined at module level so procs can import it."""

    @endpoint
    def setup(self, store_path: str) -> None:
        # A setup endpoint rather than __init__: spawn hands every actor the same
        # arguments, the rank comes from the message; and the mesh-wide call reaches
        # all actors at once, which the blocking rendezvous needs.
        self.loop = GlooLoop(store_path, "monarch-baseline", current_rank().rank, current_size()["procs"])

    @endpoint
    def step(self) -> None:
        self.loop.step()

    @endpoint
    def steps(self, count: int) -> None:
        self.loop.steps(count)


class MonarchWorkers:
    """A proc mesh of ``size`` processes, one actor each with its gloo group, warmed up."""

    def __init__(self, size: int):
        self._tmp = tempfile.TemporaryDirectory(prefix="pathways-monarch-")
        self.procs = this_host().spawn_procs(per_host={"procs": size})
        self.actors = self.procs.spawn("worker", Worker)
        self.actors.setup.call(os.path.join(self._tmp.name, "store")).get()
        self.actors.steps.call(5).get()                               # warm-up

    def window(self, mode: str, count: int) -> float:
        return timed_window(mode, count, lambda: self.actors.step.call().get(),
                            lambda: self.actors.steps.call(CHAIN).get())

    def close(self) -> None:
        self.procs.stop().get()                                       # the N processes exit
        self._tmp.cleanup()


def main() -> None:
    size = serve_size(__doc__.splitlines()[0])
    workers = MonarchWorkers(size)
    serve(workers.window, workers.close)


if __name__ == "__main__":
    main()
