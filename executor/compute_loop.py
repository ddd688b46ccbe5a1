"""The compute thread's loop: it reads the controller's messages and runs the executor's jobs.

The controller sends control messages (runs, program runs, push requests, frees,
requests for stats) to the executor's *command* ROUTER, and the executor answers
(Register, Done, replies) on its control DEALER; this thread alone owns both. A
run whose inputs are ready is started by the thread that read it: an OpByOp call
costs no wake-up of a second thread on its way in, and its Done leaves at once.

Other threads (the I/O thread: puts and fetches on the data socket, compile
results) hand work over with `call_soon`, which wakes this thread through an
inproc pipe (`pathways_torch.wire.wake.WakePipe`, as `SocketLoop` does). Peers'
copies land on the transfer inbox, which this thread polls while idle and reads
between jobs (executor/transfer_inbox.py: the I/O thread reads it while a job runs).

Between two jobs the thread reads every control message already waiting, so runs
and push requests the controller sent ahead are queued before the next job starts.
While a job runs, control messages wait in the socket. That is safe for
collectives because the controller sends the push requests a call's inputs need
before any of the call's runs (`CallDispatch.call`): a collective never waits for a
push whose request is still unread behind it.

This module imports no torch (simulated executors use it).
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable

import zmq

from pathways_torch.wire.wake import POLLIN, WakePipe

__all__ = ["ComputeLoop"]

log = logging.getLogger(__name__)

_READ_BATCH = 64   # control messages read before the next queued job runs


class ComputeLoop:
    """Owns ``commands`` (read: ``on_control(frames)`` handles each message) and ``replies`` (send
    only) on the thread that calls `run`."""

    def __init__(self, name: str, context: zmq.Context, *, commands: zmq.Socket, replies: zmq.Socket,
                 on_control: Callable[[list], None]):
        self.name = name
        self._commands = commands
        self._replies = replies
        self._on_control = on_control
        self._calls: collections.deque = collections.deque()
        self._waker = WakePipe(context, f"compute-{name}")
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.between_jobs: Callable[[], None] | None = None   # run before each job, and before each wait
        self._inbox = None   # `TransferInbox`: polled with the commands while idle (`share_inbox`)
        self._poller = zmq.Poller()
        self._poller.register(self._commands, zmq.POLLIN)
        self._poller.register(self._waker.socket, zmq.POLLIN)
        self._held_while_idle: list = []   # locks of sockets shared with the I/O thread, held while this one polls
        # Asked before each sleep: False keeps the thread awake (a shared-memory ring has a message; its writer wakes
        # a sleeping reader only if asked to: executor/host_rings.py); ``after_sleep`` runs when it wakes.
        self.before_sleep: Callable[[], bool] | None = None
        self.after_sleep: Callable[[], None] | None = None

    # ------------------------------------------------------------ any thread

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the compute thread, after what is queued before it (never inline)."""
        self._calls.append(fn)
        if self.on_loop_thread():
            return   # the loop looks at the queue before it waits
        self._waker.wake()

    def send(self, frames: list) -> None:
        """Send to the controller: at once on the compute thread, else queued for it."""
        if self.on_loop_thread():
            self._replies.send_multipart(frames, copy=False)
        else:
            self.call_soon(lambda: self._replies.send_multipart(frames, copy=False))

    def share_inbox(self, inbox) -> None:
        """Poll ``inbox.socket`` too while idle, holding ``inbox.lock`` (the I/O thread reads it while a job runs:
        executor/transfer_inbox.py); set up before `run`."""
        self._inbox = inbox
        self.hold_while_idle(inbox.lock)
        self._poller.register(inbox.socket, zmq.POLLIN)

    def hold_while_idle(self, lock) -> None:
        """Hold ``lock`` while polling (the sockets it guards are this thread's then); set up before `run`."""
        self._held_while_idle.append(lock)

    def watch(self, socket) -> None:
        """Wake for ``socket`` too while idle (compute thread): ZeroMQ carries out a socket's pending work (a
        reconnection's hand-over, say) only when its owner touches it, so a socket that only sends must be polled.
        Also a file descriptor (an eventfd) or an object with ``fileno()``."""
        self._poller.register(socket, zmq.POLLIN)

    def unwatch(self, socket) -> None:
        """Stop polling ``socket`` (compute thread, before it is closed)."""
        self._poller.unregister(socket)

    def stop(self) -> None:
        self._stopping = True
        self.call_soon(lambda: None)

    # ------------------------------------------------------------ the compute thread

    def run(self) -> None:
        self._thread = threading.current_thread()
        try:
            while not self._stopping:
                self._read_control()
                if self.between_jobs is not None:
                    self._run_one(self.between_jobs)
                if self._calls:
                    self._run_one(self._calls.popleft())
                    continue
                for socket, _ in self._poll_idle():
                    if socket is self._waker.socket:
                        self._waker.drain()   # calls queued before it are looked at next
        finally:
            self._waker.close()
            self._commands.close(linger=0)
            self._replies.close(linger=0)

    def _poll_idle(self) -> list:
        """Sleep until a message or a hand-over comes. The shared sockets are this thread's while it sleeps (their
        locks held); the inbox's queued replies leave first, and a copy that came since the last read is read
        before sleeping."""
        for lock in self._held_while_idle:
            lock.acquire()
        try:
            if self._inbox is not None:
                self._inbox.flush()
                if self._inbox.socket.get(zmq.EVENTS) & POLLIN:
                    return []   # read between jobs, next turn
            if self.before_sleep is not None and not self._asked(self.before_sleep, True):
                return []
            try:
                return self._poller.poll(100)
            finally:
                if self.after_sleep is not None:
                    self._asked(self.after_sleep, None)
        finally:
            for lock in reversed(self._held_while_idle):
                lock.release()

    def _asked(self, hook: Callable, fallback):
        """``hook()``, or ``fallback`` if it raised (logged: a bug of ours must not end the compute thread)."""
        try:
            return hook()
        except Exception:
            log.exception("%s: a sleep hook on the compute thread failed", self.name)
            return fallback

    def _read_control(self) -> None:
        # Asking EVENTS is far cheaper than the zmq.Again a non-blocking recv raises when empty.
        for _ in range(_READ_BATCH):
            if self._stopping or not self._commands.get(zmq.EVENTS) & POLLIN:
                return
            self._run_one(lambda: self._on_control(self._commands.recv_multipart(zmq.NOBLOCK, copy=False)))

    def _run_one(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:   # a bug of ours: log it, keep serving the rest
            log.exception("%s: a call on the compute thread failed", self.name)
