"""The multi-controller baseline: N processes each run the loop themselves (torchrun-style).

Each process: one compute thread, a gloo group made from a FileStore (as the
executors make theirs), and the loop ``x = all_reduce(x, max) + 1`` (or a
simulated device step). Returns steps per second (the slowest process).
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time

__all__ = ["run_multicontroller", "run_sim_multicontroller"]


def _worker(rank: int, size: int, store_path: str, steps: int, result_queue) -> None:
    import torch
    import torch.distributed as dist

    from executor.collectives import make_gloo_group

    torch.set_num_threads(1)
    group = make_gloo_group(store_path, "baseline", rank, size, 60.0)
    reduce_max = dist.AllreduceOptions()
    reduce_max.reduceOp = dist.ReduceOp.MAX
    x = torch.zeros(())
    for _ in range(20):   # warm-up
        out = x.clone()
        group.allreduce([out], reduce_max).wait()
        x = out + 1
    group.allreduce([torch.zeros(1)]).wait()   # start together
    began = time.perf_counter()
    for _ in range(steps):
        out = x.clone()
        group.allreduce([out], reduce_max).wait()
        x = out + 1
    result_queue.put(time.perf_counter() - began)


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


def _spawn(target, size: int, args: tuple) -> float:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="pathways-baseline-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=target, args=(rank, size, store_path, *args, results)) for rank in range(size)]
        for p in procs:
            p.start()
        times = [results.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(30)
    return max(times)


def run_multicontroller(size: int, steps: int) -> float:
    """Steps per second of the scalar all-reduce + add loop on ``size`` processes."""
    return steps / _spawn(_worker, size, (steps,))


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
