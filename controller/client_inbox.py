"""What the client socket's I/O thread does with a client's message, and no more: size it, spot a ping, queue it.

The I/O thread that reads the client socket serves every client, so it never decodes a request or runs one
(issue 46, C2): one tenant's 12 MB message once took that thread 6.6 s, every executor's heartbeat went
unanswered and every other client lost the controller. Here a message is only measured (`frame_nbytes`, no copy)
and its request id read from the first bytes of its JSON (`peek_request_id`); anything larger than
``max_client_message_bytes`` is refused with that id, and the rest waits, still as raw frames, in the client's own
`RequestQueue`, which its worker thread decodes and runs. The queue is bounded by count and bytes: a client whose
worker is that far behind sends faster than it is served and is disconnected with the reason (its own library
never gets there: it waits once 512 requests are unread).
"""

from __future__ import annotations

import collections
import re
import threading
import time
from typing import Sequence

from pathways_torch.wire.loop import frame_nbytes

__all__ = ["RequestQueue", "QueueFull", "RefusalPace", "peek_request_id", "is_ping", "message_bytes"]

# The seam's encoder writes a request as compact JSON, "r" first: {"$d":[["r",12],["op","call"],...]}. Only the id
# is read here.
_REQUEST_ID = re.compile(rb'\A\{"\$d":\[\["r",(\d{1,18})\]')
_PING_BYTES = 96   # {"$d":[["r",0],["op","ping"],["a",[]]]}: a longer message is no ping


def message_bytes(frames: Sequence) -> int:
    """The bytes of a client's message (its frames after the routing identity)."""
    return sum(frame_nbytes(frame) for frame in frames)


def peek_request_id(first_frame: bytes | memoryview) -> int:
    """The request id a message's JSON starts with, 0 (no answer wanted) where it does not start with one."""
    match = _REQUEST_ID.match(bytes(first_frame[:40]))
    return int(match.group(1)) if match else 0


def is_ping(frames: Sequence) -> bool:
    """True for the client library's ping: one short frame naming the op ``ping``."""
    return len(frames) == 1 and frame_nbytes(frames[0]) <= _PING_BYTES and b'["op","ping"]' in bytes(frames[0])


class QueueFull(Exception):
    """A client's queue is past its bounds; the message says which and by how much."""


class RequestQueue:
    """One client's requests, received and not yet run: raw frames, oldest first, bounded by count and bytes."""

    def __init__(self, max_requests: int, max_bytes: int):
        self.max_requests, self.max_bytes = max_requests, max_bytes
        self._items: collections.deque = collections.deque()
        self._bytes = 0
        self._closed = False
        self._wake = threading.Condition()
        self.high_water = 0   # the most requests it ever held

    def put(self, frames: list, nbytes: int) -> None:
        """Queue a request (the I/O thread); `QueueFull` past a bound, nothing queued then."""
        with self._wake:
            if len(self._items) + 1 > self.max_requests or self._bytes + nbytes > self.max_bytes:
                raise QueueFull(f"{len(self._items)} requests of {self._bytes} bytes unread by its worker, and one "
                                f"more of {nbytes} bytes (the bounds: {self.max_requests} requests, {self.max_bytes} "
                                f"bytes; --max-queued-requests, --max-queued-bytes)")
            self._items.append((frames, nbytes))
            self._bytes += nbytes
            self.high_water = max(self.high_water, len(self._items))
            self._wake.notify()

    def take(self) -> list | None:
        """The oldest request's frames, waiting for one (the worker); None once closed."""
        with self._wake:
            self._wake.wait_for(lambda: self._items or self._closed)
            if self._closed:
                return None
            frames, nbytes = self._items.popleft()
            self._bytes -= nbytes
            return frames

    def close(self) -> int:
        """No more requests: a waiting `take` returns None; how many were dropped unread."""
        with self._wake:
            self._closed = True
            dropped = len(self._items)
            self._items.clear()
            self._bytes = 0
            self._wake.notify_all()
            return dropped

    def __len__(self) -> int:
        return len(self._items)

    @property
    def empty(self) -> bool:
        return not self._items


class RefusalPace:
    """Past ``free_per_s`` refused requests in a second, each more costs its client's worker ``pause_s`` of sleep
    (with the GIL let go): junk costs its sender time instead of the other tenants' share of the controller's
    Python. A flooder's queue then fills and it is disconnected; a client with an occasional error never waits."""

    def __init__(self, free_per_s: int = 100, pause_s: float = 0.001, clock=time.monotonic, sleep=time.sleep):
        self.free_per_s, self.pause_s, self._clock, self._sleep = free_per_s, pause_s, clock, sleep
        self._second, self._count = -1.0, 0
        self.paused = 0   # refusals that cost a pause

    def pace(self) -> None:
        """One more refusal: free within the budget of this second, else a pause."""
        now = self._clock()
        if now - self._second >= 1.0:
            self._second, self._count = now, 0
        self._count += 1
        if self._count > self.free_per_s:
            self.paused += 1
            self._sleep(self.pause_s)
