"""Bounded run-ahead, per client: how many of a client's calls may be unfinished at once.

A client's call waits (on its own thread: the embedded client's, or a remote client's worker) while that client
has ``max_inflight_calls`` calls unfinished, so the queues to executors and the controller's tables stay bounded
however far ahead it runs. The bound is per client: one whose calls never end (their inputs never come: a put it
never sends) fills its own run-ahead, never another's (issue 46: found by bench/fuzz_service.py). Each wait is kept
for the trace (`waits`): a client that waits here runs ahead as far as it may, and the executors are its pace.
"""

from __future__ import annotations

import collections
import threading
import time

__all__ = ["RunAhead"]


class RunAhead:
    """Calls in flight per client, under ``lock`` (the controller's), and the waits for room."""

    def __init__(self, lock: threading.Lock, limit: int):
        self.limit = limit
        self._room = threading.Condition(lock)
        self._of: collections.Counter = collections.Counter()   # client → its calls unfinished
        self.high_water = 0                                      # the most calls ever unfinished at once
        self.waits: collections.deque = collections.deque(maxlen=10_000)   # (start ns, end ns, in flight, name)

    def wait_for_room(self, count: int, name: str, owner: str, closed) -> None:
        """Wait (the lock released) until ``count`` more calls of ``owner`` fit under the bound, or ``closed()``.
        A program with more calls than the bound runs once nothing else of its client is in flight."""
        def room(limit: int) -> bool:
            own = self._of[owner]
            return closed() or not own or own + count <= limit

        if not room(self.limit):
            # Once at the bound, wait down to the low-water mark: one wake-up per quarter of the bound, not one
            # per finished call (which costs the client a thread switch per call).
            start, waiting = time.time_ns(), self._of[owner]
            self._room.wait_for(lambda: room(self.low_water))
            self.waits.append((start, time.time_ns(), waiting, name))
        self.high_water = max(self.high_water, sum(self._of.values()) + count)

    def added(self, owner: str) -> None:
        self._of[owner] += 1

    def ended(self, owner: str) -> None:
        self._of[owner] -= 1
        if self._of[owner] <= self.low_water:
            self._room.notify_all()

    def clear(self) -> None:
        """Nothing is in flight any more (the controller stops): every wait ends."""
        self._of.clear()
        self._room.notify_all()

    @property
    def low_water(self) -> int:
        return self.limit - max(1, self.limit // 4)
