"""`InProcessClient`: the `ControllerClient` protocol over the controller embedded in this process.

The one frontend module that imports the controller (DESIGN §5). It hands the client `ArrayState`s of its
own, kept up to date by a listener on each of the controller's array records, and snapshots
(`ExecutorView`) instead of the controller's mutable tables. The controller's message types the client
builds (`CallSpec`, `ProgramSpec`, `MeshAllocation`) are re-exported from here.
"""

from __future__ import annotations

import time
from typing import Sequence

from controller import CallSpec, ControllerConfig, ControllerServer, MeshAllocation
from controller.program import ProgramSpec

from .controller_api import ArraySettled, ArrayState, ClientEvents, ControllerCounters, ExecutorView

__all__ = ["InProcessClient", "CallSpec", "ProgramSpec", "MeshAllocation", "ControllerConfig"]


class InProcessClient:
    """Starts a `ControllerServer` (its sockets and I/O thread) in this process and speaks to its `Controller`.

    ``controller`` is the embedded controller itself: tests and benchmarks read its counters; nothing in
    the client does.
    """

    def __init__(self, config: ControllerConfig, credentials, zmq_context):
        self._server = ControllerServer(config, credentials, zmq_context)
        self._server.start()
        self.controller = self._server.controller
        self.address = self._server.address
        self._cluster = None            # what watch_exits asks about exited processes
        self._programs: dict[int, object] = {}   # program id → its lowered form (for describe_program)

    @property
    def server(self) -> ControllerServer:
        """The controller's sockets (tests and benchmarks look at them)."""
        return self._server

    # ------------------------------------------------------------ events

    def subscribe(self, events: ClientEvents) -> None:
        self.controller.loss_listeners.append(events.executor_lost)
        self.controller.incarnation_listeners.append(lambda info: events.new_incarnation(self._view(info)))
        self._server.on_key_revoked = events.key_revoked

    def _follow(self, records) -> list[ArrayState]:
        """The client's states of ``records``, kept in step with them from now on.

        Attached under the controller's lock, where every settle and loss happens: a record that changed
        before its listener was there is caught up here, and no change can land between the two."""
        with self.controller._lock:
            return [_follow_one(record) for record in records]

    # ------------------------------------------------------------ functions, programs, calls

    def register_function(self, name: str, graph, constants: list, *, sim_seconds: float = 0.0) -> int:
        return self.controller.register_function(name, graph, constants, sim_seconds=sim_seconds)

    def register_program(self, spec: ProgramSpec) -> int:
        lowered = self.controller.register_program(spec)
        self._programs[lowered.program_id] = lowered
        return lowered.program_id

    def describe_program(self, program_id: int) -> str:
        return self._programs[program_id].describe()

    def call(self, spec: CallSpec) -> list[ArrayState]:
        return self._follow(self.controller.call(spec))

    def run_program(self, program_id: int, input_ids: Sequence[int]) -> list[ArrayState]:
        return self._follow(self.controller.run_program(program_id, input_ids))

    # ------------------------------------------------------------ arrays

    def new_array(self, executor_ids: tuple[str, ...], *, landing: int) -> ArrayState:
        return self._follow([self.controller.new_array(executor_ids, landing=landing)])[0]

    def landed(self, array_id: int, error: BaseException | None = None) -> None:
        self.controller.landed(array_id, error)

    def release(self, array_id: int) -> None:
        self.controller.release(array_id)

    def release_many(self, array_ids: Sequence[int]) -> None:
        self.controller.release_many(array_ids)

    def flush_frees(self) -> None:
        self.controller.flush_frees()

    # ------------------------------------------------------------ executors

    def allocate_mesh(self, axes: dict[str, int], executor_ids: Sequence[str] | None = None) -> MeshAllocation:
        return self.controller.resources.allocate(dict(axes), None if executor_ids is None else list(executor_ids))

    def island_of(self, executor_id: str) -> str:
        return self.controller.resources.island_of(executor_id)

    def _view(self, info) -> ExecutorView:
        return ExecutorView(
            executor_id=info.executor_id, index=info.index, pid=info.pid, island=info.island, device=info.device,
            backend=info.backend, lost=info.lost, epoch=info.epoch, data_address=info.data_address,
            public_key=info.public_key, link_address=info.link_address,
            label=self.controller.executor_labels.get(info.executor_id, ""),
            seconds_since_heartbeat=max(0.0, self.controller.clock() - info.last_heard))

    def executors(self) -> tuple[ExecutorView, ...]:
        return tuple(self._view(info) for info in self.controller.resources.ordered())

    def executor(self, executor_id: str) -> ExecutorView | None:
        info = self.controller.resources.executors.get(executor_id)
        return None if info is None else self._view(info)

    def wait_for_executors(self, count: int, timeout_s: float) -> None:
        self.controller.wait_for_executors(count, timeout_s)

    def order_executors(self, order: dict[str, int]) -> None:
        for info in self.controller.resources.ordered():
            info.index = order.get(info.executor_id, len(order) + info.index)

    def label_executor(self, executor_id: str, label: str) -> None:
        self.controller.executor_labels[executor_id] = label

    def route_through(self, executor_id: str, link_address: str) -> None:
        self.controller.resources.executors[executor_id].link_address = link_address

    # ------------------------------------------------------------ keys, incarnations, losses

    def allowed_keys(self) -> dict[str, bytes]:
        return dict(self._server.credentials.allowed)

    def admit_key(self, role: str, public_key: bytes) -> None:
        self._server.admit(role, public_key)
        self.controller.admit_key(role, public_key)   # the survivors revoke the old key first

    def wait_for_incarnation(self, executor_id: str, epoch: int, timeout_s: float) -> ExecutorView:
        return self._view(self.controller.wait_for_incarnation(executor_id, epoch, timeout_s))

    def declare_lost(self, executor_id: str, why: str) -> None:
        self.controller.declare_lost(executor_id, why)

    def watch_exits(self, cluster, interval_s: float) -> None:
        """``cluster.newly_exited()`` every ``interval_s`` (a dead child is lost at once; the heartbeat timeout
        catches the hung and the remote), and whenever the controller suspects a loss."""
        self._cluster = cluster
        self._server.loop.every(interval_s, self._reap_exited)
        self.controller.liveness_probe = self._reap_exited

    def _reap_exited(self, patience_s: float = 0.0, then=None) -> None:
        """Declare lost every executor process that exited. With ``patience_s``: look again every 20 ms until one
        has or the time is up, then call ``then()``. Looked at later on the controller's I/O thread, never slept
        for: the caller holds the controller's lock there, and heartbeats would go unanswered meanwhile."""
        deadline = time.monotonic() + patience_s

        def look() -> None:
            exited = self._cluster.newly_exited()
            for executor_id, why in exited:
                self.controller.declare_lost(executor_id, why)
            if not exited and time.monotonic() < deadline:
                self._server.loop.call_later(0.02, look)
            elif then is not None:
                then()

        look()

    # ------------------------------------------------------------ observability

    def gather(self, kind: str) -> dict:
        return self.controller.gather(kind)

    def counters(self) -> ControllerCounters:
        controller, server = self.controller, self._server
        payload = server.payload_bytes
        return ControllerCounters(
            relayed_bytes=payload["sent"] + payload["received"] - controller.program_constant_bytes,
            program_constant_bytes=controller.program_constant_bytes,
            messages_sent=dict(controller.messages_sent),
            dropped_messages=server.dropped_messages + controller.dropped_messages,
            refused_connections=server.refused_connections,
            inflight_high_water=controller.inflight_high_water,
            send_backlog_high_water=server.loop.backlog_high_water,
            transfers_lost=controller.transfers_lost,
            calls_failed_by_lost_transfers=controller.calls_failed_by_lost_transfers,
            handled_messages={**{f"control:{k}": n for k, n in controller.handled_messages.items()},
                              **server.handled_messages},
            calls_in_flight=controller.calls_in_flight, arrays=len(controller.arrays))

    def runahead_waits(self) -> tuple[tuple[int, int, int, str], ...]:
        return tuple(self.controller.runahead_waits)

    def note_runahead_wait(self, start_ns: int, end_ns: int, in_flight: int, what: str) -> None:
        self.controller.runahead_waits.append((start_ns, end_ns, in_flight, what))

    def serve_status(self, port: int, run_id: str = ""):
        """Serve the controller's status (``pathways-status``) on 127.0.0.1:``port``; the gRPC server (stop() it)."""
        from controller.status import serve_status

        return serve_status(self.controller, port, run_id)

    # ------------------------------------------------------------ lifecycle

    def fail_pending(self, reason: str) -> int:
        return self.controller.fail_pending(reason)

    def shutdown_executors(self, reason: str) -> None:
        self.controller.shutdown_executors(reason)

    @property
    def io_running(self) -> bool:
        """Whether the controller's I/O thread still runs (its sockets still belong to the ZeroMQ context)."""
        return self._server.loop.running

    def close(self) -> None:
        self._server.stop()


def _follow_one(record) -> ArrayState:
    state = ArrayState(record.array_id)

    def changed(record) -> None:
        state.apply(ArraySettled(record.array_id, record.state, record.error, record.block_shape,
                                 tuple(record.lost_holders)))

    record.listener = changed
    if record.state != "pending" or record.lost_holders:   # it changed before the listener was there
        changed(record)
    return state
