"""Waking a thread that blocks in a ZeroMQ poll, from any other thread.

Both loops that own sockets — `SocketLoop` (the I/O thread of each process) and the
executor's `ComputeLoop` — sleep in ``zmq.Poller.poll``; other threads queue work for
them and then call `WakePipe.wake`. One wake-up message goes per batch of work: a
flag says one is on its way, because each inproc send costs tens of microseconds
and a training step queues a dozen.
"""

from __future__ import annotations

import itertools
import threading

import zmq

__all__ = ["WakePipe", "POLLIN"]

POLLIN = int(zmq.POLLIN)   # a plain int: `&` with the enum costs a microsecond a test

_ids = itertools.count()


class WakePipe:
    """An inproc PUSH/PULL pair: the owning thread polls ``socket``; any thread calls `wake`."""

    def __init__(self, context: zmq.Context, name: str):
        address = f"inproc://pathways-wake-{name}-{next(_ids)}"
        self.socket = context.socket(zmq.PULL)
        self.socket.bind(address)
        self._push = context.socket(zmq.PUSH)
        self._push.connect(address)
        self._lock = threading.Lock()
        self._pending = False   # a wake-up is sent and not yet drained (under _lock)

    def wake(self) -> None:
        """Make the owner's poll return, unless a wake-up is already on its way (any thread)."""
        with self._lock:
            if self._pending or self._push.closed:
                return
            self._pending = True
            self._push.send(b"", zmq.NOBLOCK)

    def drain(self) -> None:
        """Read the wake-ups (owning thread), then let the next `wake` send again.

        The work queued before this returns is what the owner looks at next. The flag is
        cleared only after the drain: cleared before it, it could be set by a producer whose
        wake-up the drain then swallows, leaving the flag up and every later wake silent.
        """
        # Asking EVENTS is far cheaper than the zmq.Again a non-blocking recv raises when empty.
        while self.socket.get(zmq.EVENTS) & POLLIN:
            self.socket.recv(zmq.NOBLOCK)
        with self._lock:
            self._pending = False

    def close(self) -> None:
        with self._lock:
            self._push.close(linger=0)
        self.socket.close(linger=0)
