"""The client's data plane: tensor bytes go straight between the client and executors.

``put`` sends a block to the executor that owns it (acknowledged, so the
controller frees nothing still in flight); ``fetch`` asks the owning executor
for a block. The controller's sockets never carry these bytes.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
from typing import Callable

import zmq

from .errors import ProtocolError, RemoteError
from .wire import SocketLoop, decode, encode, pb
from .wire.framing import FramingError
from .wire.tensors import frame_to_tensor, tensor_to_frame

__all__ = ["DataClient"]

log = logging.getLogger(__name__)


class DataClient:
    """One DEALER socket per executor, on the client's own I/O thread."""

    def __init__(self, context: zmq.Context | None = None):
        self.loop = SocketLoop("client-data", context)
        self._pending: dict[int, tuple[concurrent.futures.Future | None, Callable | None]] = {}
        self._lock = threading.Lock()
        self._request_ids = itertools.count(1)
        self.loop.start()

    def connect(self, executor_id: str, address: str) -> None:
        def add():
            if self.loop.socket(executor_id) is not None:
                return
            socket = self.loop.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
            self.loop.add_socket(executor_id, socket, self._on_frames)

        self.loop.call_soon(add)

    def put(self, executor_id: str, ref: pb.ShardRef, tensor, on_ack: Callable[[], None]) -> None:
        request_id = self._register(None, on_ack)
        msg = pb.Put(request_id=request_id)
        msg.shard.CopyFrom(ref)
        frame = tensor_to_frame(tensor, msg.tensor, 1)
        self.loop.send(executor_id, encode(pb.Envelope(put=msg), [frame]))

    def fetch(self, executor_id: str, ref: pb.ShardRef) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        request_id = self._register(future, None)
        msg = pb.Fetch(request_id=request_id)
        msg.shard.CopyFrom(ref)
        self.loop.send(executor_id, encode(pb.Envelope(fetch=msg)))
        return future

    def close(self) -> None:
        self.loop.stop()

    @property
    def bytes_sent(self) -> int:
        return sum(self.loop.payload_bytes_out.values())

    @property
    def bytes_received(self) -> int:
        return sum(self.loop.payload_bytes_in.values())

    def _register(self, future, on_ack) -> int:
        with self._lock:
            request_id = next(self._request_ids)
            self._pending[request_id] = (future, on_ack)
        return request_id

    def _on_frames(self, frames) -> None:
        try:
            envelope, payload = decode(frames)
        except FramingError as exc:
            log.warning("client: dropped a malformed message: %s", exc)
            return
        kind = envelope.WhichOneof("body")
        reply = getattr(envelope, kind)
        with self._lock:
            future, on_ack = self._pending.pop(reply.request_id, (None, None))
        if kind == "put_ack" and on_ack is not None:
            on_ack()
        elif kind == "fetch_reply" and future is not None:
            if reply.failed:
                f = reply.failure
                future.set_exception(RemoteError(f.message, executor_id=f.executor_id, remote_type=f.type,
                                                 remote_traceback=f.traceback))
            else:
                future.set_result(frame_to_tensor(reply.tensor, payload))
        else:
            log.warning("client: unexpected %s (request %s) dropped", kind, reply.request_id)
            if future is not None:
                future.set_exception(ProtocolError(f"unexpected reply {kind}"))
