"""An executor's messages out, through a `SocketLoop`: to the controller, to clients, to peers.

Shared by the executor process (one executor, its compute thread sends to the controller) and the
simulating host (many executors on one loop: each has its own control connection and its own peer
connections, under its own key).
"""

from __future__ import annotations

import logging
from typing import Callable

import zmq

from pathways_torch.wire import SocketLoop, body_name, encode
from pathways_torch.wire.security import Credentials, SecurityError, make_client

__all__ = ["SocketOutbox", "peer_socket"]

log = logging.getLogger(__name__)


def peer_socket(context: zmq.Context, credentials: Credentials, address: str, public_key: bytes) -> zmq.Socket:
    """A DEALER connected to the peer at ``address``, CURVE to ``public_key``; raises `SecurityError` (the socket
    closed) for a key that is not one. The I/O thread's and the compute thread's (`DirectPeers`) are made alike."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        make_client(socket, credentials, public_key)
    except SecurityError:
        socket.close()
        raise
    socket.connect(address)
    return socket


class SocketOutbox:
    """Messages out: to the controller through ``send_control(frames)`` (the connection Register, Done and replies
    leave on), to clients on the data socket ``data_key`` and to peers on DEALERs of its own, both through the I/O
    loop. Peer sockets are named ``<peer_prefix><address>`` in the loop (executors sharing a loop keep theirs
    apart)."""

    def __init__(self, loop: SocketLoop, credentials: Credentials, *, data_key: str = "data",
                 peer_prefix: str = "peer:", send_control: Callable[[list], None] | None = None):
        self._loop = loop
        self._credentials = credentials
        self._data_key = data_key
        self._peer_prefix = peer_prefix
        self.send_control = send_control
        self.epoch = 0     # this incarnation (from Welcome): every message to the controller carries it
        self.on_peer_frames = None   # (address, frames) -> None: what a peer sends back (transfer acks)
        self.peer_keys: dict[str, bytes] = {}   # peer address -> the key its socket authenticates (I/O thread)
        self.direct = None   # `DirectPeers`: a message to a peer made on the compute thread leaves from there
        self.rings = None    # `HostRings`: a copy made on the compute thread to a peer of this host goes there

    def to_controller(self, envelope, payload=()):
        envelope.epoch = self.epoch
        self.send_control(encode(envelope, payload))

    def to_client(self, identity, envelope, payload=()):
        self._loop.send(self._data_key, [identity, *encode(envelope, payload)])

    def to_peer(self, address, envelope, payload=(), public_key=b"", direct=False, tag=None) -> bool:
        """``direct``: it may leave from the compute thread, if it was made there: through the peer's shared-memory
        ring where it has one (returns True: no acknowledgement will come; ``tag`` is reported if the ring breaks
        before the peer reads it), else on the compute thread's own connection (`DirectPeers`), which offers the
        peer a ring."""
        on_compute = direct and self.direct is not None and self.direct.on_own_thread()
        if on_compute and self.rings is not None and body_name(envelope) == "transfer":
            if self.rings.send(address, envelope, payload, public_key, tag):
                return True
            invite = self.rings.invite_for(address, public_key)
            if invite is not None:
                envelope.transfer.ring_invite.CopyFrom(invite)
        frames = encode(envelope, payload)
        if on_compute and self.direct.send(address, frames, public_key):
            return False

        def send():
            key = f"{self._peer_prefix}{address}"
            if self._loop.socket(key) is None:
                try:
                    socket = peer_socket(self._loop.context, self._credentials, address, public_key)
                except SecurityError as exc:
                    log.error("transfer to %s dropped: %s (the controller must send the peer's key)", address, exc)
                    return
                self._loop.add_socket(key, socket, lambda frames: self.on_peer_frames(address, frames))
                self.peer_keys[address] = public_key
            self._loop.send_now(key, frames)

        self._loop.call_soon(send)
        return False

    def close_peers_not_admitted(self, admits) -> None:
        """Close the connections to replaced incarnations (their keys, ``admits(key)`` False, were revoked): their
        addresses are dead, and ZeroMQ would retry them every 100 ms for good. A replacement has an address of its
        own."""
        def close():
            for address in [a for a, key in self.peer_keys.items() if not admits(key)]:
                self.close_peer(address)
                log.info("closed the connection to %s (a replaced incarnation's address)", address)

        self._loop.call_soon(close)
        if self.direct is not None:
            self.direct.close_not_admitted(admits)

    def peer_connections(self) -> int:
        """Connections to peers open now (the I/O thread's and the compute thread's)."""
        return len(self.peer_keys) + (len(self.direct.keys) if self.direct is not None else 0)

    def close_peer(self, address: str) -> None:
        """Close the connection to ``address`` (on the loop thread)."""
        self.peer_keys.pop(address, None)
        self._loop.close_socket(f"{self._peer_prefix}{address}")

    def close_all_peers(self) -> None:
        """Close every peer connection (on the loop thread): the executor stops."""
        for address in list(self.peer_keys):
            self.close_peer(address)
