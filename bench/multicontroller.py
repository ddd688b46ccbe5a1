"""The multi-controller baseline: N processes each run the loop themselves (torchrun-style).

Each process: one compute thread, a gloo group made from a FileStore (as the
executors make theirs), and the loop ``x = all_reduce(x, max) + 1`` (or a
simulated device step). Rates are steps per second of the slowest process.

`MultiController` keeps the N processes up and runs one timed window per request, so
`bench/dispatch.py` can interleave its windows with the runtime's.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time

__all__ = ["MultiController", "run_sim_multicontroller"]


def _worker(rank: int, size: int, store_path: str, commands, result_queue) -> None:
    from bench.gloo_loop import GlooLoop

    loop = GlooLoop(store_path, "baseline", rank, size)
    loop.steps(20)   # warm-up
    result_queue.put(("ready", rank, 0.0))
    while True:
        try:
            steps = commands.recv()
        except EOFError:       # the driver is gone
            return
        if steps is None:
            return
        loop.barrier()
        began = time.perf_counter()
        loop.steps(steps)
        result_queue.put(("window", rank, time.perf_counter() - began))


class MultiController:
    """``size`` loop processes that stay up; `window(steps)` times one window on all of them."""

    def __init__(self, size: int, timeout_s: float = 600.0):
        self.size, self.timeout_s = size, timeout_s
        mp = multiprocessing.get_context("spawn")
        self._results = mp.Queue()
        self._tmp = tempfile.TemporaryDirectory(prefix="pathways-baseline-")
        self._procs, self._commands = [], []
        for rank in range(size):
            reader, writer = mp.Pipe(duplex=False)
            proc = mp.Process(target=_worker, args=(rank, size, os.path.join(self._tmp.name, "store"), reader,
                                                    self._results), daemon=True)
            proc.start()
            reader.close()
            self._procs.append(proc)
            self._commands.append(writer)
        self._collect("ready")

    def window(self, steps: int) -> float:
        """Steps per second of one window of ``steps`` steps (the slowest process's time)."""
        for writer in self._commands:
            writer.send(steps)
        return steps / max(self._collect("window"))

    def close(self) -> None:
        for writer in self._commands:
            try:
                writer.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        self._tmp.cleanup()

    def _collect(self, kind: str) -> list[float]:
        values = []
        for _ in range(self.size):
            got, rank, value = self._results.get(timeout=self.timeout_s)
            if got != kind:
                raise RuntimeError(f"multi-controller rank {rank}: expected a {kind!r} report, got {got!r}")
            values.append(value)
        return values


def _sim_worker(rank: int, size: int, barrier, steps: int, step_s: float, result_queue) -> None:
    """Simulated device, no torch: each step occupies the device for ``step_s`` (absolute deadlines)."""
    from executor.sim import _sleep_until

    barrier.wait()
    began = time.perf_counter()
    free_at = began
    for _ in range(steps):
        free_at = max(free_at, time.perf_counter()) + step_s
        _sleep_until(free_at)
    # The loop's own time: releasing and joining a barrier of many processes on a small
    # machine takes far longer than the steps and would flatter the runtime.
    result_queue.put(time.perf_counter() - began)


def run_sim_multicontroller(size: int, steps: int, step_s: float) -> float:
    """Steps per second of ``size`` processes each busy ``step_s`` per step on a simulated device."""
    ctx = multiprocessing.get_context("spawn")
    results, barrier = ctx.Queue(), ctx.Barrier(size)
    procs = [ctx.Process(target=_sim_worker, args=(rank, size, barrier, steps, step_s, results))
             for rank in range(size)]
    for p in procs:
        p.start()
    elapsed = max(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(30)
    return steps / elapsed
