"""The floor a hop between two processes of one host is measured against: a Python pipe ping-pong of the hop's
bytes (`bench/cpu_per_call.py --mode Hops` prints both, same run). One way = half a round trip."""

from __future__ import annotations

import os
import time

__all__ = ["pipe_one_way_us"]


def _read_exactly(fd: int, nbytes: int) -> None:
    left = nbytes
    while left:
        left -= len(os.read(fd, min(left, 1 << 20)))


def pipe_one_way_us(nbytes: int, trips: int = 2000) -> float:
    """The mean of ``trips`` round trips of ``nbytes`` between this process and a forked child, halved (µs)."""
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    payload = b"x" * nbytes
    pid = os.fork()
    if pid == 0:
        try:
            for _ in range(trips + 50):
                _read_exactly(to_child_r, nbytes)
                os.write(to_parent_w, payload)
        finally:
            os._exit(0)
    try:
        for _ in range(50):   # warm-up
            os.write(to_child_w, payload)
            _read_exactly(to_parent_r, nbytes)
        began = time.perf_counter()
        for _ in range(trips):
            os.write(to_child_w, payload)
            _read_exactly(to_parent_r, nbytes)
        return (time.perf_counter() - began) / trips / 2 * 1e6
    finally:
        os.waitpid(pid, 0)
        for fd in (to_child_r, to_child_w, to_parent_r, to_parent_w):
            os.close(fd)
