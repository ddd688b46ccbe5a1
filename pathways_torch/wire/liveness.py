"""How processes watch each other: the heartbeat and the timeouts derived from it, one frozen dataclass.

The client's `ContextConfig`, the controller's `ControllerConfig` and the executor's `ExecutorConfig`
all extend `Liveness`, so the three agree on the field names (``heartbeat_interval_s=`` passed to
``pw.Context`` reaches the controller and the executors unchanged) and on what is valid.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Liveness", "MIN_PEER_TIMEOUT_S"]

# A peer still compiling may keep the others waiting this long: no timeout derived from the loss bound is shorter.
MIN_PEER_TIMEOUT_S = 20.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Liveness:
    """Heartbeats: one every ``heartbeat_interval_s``; a peer silent for ``heartbeat_timeout_s`` is suspect,
    and lost within twice that (`loss_bound_s`; docs/faults.md)."""

    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 10.0

    def __post_init__(self):
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError(f"heartbeats: expected 0 < interval ({self.heartbeat_interval_s}) "
                             f"< timeout ({self.heartbeat_timeout_s})")

    @property
    def loss_bound_s(self) -> float:
        """How long a silent peer may take to be declared lost: twice the timeout."""
        return 2 * self.heartbeat_timeout_s

    def or_loss_bound(self, timeout_s: float | None) -> float:
        """``timeout_s``, or when None the loss bound, at least `MIN_PEER_TIMEOUT_S`."""
        return timeout_s if timeout_s is not None else max(self.loss_bound_s, MIN_PEER_TIMEOUT_S)

    def liveness_fields(self) -> dict:
        """These settings as keyword arguments, for another config extending `Liveness`."""
        return {"heartbeat_interval_s": self.heartbeat_interval_s, "heartbeat_timeout_s": self.heartbeat_timeout_s}
