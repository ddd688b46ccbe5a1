"""The controller's sockets: one ROUTER that every executor's DEALER connects to."""

from __future__ import annotations

import logging

import zmq

from pathways_torch.wire import SocketLoop, decode, encode
from pathways_torch.wire.framing import FramingError

from .config import ControllerConfig
from .dispatch import Controller

__all__ = ["ControllerServer"]

log = logging.getLogger(__name__)

_ROUTER = "executors"


class ControllerServer:
    """Runs a `Controller` behind a ZeroMQ ROUTER on its own I/O thread."""

    def __init__(self, config: ControllerConfig | None = None, context: zmq.Context | None = None):
        self.config = config or ControllerConfig()
        self.loop = SocketLoop("controller", context)
        socket = self.loop.context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        socket.bind(self.config.bind_address)
        self.address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.loop.add_socket(_ROUTER, socket, self._on_frames)
        self.controller = Controller(self, self.config)
        self.loop.every(self.config.heartbeat_interval_s, self.controller.heartbeat)
        self.dropped_messages = 0

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()

    def to_executor(self, executor_id, envelope, payload=()) -> None:
        frames = [executor_id.encode(), *encode(envelope, payload)]
        if self.config.inject_latency_s > 0:
            self.loop.call_later(self.config.inject_latency_s, lambda: self.loop.send_now(_ROUTER, frames))
        else:
            self.loop.send(_ROUTER, frames)

    def _on_frames(self, frames) -> None:
        try:
            identity = frames[0].bytes.decode()
            envelope, payload = decode(frames[1:])
        except (FramingError, UnicodeDecodeError, IndexError) as exc:
            self.dropped_messages += 1
            log.warning("controller: dropped a malformed message: %s", exc)
            return
        self.controller.on_message(identity, envelope, payload)

    @property
    def payload_bytes(self) -> dict[str, int]:
        """Tensor bytes this process's controller sockets carried (program constants only, by design)."""
        return {"sent": self.loop.payload_bytes_out[_ROUTER], "received": self.loop.payload_bytes_in[_ROUTER]}
