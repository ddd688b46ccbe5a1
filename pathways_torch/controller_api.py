"""The seam between the client and the controller: the `ControllerClient` protocol and the messages it carries.

Like Monarch's ``controller_api.py``: one section for what the client asks of the controller, one for what
it hears back. Every message is plain data (frozen dataclasses, ints, strings, tuples, protobuf envelopes and
the errors the controller reports), so an implementation could carry each over the wire; no lock, event or
mutable controller object crosses it. `pathways_torch.client.InProcessClient` implements it over the
controller embedded in this process.

The client keeps its own state of every array it was handed (`ArrayState`): the controller's settle events
update it, and `Array` waits on it alone.
"""

from __future__ import annotations

import threading
from typing import Protocol, Sequence

from .wire.seam import ArraySettled, ControllerCounters, ExecutorView
from .wire.wake import set_at_turn_end, this_threads_waker

__all__ = ["ControllerClient", "ClientEvents", "ExecutorView", "ArraySettled", "ArrayState", "ControllerCounters",
           "PENDING", "READY", "FAILED"]

PENDING, READY, FAILED = "pending", "ready", "failed"
_RANK = {PENDING: 0, READY: 1, FAILED: 2}   # an array's state only moves forward
_WAITERS = threading.Lock()


class ArrayState:
    """The client's own view of one array: its state, error and lost holders, set by `ArraySettled` events.

    Moves forward only (pending → ready → failed; the first error is kept), so an event that arrives late
    never undoes a newer one. A waiting thread blocks on its own `ThreadWaker`, which the settle wakes with the GIL let
    go: the thread wakes once, not three times (see `pathways_torch.wire.wake`).
    """

    __slots__ = ("array_id", "state", "error", "block_shape", "lost_holders", "put_token", "_wakers")

    def __init__(self, array_id: int):
        self.array_id = array_id
        self.state = PENDING
        self.error: BaseException | None = None
        self.block_shape: tuple[int, ...] | None = None
        self.lost_holders: tuple[str, ...] = ()
        self.put_token = b""   # sent with each put of its shards (the controller's, for a service client's array)
        self._wakers: tuple = ()   # of the threads waiting (`ThreadWaker`): most arrays are never waited for

    def apply(self, event: ArraySettled) -> None:
        """Take in an event about this array (from the controller's thread or the client's)."""
        if event.lost_holders and set(event.lost_holders) - set(self.lost_holders):
            self.lost_holders = tuple(sorted(set(self.lost_holders) | set(event.lost_holders)))
        if _RANK[event.state] <= _RANK[self.state]:
            return
        if event.block_shape is not None:
            self.block_shape = tuple(event.block_shape)
        if self.error is None:
            self.error = event.error
        self.state = event.state
        for waker in self._wakers:   # read after the state is set: see wait
            set_at_turn_end(waker)

    def done(self) -> bool:
        """Computed or failed."""
        return self.state != PENDING

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until computed or failed; False if ``timeout_s`` passed first."""
        if self.state != PENDING:
            return True
        waker = this_threads_waker()
        with _WAITERS:
            self._wakers = (*self._wakers, waker)
        try:   # the state is looked at again after the waker is listed: `apply` sets the state, then wakes the listed
            return waker.wait_until(self.done, timeout_s)
        finally:
            with _WAITERS:
                self._wakers = tuple(w for w in self._wakers if w is not waker)


class ClientEvents(Protocol):
    """What the client hears from the controller, besides each array's `ArraySettled` (sent to its state)."""

    def executor_lost(self, executor_id: str, error: BaseException) -> None:
        """The controller declared ``executor_id`` lost; what depended on it failed with ``error``."""

    def new_incarnation(self, executor: ExecutorView) -> None:
        """An executor registered again (replaced): new address, new key, next epoch."""

    def key_revoked(self, public_key: bytes) -> None:
        """A key the client's sockets admitted belongs to a replaced incarnation: refuse it from now on."""


class ControllerClient(Protocol):
    """Everything the client asks of the controller (`InProcessClient`: the embedded one)."""

    # ------------------------------------------------------------ calls the client makes

    address: str   # where executors reach the controller

    def subscribe(self, events: ClientEvents) -> None:
        """Send the controller's events (losses, incarnations, revoked keys) to ``events``."""

    def register_function(self, name: str, graph, constants: list, *, sim_seconds: float = 0.0) -> int:
        """Register a captured function (a ``pb.Graph`` and its constants); return its id."""

    def register_program(self, spec) -> int:
        """Lower and register a program (a ``ProgramSpec``); return its id."""

    def describe_program(self, program_id: int) -> str:
        """A registered program's lowered form, as text."""

    def forget(self, function_ids: Sequence[int], program_ids: Sequence[int]) -> None:
        """The client will not call these registered functions, nor run these programs, again: the controller and
        executors let them go once their calls in flight end."""

    def call(self, spec) -> list[ArrayState]:
        """Dispatch one call (a ``CallSpec``); its outputs' states at once (may wait at the run-ahead bound). An
        error the controller meets may raise here (embedded) or fail the outputs (remote: the call is not waited
        for); either way it reaches whoever reads them."""

    def run_program(self, program_id: int, input_ids: Sequence[int], num_outputs: int | None = None
                    ) -> list[ArrayState]:
        """Run a registered program on these arrays; its outputs' states at once (``num_outputs``: how many it
        makes, when the client knows: a remote client then need not wait for the controller)."""

    def new_array(self, executor_ids: tuple[str, ...], *, landing: int, shard_bytes: int = 0) -> ArrayState:
        """An array whose ``landing`` shards the client puts itself, straight to the executors (``shard_bytes``
        each, for the controller's memory budget: the call may wait for room, or raise `OutOfMemoryError`)."""

    def landed(self, array_id: int, error: BaseException | None = None) -> None:
        """One put shard arrived (or never will: ``error``)."""

    def release(self, array_id: int) -> None:
        """The client dropped the array: free its shards (the Free rides on the next message)."""

    def release_many(self, array_ids: Sequence[int]) -> None:
        """`release` several, with one Free per executor."""

    def flush_frees(self) -> None:
        """Send the frees still waiting for a message to ride on."""

    def allocate_mesh(self, axes: dict[str, int], executor_ids: Sequence[str] | None = None):
        """A ``MeshAllocation`` (a frozen dataclass) with these named axes."""

    def island_of(self, executor_id: str) -> str:
        """The island of a known executor."""

    def executors(self) -> tuple[ExecutorView, ...]:
        """Every executor, in `Context.executor_ids` order."""

    def checkpoint_root(self) -> str | None:
        """A service client's own folder of the checkpoint root, ``DIR/<name>`` (its checkpoints live there alone:
        `pathways_torch.wire.checkpoint_paths`); None for the embedded client (its paths are its own)."""

    def executor(self, executor_id: str) -> ExecutorView | None:
        """One executor, or None if unknown."""

    def wait_for_executors(self, count: int, timeout_s: float) -> None:
        """Wait until ``count`` executors registered; raise `PathwaysError` after ``timeout_s``."""

    def order_executors(self, order: dict[str, int]) -> None:
        """Give each executor its place in `executors` (ids not named keep theirs, after)."""

    def label_executor(self, executor_id: str, label: str) -> None:
        """What errors about ``executor_id`` call it (its node)."""

    def route_through(self, executor_id: str, link_address: str) -> None:
        """Other islands send ``executor_id`` their transfers at ``link_address``."""

    def allowed_keys(self) -> dict[str, bytes]:
        """Every role's admitted public key (a replacement's key folder holds the others')."""

    def admit_key(self, role: str, public_key: bytes) -> None:
        """Admit a replacement's new key; the survivors revoke the old one first."""

    def wait_for_incarnation(self, executor_id: str, epoch: int, timeout_s: float) -> ExecutorView:
        """Wait until ``executor_id`` registers with ``epoch``; raise `ExecutorLostError` after ``timeout_s``."""

    def declare_lost(self, executor_id: str, why: str) -> None:
        """Declare an executor lost (its process exited)."""

    def watch_exits(self, cluster, interval_s: float) -> None:
        """Ask the local ``cluster.newly_exited()`` (``[(executor id, why)]``) every ``interval_s`` and whenever a
        loss is suspected; declare each answer lost. Local by nature: a remote controller watches its own."""

    def gather(self, kind: str) -> dict:
        """Ask every live executor for ``"stats"`` or ``"trace"``; their reply envelopes, by executor id."""

    def counters(self) -> ControllerCounters:
        """The controller's own counts."""

    def runahead_waits(self) -> tuple[tuple[int, int, int, str], ...]:
        """Waits at the run-ahead bound: ``(start ns, end ns, in flight, what)``, the client's and its own."""

    def note_runahead_wait(self, start_ns: int, end_ns: int, in_flight: int, what: str) -> None:
        """Keep a wait of the client's at the run-ahead bound, for the trace."""

    def serve_status(self, port: int, run_id: str = ""):
        """Serve the controller's status (``pathways-status``) on 127.0.0.1:``port``; a server to stop()."""

    def fail_pending(self, reason: str) -> int:
        """Fail every pending array with `ContextClosedError`; how many."""

    def shutdown_executors(self, reason: str) -> None:
        """Tell every executor to exit."""

    @property
    def io_running(self) -> bool:
        """Whether the client's I/O thread to the controller still runs (its sockets hold the ZeroMQ context)."""

    def close(self) -> None:
        """Stop the controller (its sockets and thread)."""

    # ------------------------------------------------------------ what the client reads back

    # `ArraySettled` → each `ArrayState` handed out by call / run_program / new_array;
    # `ClientEvents.executor_lost`, `.new_incarnation`, `.key_revoked` → the subscriber.
