"""Waking a thread that blocks in a ZeroMQ poll, from any other thread.

Both loops that own sockets — `SocketLoop` (the I/O thread of each process) and the
executor's `ComputeLoop` — sleep in ``zmq.Poller.poll``; other threads queue work for
them and then call `WakePipe.wake`. One wake-up message goes per batch of work: a
flag says one is on its way, because each inproc send costs tens of microseconds
and a training step queues a dozen.
"""

from __future__ import annotations

import itertools
import os
import select
import threading
import time

import zmq

__all__ = ["WakePipe", "POLLIN", "set_at_turn_end", "defer_sets_on_this_thread", "sets_deferred", "end_turn",
           "ThreadWaker", "this_threads_waker"]

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



# Waiters woken when their loop is about to sleep, not mid-turn: a thread woken while the waking thread still runs
# Python finds the GIL (and often the controller's lock) held, blocks again and is woken a second and third time
# (futex waits on the GIL's condition, then on its mutex: seen with perf). `SocketLoop` sets them just before it
# blocks with nothing left to read, or after one more turn at most (a busy loop must not hold a waiter back).
_turn = threading.local()


def set_at_turn_end(event) -> None:
    """Set ``event`` once this thread's loop has nothing left to do (`SocketLoop`); else, on any other thread, now."""
    pending = getattr(_turn, "events", None)
    if pending is None:
        event.set()
    else:
        pending.append(event)


def defer_sets_on_this_thread() -> None:
    """From now on this thread runs a loop: `set_at_turn_end` waits for its `end_turn`."""
    _turn.events = []


def sets_deferred() -> bool:
    """Whether this thread holds events to set."""
    return bool(_turn.events)


def end_turn() -> None:
    """Set the events this thread deferred (its loop is about to block, or has held them a turn)."""
    pending = _turn.events
    while pending:
        pending.pop().set()


class ThreadWaker:
    """What one thread blocks on while it waits for an array: an eventfd (a pipe where there is none).

    Its wait (a poll of the fd) and its `set` (a write) both run with the GIL let go. A `threading.Event` is set
    under the GIL: the woken thread, often scheduled onto the waker's core at once, finds the GIL held and blocks
    twice more (measured: an awaited 128-node program's client thread woke 1.6 to 2 times per call). Here the
    waker's write lets the GIL go first, so the waiter wakes once and runs. A `set` may come after a wait timed
    out: the next wait then returns early, which its caller's loop (the state it waits for) absorbs.
    """

    def __init__(self):
        if hasattr(os, "eventfd"):
            self._read_fd = self._write_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        else:
            self._read_fd, self._write_fd = os.pipe()
            os.set_blocking(self._read_fd, False)
        self._poll = select.poll()
        self._poll.register(self._read_fd, select.POLLIN)

    def set(self) -> None:
        """Wake the thread (any thread; a no-op once the waker is closed)."""
        try:
            os.write(self._write_fd, b"\x01\0\0\0\0\0\0\0")   # lets the GIL go around the write
        except (OSError, ValueError):
            pass   # closed (its thread ended), or a pipe already full: the thread is woken either way

    def wait(self, timeout_s: float | None) -> None:
        """Block until `set` (or one that came before), or ``timeout_s`` passes; the flag is cleared."""
        self._poll.poll(None if timeout_s is None else max(0, int(timeout_s * 1000 + 0.999)))
        try:
            os.read(self._read_fd, 4096)
        except BlockingIOError:
            pass

    def wait_until(self, done, timeout_s: float | None) -> bool:
        """Wait until ``done()``; False if ``timeout_s`` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self.wait(left)
        return True

    def __del__(self):
        for fd in {self._read_fd, self._write_fd}:
            try:
                os.close(fd)
            except OSError:
                pass
        self._read_fd = self._write_fd = -1


_wakers = threading.local()


def this_threads_waker() -> ThreadWaker:
    """The calling thread's `ThreadWaker` (made at its first wait, closed when the thread ends)."""
    waker = getattr(_wakers, "waker", None)
    if waker is None:
        waker = _wakers.waker = ThreadWaker()
    return waker
