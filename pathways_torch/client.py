"""`InProcessClient`: the `ControllerClient` protocol over the controller embedded in this process.

The one frontend module that imports the controller (DESIGN §5). Every operation (`pathways_torch.wire.seam`) is
handled by the client's `ClientOps`, as a remote client's is by the service; this module only follows the array
records it answers with (the client's `ArrayState` s, kept up to date by a listener on each record) and keeps the
operations that are local by nature — the embedded controller's own executors, keys and status server — in one
object off the protocol, `LocalController` (``client.local``).
"""

from __future__ import annotations

from controller import ControllerConfig, ControllerServer
from controller.client_ops import ClientOps, executor_view, settled
from controller.exit_watch import watch_exits
from pathways_torch.wire.seam import CallSpec, MeshAllocation, ProgramSpec, SeamOp

from .controller_api import PENDING, ArrayState, ClientEvents, ExecutorView

__all__ = ["InProcessClient", "LocalController", "CallSpec", "ProgramSpec", "MeshAllocation", "ControllerConfig"]


class InProcessClient:
    """Speaks to a `Controller` served in this process (`start` starts one: its sockets and I/O thread).

    ``controller`` is the embedded controller itself: tests and benchmarks read its counters; nothing in
    the client does.
    """

    def __init__(self, server: ControllerServer):
        """The protocol over a controller already served: `start` one, or `pathways-controller`'s own (for
        replacing its local executors with the same code as an embedded context)."""
        self.server, self.controller, self.address = server, server.controller, server.address
        self._ops = ClientOps(server.controller, server)   # the one client's requests, as a remote one's
        self.local = LocalController(server)

    @classmethod
    def start(cls, config: ControllerConfig, credentials, zmq_context) -> "InProcessClient":
        """Start a controller in this process (its sockets and I/O thread) and speak to it."""
        server = ControllerServer(config, credentials, zmq_context)
        server.start()
        return cls(server)

    # ------------------------------------------------------------ the protocol

    def request(self, op: SeamOp):
        """Run ``op`` (its `ClientOps` handler); arrays it makes come back as states that follow their records."""
        result = self._ops.handle(op)
        return self._follow(result) if op.MAKES_ARRAYS else result

    def subscribe(self, events: ClientEvents) -> None:
        controller = self.controller
        controller.loss_listeners.append(events.executor_lost)
        controller.incarnation_listeners.append(lambda info: events.new_incarnation(executor_view(controller, info)))
        self.server.on_key_revoked = events.key_revoked

    def _follow(self, records) -> list[ArrayState]:
        """The client's states of ``records``, kept in step with them from now on (a record that changed before
        its listener was there is caught up under the controller's lock, before any later change)."""
        states = {record.array_id: ArrayState(record.array_id) for record in records}

        def listener_of(record):
            state = states[record.array_id]
            return lambda changed: state.apply(settled(changed))

        def now(snapshot) -> None:
            state = states[snapshot.array_id]
            state.put_token = snapshot.put_token
            if snapshot.state != PENDING or snapshot.lost_holders:
                state.apply(snapshot)

        self._ops.follow(records, listener_of, now)
        return [states[record.array_id] for record in records]

    # ------------------------------------------------------------ lifecycle

    def fail_pending(self, reason: str) -> int:
        """Fail every pending array with `ContextClosedError`; how many."""
        return self.controller.call_dispatch.fail_pending(reason)

    def shutdown_executors(self, reason: str) -> None:
        self.controller.members.shutdown_executors(reason)

    @property
    def io_running(self) -> bool:
        """Whether the controller's I/O thread still runs (its sockets still belong to the ZeroMQ context)."""
        return self.server.loop.running

    def close(self) -> None:
        self.server.stop()


class LocalController:
    """What only a context that embeds its controller does: order, label and route its own executors, admit a
    replacement's key, await an incarnation, declare a dead child lost, watch its processes, serve the status. Off
    the protocol: a remote controller's operator does these (`pathways-controller`; docs/service.md)."""

    def __init__(self, server: ControllerServer):
        self.server, self.controller = server, server.controller

    def order_executors(self, order: dict[str, int]) -> None:
        """Give each executor its place in `Context.executor_ids` (ids not named keep theirs, after)."""
        for info in self.controller.resources.ordered():
            info.index = order.get(info.executor_id, len(order) + info.index)

    def label_executor(self, executor_id: str, label: str) -> None:
        """What errors about ``executor_id`` call it (its node)."""
        self.controller.executor_labels[executor_id] = label

    def route_through(self, executor_id: str, link_address: str) -> None:
        """Other islands send ``executor_id`` their transfers at ``link_address``."""
        self.controller.resources.executors[executor_id].link_address = link_address

    def allowed_keys(self) -> dict[str, bytes]:
        """Every role's admitted public key (a replacement's key folder holds the others')."""
        return dict(self.server.credentials.allowed)

    def admit_key(self, role: str, public_key: bytes) -> None:
        """Admit a replacement's new key; the survivors revoke the old one first."""
        self.server.admit(role, public_key)
        self.controller.members.admit_key(role, public_key)

    def wait_for_incarnation(self, executor_id: str, epoch: int, timeout_s: float) -> ExecutorView:
        """Wait until ``executor_id`` registers with ``epoch``; raise `ExecutorLostError` after ``timeout_s``."""
        info = self.controller.members.wait_for_incarnation(executor_id, epoch, timeout_s)
        return executor_view(self.controller, info)

    def declare_lost(self, executor_id: str, why: str) -> None:
        """Declare an executor lost (its process exited)."""
        self.controller.members.declare_lost(executor_id, why)

    def watch_exits(self, cluster, interval_s: float) -> None:
        """``cluster.newly_exited()`` every ``interval_s`` (a dead child is lost at once; the heartbeat timeout
        catches the hung and the remote), and whenever the controller suspects a loss."""
        watch_exits(self.controller, self.server.loop, cluster.newly_exited, interval_s)

    def serve_status(self, port: int, run_id: str = ""):
        """Serve the controller's status (``pathways-status``) on 127.0.0.1:``port``; the gRPC server (stop() it)."""
        from controller.status import serve_status

        return serve_status(self.controller, port, run_id)
