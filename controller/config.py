"""Controller configuration, validated up front."""

from __future__ import annotations

import dataclasses

__all__ = ["ControllerConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """Where the controller listens and how it watches executors.

    ``bind_address`` is loopback unless told otherwise (executors run code the
    controller sends; see docs/security.md).
    """

    bind_address: str = "tcp://127.0.0.1:0"
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 10.0
    request_timeout_s: float = 30.0
    collective_timeout_s: float = 60.0   # gloo groups: a dead peer surfaces as an error after this
    # Tests and benchmarks only: delay every controller→executor message by this much,
    # to show that parallel dispatch hides control latency.
    inject_latency_s: float = 0.0
    # Bounded run-ahead: a call waits (on the client's thread) while this many calls are unfinished, so
    # the queues to executors and the tables here stay bounded however far ahead the client runs.
    max_inflight_calls: int = 256

    def __post_init__(self):
        if not isinstance(self.max_inflight_calls, int) or self.max_inflight_calls < 1:
            raise ValueError(f"max_inflight_calls: expected a positive int, got {self.max_inflight_calls!r}")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError(f"heartbeats: expected 0 < interval ({self.heartbeat_interval_s}) "
                             f"< timeout ({self.heartbeat_timeout_s})")
        if not self.bind_address.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"bind_address: expected a ZeroMQ endpoint like tcp://127.0.0.1:0, "
                             f"got {self.bind_address!r}")
