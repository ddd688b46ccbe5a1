"""The compute thread's own connections to peers: a copy made on that thread leaves from it.

Before, every copy to a peer was handed to the I/O thread (a queue and a wake-up), which then sent it on a
DEALER of its own. Measured on a 2-executor hop (`bench/cpu_per_call.py --mode Hops`), that hand-off was one of
the 11.5 thread wake-ups a hop cost. ZeroMQ sockets belong to one thread each, so the compute thread keeps
DEALERs of its own, one per peer it sends to. The compute thread polls them while idle (ZeroMQ does a socket's
pending work, such as taking up a reconnected peer, only when its owner touches it: unpolled, a copy sent just
before a reconnection waited seconds) and reads their acknowledgements between jobs; while a job runs, the I/O
thread reads them every second, before it checks the deadlines of copies (a long job, or a collective blocked on a
peer, must neither make a copy look lost nor hide a lost one). A lock passes the sockets between the two threads
(ZeroMQ allows a socket to move between threads behind a full memory barrier): the compute thread holds it while it
sleeps, the I/O thread only takes it when free. The replies' handlers run after it is let go, so its order against
the executor's lock never inverts.

Where a send cannot leave at once (a peer whose queue is full, a key we do not have), it goes the old way,
through the I/O thread, which retries and logs: nothing is dropped here that was not dropped before.
`PATHWAYS_SEND_FROM_COMPUTE=0` sends every copy through the I/O thread (to measure what this changes).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

import zmq

from pathways_torch.wire.security import Credentials, SecurityError
from pathways_torch.wire.wake import POLLIN

from .compute_loop import ComputeLoop
from .socket_outbox import peer_socket

__all__ = ["DirectPeers", "SEND_FROM_COMPUTE_ENV", "sends_from_compute"]

log = logging.getLogger(__name__)

SEND_FROM_COMPUTE_ENV = "PATHWAYS_SEND_FROM_COMPUTE"


def sends_from_compute() -> bool:
    """Whether copies leave from the compute thread (unless the environment says ``0``)."""
    return os.environ.get(SEND_FROM_COMPUTE_ENV, "1") != "0"


class DirectPeers:
    """DEALERs to peers for the compute thread (``compute``) to send on; what a peer sends back on one goes to
    ``on_frames(address, frames)``, on the thread that reads it (`read_replies`)."""

    def __init__(self, compute: ComputeLoop, context: zmq.Context, credentials: Credentials,
                 on_frames: Callable[[str, list], None]):
        self._compute = compute
        self._context = context
        self._credentials = credentials
        self._on_frames = on_frames
        self._lock = threading.Lock()      # the sockets, between the compute and the I/O thread
        compute.hold_while_idle(self._lock)   # polled by the compute thread while it sleeps
        self._sockets: dict[str, zmq.Socket] = {}
        self.keys: dict[str, bytes] = {}   # peer address -> the key its socket authenticates
        self.sent = 0                      # messages sent from the compute thread

    def on_own_thread(self) -> bool:
        return self._compute.on_loop_thread()

    def send(self, address: str, frames: list, public_key: bytes) -> bool:
        """Send ``frames`` to the peer at ``address`` now (compute thread); False if it must go another way."""
        with self._lock:
            socket = self._sockets.get(address)
            if socket is not None and self.keys.get(address) != public_key:
                self._close(address)   # a replacement at the same address (its key changed): a fresh connection
                socket = None
            if socket is None:
                socket = self._connect(address, public_key)
                if socket is None:
                    return False
            try:
                socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False   # its queue is full: the I/O thread keeps it and retries
            self.sent += 1
            return True

    def read_replies(self, *, by_io: bool = False) -> None:
        """Handle what peers sent back (acknowledgements), on the calling thread. ``by_io`` (the I/O thread's turn,
        as `TransferInbox.read` takes it): only if the compute thread does not hold the sockets; it reads them
        itself then."""
        replies = []
        if not self._lock.acquire(blocking=not by_io):
            return
        try:
            for address, socket in self._sockets.items():
                while socket.get(zmq.EVENTS) & POLLIN:
                    replies.append((address, socket.recv_multipart(zmq.NOBLOCK, copy=False)))
        finally:
            self._lock.release()
        for address, frames in replies:
            self._on_frames(address, frames)

    def _connect(self, address: str, public_key: bytes) -> zmq.Socket | None:
        try:
            socket = peer_socket(self._context, self._credentials, address, public_key)
        except SecurityError:
            return None   # the I/O thread's path logs why it is dropped
        self._sockets[address] = socket
        self.keys[address] = public_key
        self._compute.watch(socket)
        return socket

    def _close(self, address: str, unwatch: bool = True) -> None:
        self.keys.pop(address, None)
        socket = self._sockets.pop(address, None)
        if socket is not None:
            if unwatch:
                self._compute.unwatch(socket)
            socket.close(linger=0)

    def close_not_admitted(self, admits: Callable[[bytes], bool]) -> None:
        """Close the connections to replaced incarnations (their keys revoked; any thread: done on the compute
        thread, whose poller holds them)."""
        def close():
            with self._lock:
                for address in [a for a, key in self.keys.items() if not admits(key)]:
                    self._close(address)

        self._compute.call_soon(close)

    def close_all(self) -> None:
        """Close every connection (the executor stops; its compute thread polls no more)."""
        with self._lock:
            for address in list(self._sockets):
                self._close(address, unwatch=False)
