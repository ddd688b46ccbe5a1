"""`InProcessClient`: the `ControllerClient` protocol over the controller embedded in this process.

The one frontend module that imports the controller (DESIGN §5). It hands the client `ArrayState`s of its
own, kept up to date by a listener on each of the controller's array records, and snapshots
(`ExecutorView`) instead of the controller's mutable tables. The controller's message types the client
builds (`CallSpec`, `ProgramSpec`, `MeshAllocation`) are re-exported from here.
"""

from __future__ import annotations

from typing import Sequence

from controller import ControllerConfig, ControllerServer
from controller.client_ops import ClientOps, executor_view
from controller.exit_watch import watch_exits
from pathways_torch.wire.seam import CallSpec, MeshAllocation, ProgramSpec

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
        self._ops = ClientOps(self.controller, self._server)   # the one client's requests, as a remote one's

    @classmethod
    def over(cls, server: ControllerServer) -> "InProcessClient":
        """The protocol over a controller already served (`pathways-controller`'s own, for replacing its local
        executors with the same code as an embedded context)."""
        client = cls.__new__(cls)
        client._server, client.controller, client.address = server, server.controller, server.address
        client._ops = ClientOps(server.controller, server)
        return client

    @property
    def server(self) -> ControllerServer:
        """The controller's sockets (tests and benchmarks look at them)."""
        return self._server

    # ------------------------------------------------------------ events

    def subscribe(self, events: ClientEvents) -> None:
        self.controller.loss_listeners.append(events.executor_lost)
        self.controller.incarnation_listeners.append(
            lambda info: events.new_incarnation(executor_view(self.controller, info)))
        self._server.on_key_revoked = events.key_revoked

    def _follow(self, records) -> list[ArrayState]:
        """The client's states of ``records``, kept in step with them from now on.

        Attached under the controller's lock, where every settle and loss happens: a record that changed
        before its listener was there is caught up here, and no change can land between the two."""
        with self.controller.state.lock:
            return [_follow_one(record) for record in records]

    # ------------------------------------------------------------ functions, programs, calls, arrays (ClientOps)

    def register_function(self, name: str, graph, constants: list, *, sim_seconds: float = 0.0) -> int:
        return self._ops.register_function(name, graph, constants, sim_seconds=sim_seconds)

    def register_program(self, spec: ProgramSpec) -> int:
        return self._ops.register_program(spec)

    def describe_program(self, program_id: int) -> str:
        return self._ops.describe_program(program_id)

    def forget(self, function_ids: Sequence[int], program_ids: Sequence[int]) -> None:
        self._ops.forget(function_ids, program_ids)

    def call(self, spec: CallSpec) -> list[ArrayState]:
        return self._follow(self._ops.call(spec))

    def run_program(self, program_id: int, input_ids: Sequence[int], num_outputs: int | None = None
                    ) -> list[ArrayState]:
        return self._follow(self._ops.run_program(program_id, input_ids))

    def new_array(self, executor_ids: tuple[str, ...], *, landing: int, shard_bytes: int = 0) -> ArrayState:
        return self._follow([self._ops.new_array(executor_ids, landing=landing, shard_bytes=shard_bytes)])[0]

    def landed(self, array_id: int, error: BaseException | None = None) -> None:
        self._ops.landed(array_id, error)

    def release(self, array_id: int) -> None:
        self._ops.release(array_id)

    def release_many(self, array_ids: Sequence[int]) -> None:
        self._ops.release_many(array_ids)

    def flush_frees(self) -> None:
        self._ops.flush_frees()

    # ------------------------------------------------------------ executors

    def allocate_mesh(self, axes: dict[str, int], executor_ids: Sequence[str] | None = None) -> MeshAllocation:
        return self._ops.allocate_mesh(axes, executor_ids)

    def island_of(self, executor_id: str) -> str:
        return self._ops.island_of(executor_id)

    def executors(self) -> tuple[ExecutorView, ...]:
        return self._ops.executors()

    def checkpoint_root(self) -> None:
        return None   # the embedded client's checkpoint paths are its own, as the user names them

    def executor(self, executor_id: str) -> ExecutorView | None:
        return self._ops.executor(executor_id)

    def wait_for_executors(self, count: int, timeout_s: float) -> None:
        self._ops.wait_for_executors(count, timeout_s)

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
        return executor_view(self.controller, self.controller.wait_for_incarnation(executor_id, epoch, timeout_s))

    def declare_lost(self, executor_id: str, why: str) -> None:
        self.controller.declare_lost(executor_id, why)

    def watch_exits(self, cluster, interval_s: float) -> None:
        """``cluster.newly_exited()`` every ``interval_s`` (a dead child is lost at once; the heartbeat timeout
        catches the hung and the remote), and whenever the controller suspects a loss."""
        watch_exits(self.controller, self._server.loop, cluster.newly_exited, interval_s)

    # ------------------------------------------------------------ observability

    def gather(self, kind: str) -> dict:
        return self._ops.gather(kind)

    def counters(self) -> ControllerCounters:
        return self._ops.counters()

    def runahead_waits(self) -> tuple[tuple[int, int, int, str], ...]:
        return self._ops.runahead_waits()

    def note_runahead_wait(self, start_ns: int, end_ns: int, in_flight: int, what: str) -> None:
        self._ops.note_runahead_wait(start_ns, end_ns, in_flight, what)

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
    state.put_token = record.put_token

    def changed(record) -> None:
        state.apply(ArraySettled(record.array_id, record.state, record.error, record.block_shape,
                                 tuple(record.lost_holders)))

    record.listener = changed
    if record.state != "pending" or record.lost_holders:   # it changed before the listener was there
        changed(record)
    return state
