"""Controller configuration, validated up front."""

from __future__ import annotations

import dataclasses

from pathways_torch.wire.liveness import Liveness

__all__ = ["ControllerConfig", "ServiceConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ControllerConfig(Liveness):
    """Where the controller listens and how it watches executors (the heartbeat: `Liveness`).

    ``bind_address`` is loopback unless told otherwise (executors run code the
    controller sends; see docs/security.md).
    """

    bind_address: str = "tcp://127.0.0.1:0"
    request_timeout_s: float = 30.0
    # gloo groups: an op that waits this long fails (None: the loss bound, 2 x heartbeat_timeout_s, at least
    # 20 s: a peer still compiling may keep the others waiting that long). A lost peer ends a blocked op
    # sooner: the controller tells the survivors (CollectiveRuntime.abandon) once it declares the loss.
    collective_timeout_s: float | None = None
    # A transfer between executors not acknowledged this long (plus 1 s per MB) is reported lost and fails the
    # call that needs it (None: the loss bound, at least 20 s).
    transfer_timeout_s: float | None = None
    # Tests and benchmarks only: delay every controller→executor message by this much,
    # to show that parallel dispatch hides control latency.
    inject_latency_s: float = 0.0
    # Bounded run-ahead: a call waits (on the client's thread) while this many calls are unfinished, so
    # the queues to executors and the tables here stay bounded however far ahead the client runs.
    max_inflight_calls: int = 256
    # Serving many clients: calls admitted on an island and unfinished, at most (the executors' queues hold the
    # rest of the order); the clients' proportional shares decide whose call is admitted next (admission.py).
    share_window_calls: int = 16
    # Serving many clients: each executor's bytes of arrays (call outputs and puts), at most (0: no limit, nothing
    # counted). A call or put that would pass it waits up to ``memory_wait_s`` for frees, then fails with
    # `OutOfMemoryError` (controller/memory.py).
    executor_memory_bytes: int = 0
    memory_wait_s: float = 30.0
    # A program run on every executor of an island, when there are at least ``launch_tree_min_executors``, goes down
    # a tree where each sends to ``launch_fanout`` children, and its Dones come back up it in batches
    # (controller/launch_tree.py): the controller sends and receives ``launch_fanout`` messages per run, not one per
    # executor. 0: never.
    launch_fanout: int = 32
    launch_tree_min_executors: int = 128
    # Heartbeats the controller asks for per second, at most, all executors together: with more executors than
    # heartbeat_interval_s allows for, each heartbeat answer asks for a longer interval (never above a quarter of
    # heartbeat_timeout_s, so a loss is still declared after the same silence). 0: always heartbeat_interval_s.
    max_heartbeats_per_s: float = 512.0

    def asked_heartbeat_interval_s(self, executors: int) -> float:
        """The interval ``executors`` executors are asked to ping at (see ``max_heartbeats_per_s``)."""
        if not self.max_heartbeats_per_s:
            return self.heartbeat_interval_s
        spread = min(executors / self.max_heartbeats_per_s, self.heartbeat_timeout_s / 4)
        return max(self.heartbeat_interval_s, spread)

    @property
    def group_timeout_s(self) -> float:
        """The timeout process groups are created with."""
        return self.or_loss_bound(self.collective_timeout_s)

    @property
    def resolved_transfer_timeout_s(self) -> float:
        return self.or_loss_bound(self.transfer_timeout_s)

    def __post_init__(self):
        if not isinstance(self.max_inflight_calls, int) or self.max_inflight_calls < 1:
            raise ValueError(f"max_inflight_calls: expected a positive int, got {self.max_inflight_calls!r}")
        if not isinstance(self.executor_memory_bytes, int) or self.executor_memory_bytes < 0:
            raise ValueError(f"executor_memory_bytes: expected bytes >= 0 (0: no limit), "
                             f"got {self.executor_memory_bytes!r}")
        if not self.memory_wait_s >= 0:
            raise ValueError(f"memory_wait_s: expected seconds >= 0, got {self.memory_wait_s!r}")
        if not self.max_heartbeats_per_s >= 0:
            raise ValueError(f"max_heartbeats_per_s: expected heartbeats per second >= 0 (0: no limit), got "
                             f"{self.max_heartbeats_per_s!r}")
        if not isinstance(self.launch_fanout, int) or self.launch_fanout < 0 or self.launch_fanout == 1:
            raise ValueError(f"launch_fanout: expected children per executor in a launch tree, 2 or more (0: no "
                             f"trees), got {self.launch_fanout!r}")
        if not isinstance(self.launch_tree_min_executors, int) or self.launch_tree_min_executors < 2:
            raise ValueError(f"launch_tree_min_executors: expected an int >= 2, got "
                             f"{self.launch_tree_min_executors!r}")
        super().__post_init__()
        if not self.bind_address.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"bind_address: expected a ZeroMQ endpoint like tcp://127.0.0.1:0, "
                             f"got {self.bind_address!r}")



MiB = 1 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """What a controller serving many clients (`pathways-controller`) bounds per client: every tenant is a stranger
    to the others (docs/service.md, "Threats"). The embedded single-script context uses none of it."""

    # Where executors write and read remote clients' checkpoints: DIR/<client name>/ (None: pathways-checkpoints/
    # in the controller's working directory).
    checkpoint_root: str | None = None
    # One message on the client socket, at most: larger ones are refused and counted, the client told why.
    max_client_message_bytes: int = 8 * MiB
    # Requests of one client queued on the controller, unread by its worker, at most (count and bytes): past them
    # the client's socket is read no more until its worker catches up (back-pressure).
    max_queued_requests: int = 1024
    max_queued_bytes: int = 64 * MiB
    # A program's nodes, and a function's graph constants plus creation-op outputs, at most.
    max_program_nodes: int = 4096
    max_graph_bytes: int = 1 << 30
    # A call waits for its turn on an island (admission) this long at most, then fails naming the island and queue.
    admission_timeout_s: float = 300.0
    # How old a status answer may be: status calls are answered from a cache refreshed at most this often.
    status_cache_s: float = 1.0

    def __post_init__(self):
        for name in ("max_client_message_bytes", "max_queued_requests", "max_queued_bytes", "max_program_nodes",
                     "max_graph_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        for name in ("admission_timeout_s", "status_cache_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name}: expected seconds > 0 and finite, got {value!r}")
