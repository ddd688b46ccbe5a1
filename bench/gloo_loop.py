"""The loop every dispatch baseline runs, and how a window of it is timed.

One computation = ``x = all_reduce(x, max) + 1`` on a gloo group made from a FileStore
(as the executors make theirs), one thread. The multi-controller processes, the Ray
actors and the Monarch actors all hold a `GlooLoop`, so the baselines differ only in
how they are driven.
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["CHAIN", "GlooLoop", "timed_window"]

CHAIN = 128   # computations per Fused call (and per Chained program)


class GlooLoop:
    def __init__(self, store_path: str, prefix: str, rank: int, size: int, timeout_s: float = 60.0):
        import torch
        import torch.distributed as dist

        from executor.collectives import make_gloo_group

        torch.set_num_threads(1)
        self._torch = torch
        self.group = make_gloo_group(store_path, prefix, rank, size, timeout_s)
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

    def barrier(self) -> None:
        """Start together: one all-reduce every member must join."""
        self.group.allreduce([self._torch.zeros(1)]).wait()


def timed_window(mode: str, count: int, one_step: Callable[[], None], one_chain: Callable[[], None]) -> float:
    """Computations per second: ``OpByOp`` makes ``count`` awaited one-step calls, ``Fused`` ``count``
    awaited calls of CHAIN steps each."""
    call, per_call = (one_step, 1) if mode == "OpByOp" else (one_chain, CHAIN)
    began = time.perf_counter()
    for _ in range(count):
        call()
    return count * per_call / (time.perf_counter() - began)
