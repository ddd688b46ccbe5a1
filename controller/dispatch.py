"""The controller's façade: its lock, the routing of executors' messages, and the construction of its parts.

`Controller` reacts to messages from executors and to calls from the client; it
emits messages through an outbox (a socket loop in a real process, a fake in unit
tests). Each idea is a part of its own, which the façade owns:

- `Membership` (membership.py): registration, incarnations, heartbeats and loss;
- `ProcessGroups` (groups.py): the groups collectives run in, and their abandonment after a fault;
- `CallDispatch` (calls.py): functions, calls, program runs and the run-ahead bound;
- `Completion` (completion.py): Done reports, failed calls and lost transfers;
- `Lifetimes` (arrays.py): puts landing, releases and the frees they send;
- `ExecutorRequests` (requests.py): stats and trace requests to every executor.

The parts share one lock (a call, a Done and a loss must see one state) and the tables several of them read and
write: the calls in flight (`_calls`), the registered functions (`_functions`) and programs (`_programs`, and
`_stale_programs` to lower again), the resource manager, the array table, the sequencers, the rendezvous store,
and `_send`. These are made here, once, and never replaced: each part keeps references to them, and reaches the
other parts through the façade. ``config`` may be replaced (a benchmark does): the parts read it from here.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable, Protocol, Sequence

from pathways_torch.errors import ExecutorLostError
from pathways_torch.wire import pb
from pathways_torch.wire.framing import body_name, log_dropped

from .admission import Admission
from .arrays import ArrayRecord, ArrayTable, Lifetimes, shard_refs
from .call_spec import CallSpec, InFlightCall, RegisteredFunction
from .calls import CallDispatch
from .completion import Completion
from .config import ControllerConfig
from .groups import ProcessGroups
from .launch_tree import UNNUMBERED_KINDS, LaunchTrees
from .membership import Membership
from .memory import MemoryBudget
from .program import LoweredProgram, ProgramSpec
from .rendezvous import RendezvousStore
from .requests import ExecutorRequests
from .resources import ExecutorInfo, ResourceManager
from .sequencer import Sequencers
from .state import ControllerState

__all__ = ["Controller", "ControllerOutbox"]

log = logging.getLogger(__name__)

# on_message's kinds (and register)
_HANDLED = ("done", "done_batch", "transfer_lost", "stats", "trace_reply", "heartbeat")


class ControllerOutbox(Protocol):
    def to_executor(self, executor_id: str, envelope: pb.Envelope, payload: Sequence = ()) -> None: ...


class Controller:
    """One island's controller state; thread-safe (client threads and the I/O thread)."""

    def __init__(self, outbox: ControllerOutbox, config: ControllerConfig | None = None, clock=time.monotonic):
        self.config = config or ControllerConfig()
        self.outbox = outbox
        self.clock = clock
        self.resources = ResourceManager()
        self.arrays = ArrayTable()
        self.sequencers = Sequencers()                  # each island's sequence numbers and gang order
        # Which client's call each island takes next, by proportional share (enabled by a client service).
        self.admission = Admission(window=self.config.share_window_calls)
        # Each executor's bytes of arrays against --executor-memory-bytes (0: nothing counted; memory.py).
        self.memory = MemoryBudget(self.config.executor_memory_bytes)
        self.rendezvous = RendezvousStore(self.config.group_timeout_s)   # where groups meet (on the I/O thread)
        # The lock and the tables every part shares (state.py); the names below are this façade's own views of them.
        self.state = ControllerState(send=self.send, drop=self.drop)
        self._lock = self.state.lock
        self._calls: dict[int, InFlightCall] = self.state.calls
        self._functions: dict[int, RegisteredFunction] = self.state.functions
        self._programs: dict[int, LoweredProgram] = self.state.programs
        self._stale_programs: set[int] = self.state.stale_programs
        self.messages_sent: collections.Counter = collections.Counter()
        self.dropped_messages = 0
        self.handled_messages: collections.Counter = collections.Counter()   # by kind, on executors' control
        self.stale_messages = 0                  # refused: sent by an incarnation that was replaced
        # Called (under the lock) when an executor is lost, e.g. to fail the client's fetches from it.
        self.loss_listeners: list[Callable[[str, ExecutorLostError], None]] = []
        # Called (under the lock, on the I/O thread) when an executor registers again: a new incarnation took its
        # place (the client talks to it at its new address from then on).
        self.incarnation_listeners: list[Callable[[ExecutorInfo], None]] = []
        # Where each executor runs, for the errors that name it (under pathways-run: "node 1 at 10.0.0.2").
        self.executor_labels: dict[str, str] = {}
        # Asks the launcher whether an executor process has exited (and declares it lost if so).
        # Called before a failure is reported: a collective whose peer was killed fails with a
        # transport error ("connection reset") before any heartbeat could tell, and that failure
        # is the lost executor's, not the user's code's.
        # Arguments: how long to wait for an exit, and with a wait, what to call (on the I/O thread) once it ends.
        self.liveness_probe: Callable[..., None] | None = None
        self.members = Membership(self)
        self.groups = ProcessGroups(self)
        self.call_dispatch = CallDispatch(self)
        self.completion = Completion(self)
        self.lifetimes = Lifetimes(self)
        self.requests = ExecutorRequests(self)
        self.launch_trees = LaunchTrees(self)

    # ------------------------------------------------------------ messages from executors

    def on_message(self, executor_id: str, envelope: pb.Envelope, payload: list) -> None:
        """Route a message from an executor's control connection to the part that handles it."""
        kind = body_name(envelope)
        with self._lock:
            info = self.resources.executors.get(executor_id)
            if info is not None and envelope.epoch and envelope.epoch != info.epoch:
                self.stale_messages += 1
                self.drop(f"{kind} from incarnation {envelope.epoch} of {executor_id}, which was replaced by "
                           f"incarnation {info.epoch}")
                return
            if info is not None:
                info.last_heard = self.clock()
            if kind == "register" or (info is not None and not info.lost and kind in _HANDLED):
                self.handled_messages[kind] += 1   # reached its handler (what bench/fuzz.py reports)
            if kind == "register":
                self.members.on_register(executor_id, envelope.register)
            elif info is None or info.lost:
                self.drop(f"{kind} from unknown or lost executor {executor_id!r}")
            elif kind == "done":
                call = self._calls.get(envelope.done.call_id)
                try:
                    self.completion.on_done(executor_id, envelope.done)
                except Exception as exc:   # a bug of ours: the call must still end, with the reason
                    self.completion.fail_done_call(call, exc)
            elif kind == "done_batch":
                self.completion.on_done_batch(executor_id, envelope.done_batch)
            elif kind == "transfer_lost":
                self.completion.on_transfer_lost(executor_id, envelope.transfer_lost)
            elif kind in ("stats", "trace_reply"):
                self.requests.on_reply(executor_id, getattr(envelope, kind).request_id, envelope)
            elif kind != "heartbeat":
                self.drop(f"unexpected {kind!r} from {executor_id}")

    def drop(self, why: str) -> None:
        """Count and log a message dropped as malformed or unexpected."""
        self.dropped_messages += 1
        log_dropped(log, self.dropped_messages, "controller", why)

    def send(self, executor_id: str, envelope: pb.Envelope, payload: Sequence = ()) -> None:
        """Send on the calling thread's order; pending frees for the executor ride along.

        A free rides on a message sent after the release; any Run that reads the array
        was sent before it (a released array cannot be called with), so it is pinned there.
        """
        kind = body_name(envelope)
        if kind in UNNUMBERED_KINDS:
            # Handled on arrival, ahead of commands a launch tree holds back (controller/launch_tree.py): a free on
            # it could pass the Run that reads the array. And one Cancel goes to every survivor: each its own copy.
            copy = pb.Envelope()
            copy.CopyFrom(envelope)
            envelope, frees = copy, None
        else:
            frees = self.lifetimes.take_pending_frees(executor_id)
        if frees and not envelope.HasField("free"):
            envelope.frees.extend(shard_refs(frees))
        elif frees:
            envelope.free.shards.extend(shard_refs(frees))
        self.messages_sent[kind] += 1
        self.launch_trees.stamp(executor_id, envelope)   # set on the envelope just before it is encoded
        self.outbox.to_executor(executor_id, envelope, payload)

    # ------------------------------------------------------------ membership and liveness (`Membership`)

    def rival_claim(self, executor_id: str, msg: pb.Register) -> str | None:
        """Why a registration must be refused: a live executor holds its id (`Membership.rival_claim`)."""
        return self.members.rival_claim(executor_id, msg)

    def wait_for_executors(self, count: int, timeout_s: float) -> None:
        """Wait until ``count`` executors have registered."""
        self.members.wait_for_executors(count, timeout_s)

    def wait_for_incarnation(self, executor_id: str, epoch: int, timeout_s: float) -> ExecutorInfo:
        """Wait until incarnation ``epoch`` (or a later one) of ``executor_id`` has registered; return it."""
        return self.members.wait_for_incarnation(executor_id, epoch, timeout_s)

    def admit_key(self, role: str, public_key: bytes) -> None:
        """Tell every live executor to admit ``public_key`` as ``role`` (`Membership.admit_key`)."""
        self.members.admit_key(role, public_key)

    def heartbeat(self) -> None:
        """Declare lost every executor silent past the timeout (run every heartbeat interval)."""
        self.members.heartbeat()

    def heard_from(self, executor_id: str, epoch: int = 0, awaiting_welcome: bool = False,
                   told: int = 0) -> tuple[str, list[str], int]:
        """An executor's heartbeat arrived: its state, and the faults of its island after the first ``told``, and
        their count (`Membership.heard_from`)."""
        return self.members.heard_from(executor_id, epoch, awaiting_welcome, told)

    def island_faults(self, executor_id: str, told: int) -> tuple[list[str], int] | None:
        """The faults of a live executor's island after the first ``told``, and how many in all (None: not live)."""
        with self._lock:
            info = self.resources.executors.get(executor_id)
            if info is None or info.lost:
                return None
            return self.groups.faults_since(info.island, told)

    def asked_heartbeat_interval_s(self) -> float:
        """How often each executor is asked to ping, for as many as have registered (`ControllerConfig`)."""
        return self.config.asked_heartbeat_interval_s(len(self.resources.executors))

    def declare_lost(self, executor_id: str, why: str) -> None:
        """The launcher saw the executor's process die: fail what depends on it now, not at the timeout."""
        self.members.declare_lost(executor_id, why)

    def declare_lost_many(self, lost: list[tuple[str, str]]) -> None:
        """Several died at once (one process of many simulated executors): one Cancel per survivor for all."""
        self.members.declare_lost_many(lost)

    def shutdown_executors(self, reason: str) -> None:
        """Tell every live executor to stop; from now on no executor is declared lost."""
        self.members.shutdown_executors(reason)

    # ------------------------------------------------------------ calls and programs (`CallDispatch`)

    def register_function(self, name: str, graph: pb.Graph, constants: list, *, sim_seconds: float = 0.0) -> int:
        """Keep a captured function (loaded on an executor at its first call there); returns its id."""
        return self.call_dispatch.register_function(name, graph, constants, sim_seconds=sim_seconds)

    def call(self, spec: CallSpec, owner: str = "", output_ids: Sequence[int] | None = None) -> list[ArrayRecord]:
        """Dispatch one call to every executor of its mesh; return its output records at once
        (after waiting, if ``max_inflight_calls`` are unfinished, for one to finish). ``owner``: the client calling
        (`client_ops`; "" the embedded one), who owns its outputs; ``output_ids``: ids it reserved for them."""
        return self.call_dispatch.call(spec, owner, output_ids)

    def register_program(self, spec: ProgramSpec) -> LoweredProgram:
        """Lower ``spec`` and register it on every executor it uses (once)."""
        return self.call_dispatch.register_program(spec)

    def forget(self, function_ids, program_ids) -> None:
        """Functions and programs no client uses again leave here and the executors (`forgetting.py`)."""
        with self._lock:
            self.call_dispatch.forgetting.forget(function_ids, program_ids)

    def run_program(self, program_id: int, input_ids: Sequence[int], owner: str = "",
                    output_ids: Sequence[int] | None = None) -> list[ArrayRecord]:
        """One run: one ``RunProgram`` per executor; every node gets its own sequence number (of its island's)."""
        return self.call_dispatch.run_program(program_id, input_ids, owner, output_ids)

    def fail_pending(self, reason: str) -> int:
        """Fail every pending array with `ContextClosedError` (the client is closing); returns how many."""
        return self.call_dispatch.fail_pending(reason)

    @property
    def calls_in_flight(self) -> int:
        """How many calls (and program runs' reporting nodes) are unfinished."""
        return len(self._calls)

    @property
    def inflight_high_water(self) -> int:
        """The most calls ever unfinished at once."""
        return self.call_dispatch.run_ahead.high_water

    @property
    def runahead_waits(self) -> collections.deque:
        """Run-ahead waits, (start ns, end ns, calls in flight, name), on the executors' trace clock."""
        return self.call_dispatch.run_ahead.waits

    @property
    def program_constant_bytes(self) -> int:
        """Graph constants sent to executors: the only tensor bytes the controller ever sends."""
        return self.call_dispatch.program_constant_bytes

    @property
    def _last_call_id(self) -> int:   # bench/fuzz_inputs.py names calls past the last one
        return self.call_dispatch.last_call_id

    # ------------------------------------------------------------ completion and failure (`Completion`)

    @property
    def transfers_lost(self) -> int:
        """Transfers their senders reported not acknowledged in time (a cut link)."""
        return self.completion.transfers_lost

    @property
    def calls_failed_by_lost_transfers(self) -> int:
        """Of the lost transfers, the ones a run still waited for (and failed for)."""
        return self.completion.calls_failed_by_lost_transfers

    @property
    def refused_reports(self) -> int:
        """Transfer reports from an executor that is neither end of the copy (dropped)."""
        return self.completion.refused_reports

    # ------------------------------------------------------------ array lifetimes (`Lifetimes`)

    def new_array(self, executor_ids: tuple[str, ...], *, landing: int = 0, owner: str = "",
                  shard_bytes: int = 0) -> ArrayRecord:
        """An array whose shards the client puts itself (``landing`` shards still on their way; ``shard_bytes``
        each, for the memory budget: this may wait for room, or raise `OutOfMemoryError`)."""
        return self.lifetimes.new_array(executor_ids, landing=landing, owner=owner, shard_bytes=shard_bytes)

    def landed(self, array_id: int, error: BaseException | None = None) -> None:
        """One put shard arrived on its executor (the client saw the ack), or never will (``error``)."""
        self.lifetimes.landed(array_id, error)

    def release(self, array_id: int) -> None:
        """The client dropped its handle; free the shards once nothing else holds them."""
        self.lifetimes.release(array_id)

    def release_many(self, array_ids) -> None:
        """`release` several arrays, with one Free message per executor for all of them (`Lifetimes`)."""
        self.lifetimes.release_many(array_ids)

    def flush_frees(self) -> None:
        """Send every pending free now (the client is idle, or closing)."""
        self.lifetimes.flush_frees()

    # ------------------------------------------------------------ requests to every executor

    def gather(self, kind: str, timeout_s: float | None = None) -> dict[str, pb.Envelope]:
        """Send a stats or trace request to every live executor; wait for every reply."""
        return self.requests.gather(kind, timeout_s)
