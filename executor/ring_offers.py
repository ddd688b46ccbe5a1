"""How two executors of one host pair up for a shared-memory ring, over the authenticated channel they already
have (the steps are executor/shm_ring.py's module docstring): the sender's `RingInviter` (a listening abstract
Unix socket, a token per peer, the rings that come back) and the receiver's `make_ring_for`."""

from __future__ import annotations

import array
import logging
import os
import secrets
import socket
import struct
import time

from .shm_ring import RING_BYTES, Ring, RingRefused

__all__ = ["RingInviter", "make_ring_for", "fds_of", "peer_uid"]

log = logging.getLogger(__name__)

_INVITE_PREFIX = b"\0pathways-ring-"
_TOKEN_BYTES = 16
_CONNECTION_WAIT_S = 5.0   # an inviter keeps a connection whose message has not come this long


class RingInviter:
    """The sender's offers: one listening abstract Unix socket (``socket``, polled by its compute thread), a token per peer
    incarnation invited (its address and key), and the rings that came back (`take`)."""

    def __init__(self, epoch: int):
        self.epoch = epoch
        # A listening SOCK_SEQPACKET socket: the receiver connects, checks who listens (SO_PEERCRED: our own uid) and
        # only then sends the ring's descriptors; we check who connected the same way.
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        self.name = _INVITE_PREFIX + secrets.token_hex(16).encode()
        self.socket.bind(self.name)
        self.socket.listen(64)
        self._connections: list = []   # (accepted socket, when): their message not read yet
        self._tokens: dict[bytes, tuple[str, bytes]] = {}    # token -> (peer address, its key)
        self._by_peer: dict[tuple[str, bytes], bytes] = {}
        self.refused = 0

    def invite(self, address: str, key: bytes) -> tuple[bytes, bytes]:
        """(socket name, token) to offer the peer at ``address`` holding ``key`` (the same until it answers)."""
        token = self._by_peer.get((address, key))
        if token is None:
            token = secrets.token_bytes(_TOKEN_BYTES)
            self._by_peer[(address, key)] = token
            self._tokens[token] = (address, key)
        return self.name, token

    def take(self, most: int = 16) -> list[tuple[str, bytes, Ring]]:
        """The rings peers sent since the last call (at most ``most``), as (address, key, ring); what does not check
        is refused (the first ten refusals logged). A connection whose message has not come yet is read next time
        (dropped after `_CONNECTION_WAIT_S`)."""
        while len(self._connections) < most:
            try:
                connection, _ = self.socket.accept()
            except BlockingIOError:
                break
            connection.setblocking(False)
            self._connections.append((connection, time.monotonic()))
        rings, waiting = [], []
        for connection, since in self._connections:
            try:
                data, ancillary, _, _ = connection.recvmsg(256, socket.CMSG_SPACE(3 * 4), socket.MSG_CMSG_CLOEXEC)
            except BlockingIOError:
                if time.monotonic() - since < _CONNECTION_WAIT_S:
                    waiting.append((connection, since))
                else:
                    connection.close()
                continue
            except OSError:
                connection.close()
                continue
            uid = peer_uid(connection)
            connection.close()
            ring = self._ring_of(data, ancillary, uid)
            if ring is not None:
                rings.append(ring)
        self._connections = waiting
        return rings

    def _ring_of(self, data: bytes, ancillary, uid: int):
        """(address, key, ring) from one connection's message, or None (refused, its descriptors closed)."""
        fds = fds_of(ancillary)
        peer = self._tokens.get(data[:_TOKEN_BYTES]) if len(data) >= _TOKEN_BYTES + 8 else None
        if peer is None or uid != os.getuid() or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            self._refuse("an unknown token" if peer is None else f"from uid {uid}" if uid != os.getuid() else
                         f"{len(fds)} descriptors, expected 3")
            return None
        (reader_epoch,) = struct.unpack_from("<Q", data, _TOKEN_BYTES)
        try:
            ring = Ring.attach(fds, self.epoch, reader_epoch)
        except RingRefused as exc:
            self._refuse(f"from {peer[0]}: {exc}")
            return None
        self.forget(*peer)
        return (*peer, ring)

    def _refuse(self, why: str) -> None:
        self.refused += 1
        if self.refused <= 10:
            log.warning("a ring offer refused: %s", why)

    def forget(self, address: str, key: bytes) -> None:
        """Stop offering to that peer (it answered, is gone, or was replaced)."""
        token = self._by_peer.pop((address, key), None)
        self._tokens.pop(token, None)

    def close(self) -> None:
        for connection, _ in self._connections:
            connection.close()
        self.socket.close()


def fds_of(ancillary) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return list(fds)


def peer_uid(connection: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (SO_PEERCRED), -1 if unknown."""
    try:
        _, uid, _ = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                             struct.calcsize("3i")))
        return uid
    except OSError:
        return -1


def make_ring_for(name: bytes, token: bytes, writer_epoch: int, reader_epoch: int,
                  capacity: int = RING_BYTES) -> Ring | None:
    """The receiver's answer to an invite: a ring made and sent to the inviter's socket ``name``; None where that
    socket is not reachable from here (another host or network namespace: the peer stays on ZeroMQ)."""
    if not name.startswith(_INVITE_PREFIX) or len(token) != _TOKEN_BYTES:
        return None
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
    ring = None
    try:
        sender.connect(name)
        if peer_uid(sender) != os.getuid():   # a name taken by a process of another user: it gets nothing
            log.warning("a ring offer refused: the inviter's socket belongs to uid %d", peer_uid(sender))
            return None
        ring = Ring.create(writer_epoch, reader_epoch, capacity)
        sender.sendmsg([token + struct.pack("<Q", reader_epoch)],
                       [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [ring.memfd, ring.data_fd,
                                                                                 ring.space_fd]))])
    except OSError as exc:   # ECONNREFUSED / ENOENT: no such socket here; EAGAIN: its backlog is full
        if ring is not None:
            ring.close()
        log.debug("no ring to the inviter %r: %s", name, exc)
        return None
    finally:
        sender.close()
    return ring
