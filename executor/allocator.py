"""The executor's C allocator: large buffers in their own mappings, so that what a step frees goes back at once.

glibc's malloc serves a request of at least its *mmap threshold* with a mapping of its own, returned to the
kernel by ``free``. The threshold starts at 128 KiB and, by default, rises to the size of each such block freed
(up to 32 MiB), after which blocks of that size come from the heap. A training step allocates and frees buffers of
a unit's or a bucket's size many times; from the heap, interleaved with small long-lived allocations, they
fragment it, and the resident set grows past what is alive. Measured (bench/sharding.py, 64 MiB of parameters,
AdamW, N = 4, eager): DataParallel peaked at 4.41-4.54 P with a fixed threshold of 2 MiB against 5.34-6.33 P with
glibc's default, the per-unit sharded step at 1.48-1.52 P against 3.62-4.10 P (what is alive, against a heap that
kept what was freed). The price is a page fault per page of each large buffer; transparent huge pages
(``glibc.malloc.hugetlb=1``, which the local launcher sets: `pathways_torch.local.cluster`) can make those faults
up to 512 times fewer. Measured on the same runs: steps 28-30 % slower on that model (60 against 86 rows/s, 52 against 72),
whose tiny batch (16 rows a shard) makes the step memory-bound; a step with more compute per byte was not measured.

After each compile (on backends that compile: XLA) the executor gives the heap's free pages back
(`release_free_memory`): a compiler's working memory is many small blocks, below any threshold. Measured: the
per-unit sharded step on ``xla:torchax`` peaked at 2.79-2.83 P without it, 2.15-2.60 P with it.

``--mmap-threshold-mb 0`` keeps glibc's default (the dynamic threshold). On another C library nothing is changed.
This module imports no torch: it runs before torch allocates.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

__all__ = ["tune_allocator", "release_free_memory", "DEFAULT_MMAP_THRESHOLD_MB"]

log = logging.getLogger(__name__)

DEFAULT_MMAP_THRESHOLD_MB = 2.0
_M_MMAP_THRESHOLD = -3          # mallopt's parameter number (malloc.h)


@functools.cache
def _libc():
    """The C library, loaded once (a compile trims the heap through it each time)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_free_memory() -> bool:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``): after a compile, whose working
    memory is many small blocks below the mmap threshold. True if glibc released any."""
    trim = getattr(_libc(), "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False


def tune_allocator(mmap_threshold_mb: float) -> bool:
    """Fix glibc's mmap threshold at ``mmap_threshold_mb`` (0: leave glibc's dynamic default). True if set."""
    if mmap_threshold_mb <= 0:
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False      # not glibc: its allocator is left as it is
    if mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold_mb * 2**20)) != 1:
        log.warning("mallopt(M_MMAP_THRESHOLD, %s MiB) was refused; glibc's dynamic threshold stays",
                    mmap_threshold_mb)
        return False
    return True
