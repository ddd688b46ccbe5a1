"""The client's data plane: tensor bytes go straight between the client and executors.

``put`` sends a block to the executor that owns it (acknowledged, so the
controller frees nothing still in flight); ``fetch`` asks the owning executor
for a block. The controller's sockets never carry these bytes.

Each DEALER is a CURVE client that talks only to the holder of that executor's
key. A request never hangs on an executor that is gone or that refused us: it
fails with `ExecutorLostError` (the controller declared the executor lost) or
`AuthenticationError` (the handshake failed, seen by the socket monitor).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
from typing import Callable

import zmq

from .errors import AuthenticationError, ProtocolError, RemoteError
from .wire import SocketLoop, decode, encode, pb
from .wire.framing import FramingError
from .wire.loop import RECONNECT_BACKOFF_MAX_MS
from .wire.put_tokens import shard_put_token
from .wire.security import HANDSHAKE_FAILURES, ConnectionWatch, Credentials, make_client
from .wire.tensors import frame_to_tensor, tensor_to_frame

__all__ = ["DataClient"]

log = logging.getLogger(__name__)

# Requests in flight to one executor before the next waits (back-pressure on the client's thread, never
# on the I/O thread): an executor that stops reading holds at most this many of our messages.
MAX_REQUESTS_PER_EXECUTOR = 1024


@dataclasses.dataclass
class _Request:
    executor_id: str
    future: concurrent.futures.Future | None = None           # a fetch
    on_done: Callable[[BaseException | None], None] | None = None   # a put: called with None once acknowledged


class DataClient:
    """One authenticated DEALER socket per executor, on the client's own I/O thread."""

    def __init__(self, context: zmq.Context, credentials: Credentials):
        self.loop = SocketLoop("client-data", context)
        self._credentials = credentials
        self._pending: dict[int, _Request] = {}
        self._targets: dict[str, tuple[str, bytes]] = {}   # executor → (address, public key) (loop thread)
        self._unavailable: dict[str, BaseException] = {}   # executor → why requests to it fail (loop thread)
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)       # notified as requests finish
        self._in_flight: collections.Counter = collections.Counter()   # executor → requests pending
        self._request_ids = itertools.count(1)
        self.dropped_replies = 0    # malformed, unexpected, or not an answer to a request sent to their sender
        self.loop.start()

    def connect(self, executor_id: str, address: str, public_key: bytes) -> None:
        """Know ``executor_id`` at ``address``, holding the secret of ``public_key``. The socket opens at the first
        request to it: a run needs no data socket, and 1,024 executors registering would otherwise be 1,024 CURVE
        handshakes during start-up, each answered by a Python ZAP handler in the executor's (simulating) process."""
        def remember():
            self._targets[executor_id] = (address, public_key)

        self.loop.call_soon(remember)

    def _open(self, executor_id: str) -> bool:
        """Open the socket to a known executor (loop thread); False if the controller never announced it."""
        target = self._targets.get(executor_id)
        if target is None:
            return False
        address, public_key = target
        socket = self.loop.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        # A dead executor's address is retried with back-off, not every 100 ms for good: a process of 64
        # simulated executors lost is 640 retries a second, each a monitor event on this loop.
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_BACKOFF_MAX_MS)
        make_client(socket, self._credentials, public_key)
        socket.connect(address)
        # Each socket's replies are read as that executor's: a reply matches a request sent there alone.
        self.loop.add_socket(executor_id, socket, lambda frames: self._on_frames(executor_id, frames))
        watch = ConnectionWatch(f"client → {executor_id}",
                                lambda event, w: self._on_connection_event(executor_id, event, w))
        self.loop.monitor(executor_id, watch.on_frames)
        return True

    def reconnect(self, executor_id: str, address: str, public_key: bytes) -> None:
        """A replacement took ``executor_id``'s place: talk to it (at ``address``, holding ``public_key``) from now
        on. What was pending to the old incarnation failed when it was declared lost."""
        def forget():
            self.loop.close_socket(executor_id)
            self._unavailable.pop(executor_id, None)

        self.loop.call_soon(forget)
        self.connect(executor_id, address, public_key)

    def put(self, executor_id: str, shards: list, on_done: Callable[[BaseException | None], None]) -> None:
        """Send ``shards`` — (``pb.ShardRef``, tensor) pairs, or (``pb.ShardRef``, tensor, put token) triples (the
        token the controller gave with the array: a service client's puts need it) — in one message;
        ``on_done(None)`` once all landed, ``on_done(error)`` if they never will."""
        request_id = self._register(_Request(executor_id, on_done=on_done))
        msg = pb.Put(request_id=request_id)
        frames = []
        for index, (ref, tensor, *token) in enumerate(shards):
            item = msg if index == 0 else msg.more.add()
            item.shard.CopyFrom(ref)
            if token and token[0]:   # the array's tokens, one per shard: this shard's is good for this put alone
                item.token = shard_put_token(token[0], ref.shard)
            frames.append(tensor_to_frame(tensor, item.tensor, index + 1))
        self._send(executor_id, request_id, encode(pb.Envelope(put=msg), frames))

    def fetch(self, executor_id: str, ref: pb.ShardRef) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        request_id = self._register(_Request(executor_id, future=future))
        msg = pb.Fetch(request_id=request_id)
        msg.shard.CopyFrom(ref)
        self._send(executor_id, request_id, encode(pb.Envelope(fetch=msg)))
        return future

    def save(self, executor_id: str, refs: list, names: list[str], path: str) -> concurrent.futures.Future:
        """Ask ``executor_id`` to write its shards ``refs`` (as ``names``) to the file ``path`` once they are
        ready; the future resolves to the bytes written (no tensor bytes come here)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        request_id = self._register(_Request(executor_id, future=future))
        msg = pb.SaveShards(request_id=request_id, names=names, path=path)
        for ref in refs:
            msg.shards.add().CopyFrom(ref)
        self._send(executor_id, request_id, encode(pb.Envelope(save_shards=msg)))
        return future

    def executor_lost(self, executor_id: str, error: BaseException) -> None:
        """The controller declared ``executor_id`` lost: fail its requests, now and later (any thread)."""
        self.loop.call_soon(lambda: self._fail_executor(executor_id, error))

    def close(self) -> None:
        self.loop.stop()

    @property
    def bytes_sent(self) -> int:
        return sum(self.loop.payload_bytes_out.values())

    @property
    def bytes_received(self) -> int:
        return sum(self.loop.payload_bytes_in.values())

    # ------------------------------------------------------------ loop thread

    def _register(self, request: _Request) -> int:
        executor_id = request.executor_id
        with self._lock:
            # Past the bound, wait for a reply (or for the executor to be declared lost, which fails them all).
            self._room.wait_for(lambda: self._in_flight[executor_id] < MAX_REQUESTS_PER_EXECUTOR
                                or executor_id in self._unavailable)
            request_id = next(self._request_ids)
            self._pending[request_id] = request
            self._in_flight[executor_id] += 1
        return request_id

    def _send(self, executor_id: str, request_id: int, frames: list) -> None:
        def send():
            error = self._unavailable.get(executor_id)
            if error is not None:
                self._finish(request_id, error)
            elif self.loop.socket(executor_id) is None and not self._open(executor_id):
                self._finish(request_id, ProtocolError(
                    f"no executor {executor_id!r} is known to this client: expected one the controller announced "
                    f"(known: {sorted(self._targets)[:8]}); use an array's own placement"))
            else:
                self.loop.send_now(executor_id, frames)

        self.loop.call_soon(send)

    def _on_connection_event(self, executor_id: str, event: str, watch: ConnectionWatch) -> None:
        if event in HANDSHAKE_FAILURES and watch.rejected:
            self._fail_executor(executor_id, AuthenticationError(
                f"executor {executor_id} refused this client's key, or does not hold the key the controller "
                f"announced for it ({event}); every process must use the launcher's key directory",
                peer=executor_id))
        elif event == "HANDSHAKE_SUCCEEDED" and isinstance(self._unavailable.get(executor_id), AuthenticationError):
            del self._unavailable[executor_id]   # a later handshake worked: the failure was not for good

    def _fail_executor(self, executor_id: str, error: BaseException) -> None:
        # A loss is final, so it replaces a handshake failure (which a later handshake may clear).
        current = self._unavailable.get(executor_id)
        if current is None or (isinstance(current, AuthenticationError) and not isinstance(error, AuthenticationError)):
            self._unavailable[executor_id] = error
        with self._lock:
            doomed = [rid for rid, r in self._pending.items() if r.executor_id == executor_id]
        for request_id in doomed:
            self._finish(request_id, error)

    def _finish(self, request_id: int, error: BaseException | None, result=None) -> None:
        with self._lock:
            request = self._pending.pop(request_id, None)
            if request is not None:
                self._in_flight[request.executor_id] -= 1
                self._room.notify_all()
        if request is None:
            return
        if request.on_done is not None:
            request.on_done(error)
        elif error is not None:
            request.future.set_exception(error)
        else:
            request.future.set_result(result)

    def _drop_reply(self, why: str, *args) -> None:
        self.dropped_replies += 1
        if self.dropped_replies <= 10 or self.dropped_replies % 1000 == 0:   # a peer must not flood the log
            log.warning("client: " + why, *args)

    def _on_frames(self, executor_id: str, frames) -> None:
        """A message from ``executor_id`` (the socket it came on): the answer to a request sent to it, or dropped."""
        try:
            envelope, payload = decode(frames)
        except FramingError as exc:
            self._drop_reply("dropped a malformed message from %s: %s", executor_id, exc)
            return
        kind = envelope.WhichOneof("body")
        if kind not in ("put_ack", "fetch_reply", "save_reply"):
            self._drop_reply("unexpected %s from %s dropped", kind, executor_id)
            return
        reply = getattr(envelope, kind)
        with self._lock:
            request = self._pending.get(reply.request_id)
        if request is None or (kind == "put_ack") != (request.on_done is not None):
            self._drop_reply("%s for unknown request %s from %s dropped", kind, reply.request_id, executor_id)
            return
        if request.executor_id != executor_id:
            # Request ids are sequential: another executor could guess one and answer for the one asked.
            self._drop_reply("%s for request %s came from %s, but the request went to %s: dropped", kind,
                             reply.request_id, executor_id, request.executor_id)
            return
        if kind == "put_ack":
            f = reply.failure
            self._finish(reply.request_id, RemoteError(f"the executor could not keep the put: {f.message}",
                                                       executor_id=f.executor_id, remote_type=f.type,
                                                       remote_traceback=f.traceback) if reply.failed else None)
        elif reply.failed:
            f = reply.failure
            self._finish(reply.request_id, RemoteError(f.message, executor_id=f.executor_id, remote_type=f.type,
                                                       remote_traceback=f.traceback))
        elif kind == "save_reply":
            self._finish(reply.request_id, None, int(reply.bytes))
        else:
            try:
                tensor = frame_to_tensor(reply.tensor, payload)
            except ValueError as exc:
                self._finish(reply.request_id, ProtocolError(f"executor sent a bad tensor: {exc}"))
                return
            self._finish(reply.request_id, None, tensor)
