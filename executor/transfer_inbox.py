"""Where peers' copies land: a ROUTER the compute thread reads, so a copy starts the run that waits for it with no
hand-off through the I/O thread.

Before, a copy came in on the data socket (the I/O thread: a wake-up, the executor's lock, the store) and the run it
completed was handed to the compute thread (a second wake-up). Now peers of the island send copies here (the
controller names this address, `Register.transfer_address`); the compute thread polls it with its command socket
when idle, and reads it between jobs.

A long job must not hold a copy's acknowledgement past the sender's deadline (the sender would report it lost). So
the socket is passed between the two threads under a lock, as ZeroMQ allows (a full memory barrier between the
threads that use a socket): the compute thread holds it while it reads or sleeps in its poll, and lets it go while it
runs a job; the I/O thread then reads the socket every `IO_READ_INTERVAL_S` if the lock is free. Acknowledgements
are queued, and sent by whichever thread next holds the lock (never a wait on the lock while the executor's lock is
held: the two are never taken in opposite orders).

`PATHWAYS_RECEIVE_ON_COMPUTE=0` leaves copies on the data socket (the I/O thread), as before (to measure what this
changes). Only copies are taken here (a put or fetch sent here is dropped and counted): clients keep the data socket. Copies
between islands still go through the link's relay to the data socket.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Callable

import zmq

from pathways_torch.wire import encode
from pathways_torch.wire.security import Credentials, make_server
from pathways_torch.wire.wake import POLLIN

__all__ = ["TransferInbox", "IO_READ_INTERVAL_S", "RECEIVE_ON_COMPUTE_ENV", "receives_on_compute"]

log = logging.getLogger(__name__)

IO_READ_INTERVAL_S = 0.2   # how often the I/O thread reads the inbox (to acknowledge copies) while a job runs
_READ_BATCH = 64
RECEIVE_ON_COMPUTE_ENV = "PATHWAYS_RECEIVE_ON_COMPUTE"


def receives_on_compute() -> bool:
    """Whether peers' copies land on the transfer inbox (unless the environment says ``0``)."""
    return os.environ.get(RECEIVE_ON_COMPUTE_ENV, "1") != "0"


class TransferInbox:
    """The ROUTER peers send copies to; ``on_frames(frames)`` handles each message (with the executor's lock)."""

    def __init__(self, context: zmq.Context, credentials: Credentials, bind_host: str,
                 on_frames: Callable[[list], None]):
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # A sender that stops reading: an acknowledgement raises at its high-water mark and waits in the queue.
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        make_server(self.socket, credentials)
        self.socket.bind(f"tcp://{bind_host}:0")
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.lock = threading.Lock()
        self._on_frames = on_frames
        self._acks: collections.deque = collections.deque()
        self.read_by_io = 0   # messages the I/O thread read (the compute thread ran a job meanwhile)

    def reply(self, identity: bytes, envelope, payload=()) -> None:
        """Queue a reply to the peer that sent on ``identity`` (any thread); it leaves with the next read."""
        self._acks.append([identity, *encode(envelope, payload)])

    def read(self, *, by_io: bool = False) -> bool:
        """Send the queued replies and handle the messages waiting, on the calling thread. ``by_io``: the I/O
        thread's turn, taken only if the lock is free now (the compute thread waits for it); returns whether it
        read."""
        wait = not by_io
        if not self.lock.acquire(blocking=wait):
            return False
        try:
            self.flush()
            messages = self._take()
        finally:
            self.lock.release()
        if by_io:
            self.read_by_io += len(messages)
        for frames in messages:
            self._on_frames(frames)
        # The replies those made leave now, unless the compute thread took the inbox back meanwhile: it sends them
        # when it wakes (a run a copy made ready wakes it; its poll ends within 100 ms). The I/O thread never waits.
        if messages and self._acks and self.lock.acquire(blocking=wait):
            try:
                self.flush()
            finally:
                self.lock.release()
        return True

    def flush(self) -> None:
        """Send the queued replies (the caller holds the lock). A peer that reads none: kept, and tried again."""
        while self._acks:
            try:
                self.socket.send_multipart(self._acks[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:   # EHOSTUNREACH: the sender's connection is gone; it reports the copy itself
                log.info("a copy's acknowledgement was dropped: %s", exc)
            self._acks.popleft()

    def _take(self) -> list:
        messages = []
        while len(messages) < _READ_BATCH and self.socket.get(zmq.EVENTS) & POLLIN:
            messages.append(self.socket.recv_multipart(zmq.NOBLOCK, copy=False))
        return messages

    def close(self) -> None:
        with self.lock:
            self.socket.close(linger=0)
