"""The controller's logic: registration, calls, completion, failure and lifetimes.

`Controller` reacts to messages from executors and to calls from the client; it
emits messages through an outbox (a socket loop in a real process, a fake in unit
tests). Every computation gets the island's next sequence number. A call is sent
to every executor of its mesh at once; inputs that live on other executors are
pushed there executor→executor (`SendShard`), never through the controller.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from typing import Callable, Protocol, Sequence

from pathways_torch.errors import (ContextClosedError, ExecutorLostError, PathwaysError, PlacementError, RemoteError,
                                   ReplicationError, TRANSFER_LOST)
from pathways_torch.wire import pb
from pathways_torch.wire.framing import PROGRAM_RUN_REFUSED, body_name, log_dropped

from .arrays import FAILED, PENDING, READY, ArrayRecord, ArrayTable
from .config import ControllerConfig
from .program import LoweredProgram, ProgramSpec, lower
from .rendezvous import RendezvousStore
from .resources import DEFAULT_ISLAND, ExecutorInfo, MeshAllocation, ResourceManager
from .sequencer import Sequencers
from .transfer_reports import report_refusal

__all__ = ["Controller", "CallSpec", "ControllerOutbox"]

log = logging.getLogger(__name__)


class ControllerOutbox(Protocol):
    def to_executor(self, executor_id: str, envelope: pb.Envelope, payload: Sequence = ()) -> None: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class CallSpec:
    """One call of a captured function on a mesh."""

    function_id: int
    name: str
    mesh: MeshAllocation
    inputs: tuple[int, ...]
    num_outputs: int
    replicated_outputs: tuple[bool, ...] = ()
    debug: bool = False
    call_site: str = ""
    collective_axes: tuple[str, ...] = ()
    report_shapes: bool = False       # output sizes depend on the data: executors report them
    # Where output i sits among the function's outputs (its Done digests): a program node's
    # call covers only the outputs that are program outputs. Empty: output i is output i.
    output_positions: tuple[int, ...] = ()


@dataclasses.dataclass
class _Call:
    spec: CallSpec
    call_id: int
    seq: int
    outputs: list[ArrayRecord]
    waiting: set[str]
    digests: dict[str, list[bytes]] = dataclasses.field(default_factory=dict)
    shapes: dict[str, list[tuple[int, ...]]] = dataclasses.field(default_factory=dict)  # reported output shapes
    failed: bool = False
    routes: list[tuple[str, str, pb.ShardRef]] = dataclasses.field(default_factory=list)  # (from, to, copy) pushes
    depends_on: frozenset[str] = frozenset()   # executors beyond its mesh it may need (a program's others)
    # A failure that looks like a lost peer ("connection closed by peer") while other members have yet to report:
    # held until they do, or until one is declared lost, which fails the call with ExecutorLostError instead.
    held_failure: pb.RemoteFailure | None = None
    run_base: int = 0        # a program run's node: the run's first call id (a Cancel names the run by it)
    run_nodes: int = 0       # ... and how many call ids the run holds (run_base .. run_base + run_nodes - 1)
    program_id: int = 0      # ... and its program, whose plan names who sends each copy to whom


@dataclasses.dataclass
class _Function:
    name: str
    graph: pb.Graph
    constants: list
    loaded_on: set[str] = dataclasses.field(default_factory=set)
    sim_seconds: float = 0.0


class Controller:
    """One island's controller state; thread-safe (client threads and the I/O thread)."""

    def __init__(self, outbox: ControllerOutbox, config: ControllerConfig | None = None, clock=time.monotonic):
        self.config = config or ControllerConfig()
        self.outbox = outbox
        self.clock = clock
        self.resources = ResourceManager()
        self.arrays = ArrayTable()
        self._lock = threading.RLock()
        self._registered = threading.Condition(self._lock)
        self._functions: dict[int, _Function] = {}
        self._calls: dict[int, _Call] = {}
        # Notified whenever a call leaves _calls: a client thread past the run-ahead bound waits on it.
        self._room = threading.Condition(self._lock)
        self._closing_reason = ""            # set by fail_pending: a waiting call must not dispatch after it
        self.inflight_high_water = 0         # the most calls ever unfinished at once
        # Run-ahead waits, (start ns, end ns, calls in flight) on the wall clock the executors' traces use.
        self.runahead_waits: collections.deque = collections.deque(maxlen=10_000)
        self._failures: dict[int, BaseException] = {}   # call id → the error it raised
        self._failure_holders: dict[int, int] = {}      # call id → its outputs still held
        self._next_function_id = itertools.count(1)
        self._last_call_id = 0
        self.sequencers = Sequencers()                  # each island's sequence numbers and gang order
        self._mesh_islands: dict[int, tuple[str, ...]] = {}   # mesh id → its islands (cached per mesh)
        self._programs: dict[int, LoweredProgram] = {}
        self._next_program_id = itertools.count(1)
        self._next_request_id = itertools.count(1)
        self._replies: dict[int, dict[str, pb.Envelope]] = {}
        self._reply_events: dict[int, threading.Event] = {}
        self._expected: dict[int, int] = {}
        self.messages_sent: collections.Counter = collections.Counter()
        self._shut_down = False
        self.dropped_messages = 0
        self.handled_messages: collections.Counter = collections.Counter()   # by kind, on executors' control
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
        self._groups: dict[tuple[str, ...], int] = {}       # members (in rank order) → group id (live ones)
        # island → its faults, each "what<first group id after it": a lost "id@epoch" or a lost "transfer:..."
        self._lost_peers: dict[str, list[str]] = collections.defaultdict(list)
        self._stale_programs: set[int] = set()   # programs to lower again (new groups, a replaced executor)
        self.stale_messages = 0                  # refused: sent by an incarnation that was replaced
        self.refused_reports = 0                 # transfer reports from an executor that is neither end of the copy
        self.transfers_lost = 0                  # reported by their senders: not acknowledged in time (a cut link)
        self.calls_failed_by_lost_transfers = 0  # of those, the ones a run still waited for (its receiver says: the
                                                 # rest had arrived, their acknowledgement lost, or their run had
                                                 # failed already)
        self._axis_group_cache: dict[tuple, dict[str, list[int]]] = {}
        self._pending_frees: dict[str, list] = collections.defaultdict(list)   # executor → shards to free
        self._batching_frees = False     # inside release_many (under the lock)
        self._last_group_id = 0   # groups get increasing ids: a loss names the last one made before it
        self.rendezvous = RendezvousStore(self.config.group_timeout_s)   # where groups meet (on the I/O thread)
        self.group_epoch = 0                  # part of every group's rendezvous prefix
        self.program_constant_bytes = 0   # graph constants are the only tensor bytes we ever send

    # ------------------------------------------------------------ executors

    def on_message(self, executor_id: str, envelope: pb.Envelope, payload: list) -> None:
        kind = body_name(envelope)
        with self._lock:
            info = self.resources.executors.get(executor_id)
            if info is not None and envelope.epoch and envelope.epoch != info.epoch:
                self.stale_messages += 1
                self._drop(f"{kind} from incarnation {envelope.epoch} of {executor_id}, which was replaced by "
                           f"incarnation {info.epoch}")
                return
            if info is not None:
                info.last_heard = self.clock()
            if kind == "register" or (info is not None and not info.lost and kind in _HANDLED):
                self.handled_messages[kind] += 1   # reached its handler (what bench/fuzz.py reports)
            if kind == "register":
                self._on_register(executor_id, envelope.register)
            elif info is None or info.lost:
                self._drop(f"{kind} from unknown or lost executor {executor_id!r}")
            elif kind == "done":
                call = self._calls.get(envelope.done.call_id)
                try:
                    self._on_done(executor_id, envelope.done)
                except Exception as exc:   # a bug of ours: the call must still end, with the reason
                    self._fail_done_call(call, exc)
            elif kind == "transfer_lost":
                self._on_transfer_lost(executor_id, envelope.transfer_lost)
            elif kind in ("stats", "trace_reply"):
                self._on_reply(executor_id, getattr(envelope, kind).request_id, envelope)
            elif kind != "heartbeat":
                self._drop(f"unexpected {kind!r} from {executor_id}")

    def _on_probed_done(self, executor_id: str, done: pb.Done) -> None:
        """The liveness probe a failed Done waited for has ended: handle the Done, unless its call ended."""
        with self._lock:
            call = self._calls.get(done.call_id)
            if call is not None and executor_id in call.waiting:
                try:
                    self._on_done(executor_id, done, probed=True)
                except Exception as exc:   # as in on_message: the call must still end, with the reason
                    self._fail_done_call(call, exc)

    def _fail_done_call(self, call: _Call | None, exc: BaseException) -> None:
        import traceback

        log.exception("controller: handling a Done failed; its call fails")
        if call is not None:
            self._end(call)
            self._fail_call(call, PathwaysError(
                f"the controller failed while completing {call.spec.name!r} (a bug of ours: "
                f"{type(exc).__name__}: {exc}); called from:\n{call.spec.call_site.rstrip()}\n"
                f"{''.join(traceback.format_exception(exc))}"))

    def _on_register(self, executor_id: str, msg: pb.Register) -> None:
        if msg.executor_id and msg.executor_id != executor_id:
            self._drop(f"executor {executor_id!r} tried to register as {msg.executor_id!r}")
            return
        previous = self.resources.executors.get(executor_id)
        if previous is not None and not previous.lost:
            # Registered again before its loss was declared (restarted within the heartbeat timeout): the old
            # incarnation's work fails now, as for any loss.
            self._lose(executor_id, f"it registered again from {msg.data_address} (a new incarnation)")
        info = self.resources.register(executor_id, data_address=msg.data_address, device=msg.device,
                                       backend=msg.backend, pid=msg.pid, last_heard=self.clock(),
                                       public_key=msg.public_key, command_address=msg.command_address,
                                       island=msg.island or DEFAULT_ISLAND)
        if previous is not None:
            self._take_place(executor_id, info)
            for listener in self.incarnation_listeners:
                listener(info)
        self._send(executor_id, pb.Envelope(welcome=pb.Welcome(
            index=info.index, heartbeat_interval_s=self.config.heartbeat_interval_s,
            heartbeat_timeout_s=self.config.heartbeat_timeout_s, epoch=info.epoch,
            transfer_timeout_s=self.config.resolved_transfer_timeout_s)))
        self._registered.notify_all()

    def _take_place(self, executor_id: str, info) -> None:
        """A new incarnation of a lost executor registered: it starts its gang order afresh (at 0, as the new
        process does), joins new groups (formed at first use: its loss forgot every group of its island, and
        none with it forms while it is lost), and programs that ran on the old one are lowered again for its
        address, key and groups at their next run."""
        self._sequencer_of(executor_id).last_collective[executor_id] = 0
        self._stale_programs.update(pid for pid, lowered in self._programs.items() if executor_id in lowered.plans)
        log.warning("controller: %s registered again as incarnation %d (pid %d, %s)", executor_id, info.epoch,
                    info.pid, info.data_address)

    def admit_key(self, role: str, public_key: bytes) -> None:
        """Tell every live executor to admit ``public_key`` as ``role`` from now on (a replacement's fresh key;
        the role's previous key is revoked). Sent before the replacement starts, so they admit it first."""
        with self._lock:
            for info in self.resources.ordered():
                if not info.lost and info.executor_id != role:
                    self._send(info.executor_id, pb.Envelope(admit_key=pb.AdmitKey(role=role, public_key=public_key)))

    def wait_for_incarnation(self, executor_id: str, epoch: int, timeout_s: float) -> ExecutorInfo:
        """Wait until incarnation ``epoch`` (or a later one) of ``executor_id`` has registered; return it."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                info = self.resources.executors.get(executor_id)
                if info is not None and info.epoch >= epoch and not info.lost:
                    return info
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ExecutorLostError(
                        f"no replacement for {executor_id} registered within {timeout_s:g} s (incarnation {epoch} "
                        f"expected); see its log, or raise replacement_timeout_s", executor_id=executor_id)
                self._registered.wait(left)

    def rival_claim(self, executor_id: str, msg: pb.Register) -> str | None:
        """Why a registration must be refused because a live executor already holds its id (two nodes launched
        with one --node-rank, or one key folder on two hosts); None if it may register."""
        with self._lock:
            info = self.resources.executors.get(executor_id)
            if info is None or info.lost or info.data_address == msg.data_address:
                return None
            if self.clock() - info.last_heard > self.config.heartbeat_timeout_s:
                return None     # the old one is gone, just not declared yet: a restart may take its place
            return (f"{executor_id} registered from {msg.data_address} while {executor_id} at {info.data_address} "
                    f"is alive: two nodes claim it (the same --node-rank on two nodes, or one node's key folder "
                    f"on two hosts); the second is refused: give each node its own --node-rank and key folder")

    def wait_for_executors(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while len(self.resources.executors) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ExecutorLostError(
                        f"expected {count} executors to register within {timeout_s:.0f} s, "
                        f"got {len(self.resources.executors)}; see the executors' logs")
                self._registered.wait(left)

    def heartbeat(self) -> None:
        """Declare lost every executor silent past the timeout (run every heartbeat interval).

        Executors ping on a connection of their own (see `ControllerServer`), from a
        thread of their own, so a long compile or computation never looks like death.
        """
        now = self.clock()
        with self._lock:
            if self._shut_down:
                return
            for info in self.resources.ordered():
                if not info.lost and now - info.last_heard > self.config.heartbeat_timeout_s:
                    self._lose(info.executor_id, f"silent for {now - info.last_heard:.1f} s "
                                                 f"(heartbeat timeout {self.config.heartbeat_timeout_s:g} s)")

    def heard_from(self, executor_id: str, epoch: int = 0) -> tuple[str, list[str]]:
        """An executor's heartbeat arrived: note it. Returns its state — ``"live"``, ``"lost"``, ``"stale"`` (an
        incarnation that was replaced) or ``"unknown"`` (not registered) — and the lost incarnations of its
        island, whose groups it must abandon."""
        with self._lock:
            info = self.resources.executors.get(executor_id)
            if info is None or not epoch:
                # Not welcomed yet (its Register may still be on its way, or was refused): it keeps no one alive.
                return "unknown", []
            if epoch and epoch != info.epoch:
                self.stale_messages += 1
                return "stale", []
            if info.lost:
                return "lost", []
            info.last_heard = self.clock()
            return "live", self._lost_peers.get(info.island, [])

    def declare_lost(self, executor_id: str, why: str) -> None:
        """The launcher saw the executor's process die: fail what depends on it now, not at the timeout."""
        with self._lock:
            info = self.resources.executors.get(executor_id)
            if info is not None and not info.lost and not self._shut_down:
                self._lose(executor_id, why)

    def _lose(self, executor_id: str, why: str) -> None:
        """Fail every future that depends on the executor; refuse new work that would."""
        info = self.resources.executors[executor_id]
        info.lost = True
        self._pending_frees.pop(executor_id, None)
        label = self.executor_labels.get(executor_id)
        error = ExecutorLostError(f"executor {executor_id}{f' ({label})' if label else ''} lost: {why}",
                                  executor_id=executor_id)
        log.warning("controller: %s", error)
        incarnation = f"{executor_id}@{info.epoch}"
        self.rendezvous.fail_member(executor_id, str(error))
        failing = [call for call in self._calls.values()
                   if executor_id in call.spec.mesh.executor_ids or executor_id in call.depends_on
                   or any(route[0] == executor_id for route in call.routes)]
        # The island, and every island a failing call runs on or reads from (a program run across islands: its
        # steps there wait for copies the lost executor will never send, on some executors of an island, not all).
        islands = sorted({info.island} | {self.resources.island_of(e) for call in failing
                                          for e in (*call.spec.mesh.executor_ids, *call.depends_on)})
        group_ids = [g for island in islands for g in self._abandon_island_groups(island, incarnation)]
        # Program runs by their first call id too: a survivor drops every segment of such a run, reporting or not.
        failed_calls = sorted({c.call_id for c in failing} | {c.run_base for c in failing if c.run_base})
        # Ready arrays first: a thread woken by a failing future must not see one of them still ready.
        on_it = [record for record in self.arrays.records() if executor_id in record.executor_ids]
        for record in sorted(on_it, key=lambda r: r.state == PENDING):
            record.lose(executor_id, error)
        for call in list(self._calls.values()):
            pushes_from_it = [route for route in call.routes if route[0] == executor_id]
            if executor_id in call.spec.mesh.executor_ids or executor_id in call.depends_on or pushes_from_it:
                self._fail_call(call, error)
                self._unblock(call, pushes_from_it, error)
                call.waiting.discard(executor_id)
                if not call.waiting:
                    self._end(call)
        for function in self._functions.values():
            function.loaded_on.discard(executor_id)  # a restarted executor loads afresh
        self._cancel_on_survivors(info, islands, incarnation, failed_calls, group_ids, error)
        for listener in self.loss_listeners:
            listener(executor_id, error)

    def _cancel_on_survivors(self, info, islands: list[str], incarnation: str, call_ids: list[int],
                             group_ids: list[int], error: ExecutorLostError) -> None:
        """Tell the ``islands`` (the lost executor's, and those running calls that failed with it) what failed: their
        executors drop those calls' queued work and skip their places in gang order (else the next collective there
        would wait for them forever), and the queued formations of the abandoned groups."""
        if not call_ids and not group_ids:
            return
        cancel = pb.Cancel(call_ids=call_ids, group_ids=group_ids, reason=str(error), lost_executor=incarnation)
        for other in self.resources.ordered():
            if other.island in islands and not other.lost and other.executor_id != info.executor_id:
                self._send(other.executor_id, pb.Envelope(cancel=cancel))

    def _abandon_island_groups(self, island: str, what: str) -> list[int]:
        """After a fault in ``island`` (``what``: a lost incarnation ``id@epoch``, or a lost transfer): in every
        heartbeat answer there, its executors are told to abandon the groups made up to now (not the ones formed
        later, with a replacement: "executor-1@1<7" spares group 7 and on); the controller forgets them, so the
        next collective forms new ones. Returns the forgotten group ids."""
        entries = self._lost_peers[island]
        entries.append(f"{what}<{self._last_group_id + 1}")
        del entries[:-_MAX_LOST_PEERS]
        # A registered program names its groups: one with an executor there is lowered again at its next run.
        self._stale_programs.update(pid for pid, lowered in self._programs.items()
                                    if any(self.resources.island_of(e) == island for e in lowered.plans))
        return self._forget_island_groups(island)

    def _forget_island_groups(self, island: str) -> list[int]:
        """Drop every group of ``island`` at a loss there: its survivors abandon them all (a group without the lost
        executor may be out of step: `CollectiveRuntime.abandon`); meshes form new ones at their next call."""
        gone = [g for members, g in self._groups.items() if self.resources.island_of(members[0]) == island]
        self.rendezvous.forget_groups(gone)
        self._groups = {m: g for m, g in self._groups.items() if self.resources.island_of(m[0]) != island}
        self._axis_group_cache = {k: v for k, v in self._axis_group_cache.items()
                                  if island not in {self.resources.island_of(e) for e in k[0].executor_ids}}
        return gone

    def _on_transfer_lost(self, executor_id: str, msg: pb.TransferLost) -> None:
        """A transfer was not acknowledged in time (its link failed): the sender says so (`_on_unacknowledged`),
        and the receiver, told, says whether a run there did lack it (`_on_copy_missing`)."""
        if msg.missing:
            self._on_copy_missing(executor_id, msg)
        else:
            self._on_unacknowledged(executor_id, msg)

    def _on_unacknowledged(self, sender: str, msg: pb.TransferLost) -> None:
        """The sender's report: tell the receiver its copy will not come, on the control path. Nothing fails yet:
        the copy may have arrived, its acknowledgement alone lost (then the receiver ignores this)."""
        destination = next((info for info in self.resources.ordered()
                            if msg.to_address in (info.data_address, info.link_address)), None)
        if destination is not None and not self._believed(sender, sender, destination.executor_id, msg.shard):
            return
        self.transfers_lost += 1
        if destination is None or destination.lost:
            return   # its loss failed what waited for it already
        failure = pb.RemoteFailure(
            type=TRANSFER_LOST, executor_id=sender, origin_call_id=msg.shard.tag,
            message=(f"the transfer of array {msg.shard.array_id} shard {msg.shard.shard} ({msg.nbytes} B) from "
                     f"{sender} to {destination.executor_id} at {msg.to_address} was not acknowledged within "
                     f"{msg.waited_s:.0f} s: the link between them failed (both executors are alive); the calls "
                     f"that need it fail, later ones are unaffected"))
        self._fail_copy(destination.executor_id, msg.shard, failure)

    def _on_copy_missing(self, receiver: str, msg: pb.TransferLost) -> None:
        """The receiver's answer: a run there waited for the lost copy and now fails at that input. Fail its call,
        and abandon the groups of both ends' islands: the receiver's peers go on into the run's collectives
        without it (they would wait until gloo's timeout, and the group would be out of step after)."""
        call_id = msg.shard.tag
        run = self._live_calls_of_run(call_id)
        if not run or any(c.failed for c in run):
            # Its run ended, or failed already (an earlier fault's failure reached it, or another transfer of the
            # same cut: that fault abandoned the groups). A late answer must not abandon the groups formed since,
            # for the steps run again.
            return
        sender = msg.failure.executor_id
        if not self._believed(receiver, sender, receiver, msg.shard):
            return
        self.calls_failed_by_lost_transfers += 1
        call = self._calls.get(call_id)
        if call is not None:        # a reporting node (the others fail with the run on the receiver)
            self._fail_call(call, _remote_error(call.spec, msg.failure))
        islands = {self.resources.island_of(e) for e in (sender, receiver) if e in self.resources.executors}
        what = f"transfer:{msg.shard.array_id}.{msg.shard.shard}:{sender}->{receiver}"
        for island in sorted(islands):
            self._abandon_island_groups(island, what)

    def _believed(self, reporter: str, sender: str, receiver: str, copy: pb.ShardRef) -> bool:
        """Whether a report on ``copy`` (``sender`` → ``receiver``) comes from one of its ends by the routes of the
        live calls that wait for it; else it is dropped and counted (`controller.transfer_reports`). A report on a
        copy no live call waits for is late: believed, as it can fail nothing."""
        run = self._live_calls_of_run(copy.tag)
        why = report_refusal(run, copy, self._programs, reporter=reporter, sender=sender, receiver=receiver) \
            if run else None
        if why:
            self.refused_reports += 1
            self._drop(why)
        return not why

    def _live_calls_of_run(self, call_id: int) -> list[_Call]:
        """The unfinished calls of the program run holding ``call_id`` (any node's, reporting or not); the call
        alone for a plain call."""
        call = self._calls.get(call_id)
        if call is not None and not call.run_base:
            return [call]
        return [c for c in self._calls.values() if c.run_base and c.run_base <= call_id < c.run_base + c.run_nodes]

    def _unblock(self, call: _Call, pushes, error: ExecutorLostError) -> None:
        """Fail the copies a lost executor will never push, so the runs waiting for them end instead of hanging."""
        for _, destination, copy in pushes:
            if self.resources.executors[destination].lost:
                continue
            self._fail_copy(destination, copy, pb.RemoteFailure(
                type="ExecutorLostError", message=str(error), executor_id=error.executor_id,
                origin_call_id=call.call_id))

    def _fail_copy(self, destination: str, copy: pb.ShardRef, failure: pb.RemoteFailure) -> None:
        """Tell ``destination`` the copy ``copy`` it may wait for will not come (on the control path): it fails."""
        self._send(destination, pb.Envelope(transfer=pb.Transfer(failed=True, shard=copy, failure=failure)))

    # ------------------------------------------------------------ functions and calls

    def register_function(self, name: str, graph: pb.Graph, constants: list, *, sim_seconds: float = 0.0) -> int:
        with self._lock:
            function_id = next(self._next_function_id)
            self._functions[function_id] = _Function(name, graph, list(constants), sim_seconds=sim_seconds)
            return function_id

    def new_array(self, executor_ids: tuple[str, ...], *, landing: int = 0) -> ArrayRecord:
        """An array whose shards the client puts itself (``landing`` shards still on their way)."""
        with self._lock:
            self._check_live(executor_ids)
            record = self.arrays.new(executor_ids, landing=landing)
            if landing == 0:
                record.settle(READY)
            return record

    def landed(self, array_id: int, error: BaseException | None = None) -> None:
        """One put shard arrived on its executor (the client saw the ack), or never will (``error``)."""
        with self._lock:
            record = self.arrays.get(array_id)
            if record is None:
                return
            if error is not None:
                record.settle(FAILED, error)
            record.landing -= 1
            if record.landing == 0:
                record.settle(READY)
            self._maybe_forget(record)

    def call(self, spec: CallSpec) -> list[ArrayRecord]:
        """Dispatch one call to every executor of its mesh; return its output records at once
        (after waiting, if ``max_inflight_calls`` are unfinished, for one to finish)."""
        mesh = spec.mesh
        islands = self._islands_of(mesh)
        with self.sequencers.taking(islands), self._lock:
            self._wait_for_room(1, spec.name)
            self._check_live(mesh.executor_ids)
            inputs = [self._input_record(array_id) for array_id in spec.inputs]
            axis_groups = self._axis_groups(mesh, spec.collective_axes)
            call_id = self._take_call_ids(1)
            seqs = {island: self.sequencers.of(island).take(1) for island in islands}
            outputs = [self.arrays.new(mesh.executor_ids, producer_call=call_id) for _ in range(spec.num_outputs)]
            for record, replicated in zip(outputs, spec.replicated_outputs):
                record.replicated = replicated
            call = _Call(spec, call_id, seqs[islands[0]], outputs, waiting=set(mesh.executor_ids))
            self._calls[call_id] = call
            runs = []
            for position, executor_id in enumerate(mesh.executor_ids):
                self._ensure_loaded(spec.function_id, executor_id)
                sequencer = self._sequencer_of(executor_id)
                seq = seqs[sequencer.island]
                run = pb.Run(seq=seq, call_id=call_id, function_id=spec.function_id,
                             digest_outputs=spec.debug and any(spec.replicated_outputs),
                             report_shapes=spec.report_shapes)
                if spec.collective_axes:
                    run.collective = True
                    run.prev_collective_seq = sequencer.chain(executor_id, seq)
                    for axis in spec.collective_axes:
                        run.axis_groups[axis] = axis_groups[axis][position]
                for record in inputs:
                    run.inputs.append(self._route_input(record, position, executor_id, call_id))
                for record in outputs:
                    run.outputs.add(array_id=record.array_id, shard=position)
                runs.append((executor_id, run))
            # Only now the runs: every push this call's inputs need was requested first. An
            # executor may start a run (a collective blocks there) as soon as it reads it,
            # before it reads what the controller sent after it (executor/compute_loop.py).
            for executor_id, run in runs:
                self._send(executor_id, pb.Envelope(run=run))
            return outputs

    def _wait_for_room(self, count: int, name: str) -> None:
        """Bounded run-ahead: wait (the lock released) until ``count`` more calls fit under the bound.

        A program with more calls than the bound runs once nothing else is in flight. Each
        wait is kept for the trace (`runahead_waits`): a client that waits here runs ahead as
        far as it may, and the executors are its pace.
        """
        def room(limit: int) -> bool:
            return self._closing_reason != "" or not self._calls or len(self._calls) + count <= limit

        if not room(self.config.max_inflight_calls):
            # Once at the bound, wait down to the low-water mark: one wake-up per quarter of the bound,
            # not one per finished call (which costs the client a thread switch per call).
            start, waiting, low = time.time_ns(), len(self._calls), self._low_water()
            self._room.wait_for(lambda: room(low))
            self.runahead_waits.append((start, time.time_ns(), waiting, name))
        if self._closing_reason:
            raise ContextClosedError(f"{self._closing_reason} while {name!r} waited to be dispatched")
        self.inflight_high_water = max(self.inflight_high_water, len(self._calls) + count)

    def _end(self, call: _Call) -> None:
        """The call is no longer in flight (finished, failed or its executors lost): make room for another."""
        if self._calls.pop(call.call_id, None) is not None and len(self._calls) <= self._low_water():
            self._room.notify_all()

    def _low_water(self) -> int:
        limit = self.config.max_inflight_calls
        return limit - max(1, limit // 4)

    def _axis_groups(self, mesh: MeshAllocation, axes) -> dict[str, list[int]]:
        """For each axis, the group id of every mesh position; forms groups not seen before.

        Cached per (mesh, axes): groups are never re-formed under the same members, and
        every call of a training step asks the same question.
        """
        key = (mesh, tuple(axes))
        found = self._axis_group_cache.get(key)
        if found is None:
            found = self._axis_group_cache[key] = {
                axis: [self._group_for(mesh.axis_members(axis, position)) for position in range(mesh.size)]
                for axis in axes}
        return found

    def _group_for(self, members: tuple[str, ...]) -> int:
        group_id = self._groups.get(members)
        if group_id is not None:
            return group_id
        islands = sorted({self.resources.island_of(e) for e in members})
        if len(islands) > 1:   # the client refuses such a call first (pathways_torch.islands): a bug if reached
            raise PlacementError(f"a process group may not span islands: members {list(members)} are in islands "
                                 f"{islands}; collectives run inside an island")
        self._last_group_id += 1
        group_id = self._groups[members] = self._last_group_id
        sequencer = self.sequencers.of(islands[0])   # held by the call or program that needs the group
        seq = sequencer.take(1)   # forming a group is a gang-scheduled action of its own
        # The members meet under this prefix of the rendezvous store, open to them alone; the epoch lets the
        # same members form a group again (a replacement executor, later).
        store_path = f"group-{group_id}/epoch-{self.group_epoch}"
        self.rendezvous.allow(store_path, members)
        incarnations = [f"{e}@{self.resources.executors[e].epoch}" for e in members]
        for rank, executor_id in enumerate(members):
            form = pb.FormGroup(seq=seq, prev_collective_seq=sequencer.chain(executor_id, seq), group_id=group_id,
                                rank=rank, size=len(members), store_path=store_path,
                                timeout_s=self.config.group_timeout_s, members=incarnations)
            self._send(executor_id, pb.Envelope(form_group=form))
        return group_id

    def _sequencer_of(self, executor_id: str):
        return self.sequencers.of(self.resources.island_of(executor_id))

    def _islands_of(self, mesh: MeshAllocation) -> tuple[str, ...]:
        """The islands of a mesh's executors, in name order (cached: a mesh's executors never change)."""
        islands = self._mesh_islands.get(mesh.mesh_id)
        if islands is None:
            islands = self._mesh_islands[mesh.mesh_id] = tuple(sorted(
                {self.resources.island_of(e) for e in mesh.executor_ids}))
        return islands

    def _take_call_ids(self, count: int) -> int:
        first = self._last_call_id + 1
        self._last_call_id += count
        return first

    # ------------------------------------------------------------ programs

    def register_program(self, spec: ProgramSpec) -> LoweredProgram:
        """Lower ``spec`` and register it on every executor it uses (once)."""
        islands = {island for node in spec.nodes for island in self._islands_of(node.mesh)}
        with self.sequencers.taking(islands), self._lock:
            return self._lower_and_register(spec, next(self._next_program_id))

    def _lower_and_register(self, spec: ProgramSpec, program_id: int) -> LoweredProgram:
        """Lower ``spec`` for the executors as they are now and send each its plan (under the island's sequencers
        and the lock: forming a group is sequenced)."""
        axis_groups = {index: self._axis_groups(node.mesh, node.collective_axes)
                       for index, node in enumerate(spec.nodes) if node.collective_axes}
        keys = {e: info.public_key for e, info in self.resources.executors.items()}
        lowered = lower(spec, program_id, self.resources.address_for, keys, axis_groups=axis_groups)
        for executor_id, plan in lowered.plans.items():
            self._check_live([executor_id])
            for function_id in {a.run.function_id for a in plan.actions if a.WhichOneof("kind") == "run"}:
                self._ensure_loaded(function_id, executor_id)
            self._send(executor_id, pb.Envelope(register_program=plan))
        self._programs[program_id] = lowered
        self._stale_programs.discard(program_id)
        return lowered

    def run_program(self, program_id: int, input_ids: Sequence[int]) -> list[ArrayRecord]:
        """One run: one ``RunProgram`` per executor; every node gets its own sequence number (of its island's)."""
        with self._lock:
            lowered = self._programs[program_id]
        islands = {self.resources.island_of(e) for e in lowered.plans}
        with self.sequencers.taking(islands), self._lock:
            spec = lowered.spec
            self._wait_for_room(len(lowered.reporting_nodes), spec.name)
            self._check_live(list(lowered.plans))
            if program_id in self._stale_programs:   # one of its executors was replaced: new address and groups
                lowered = self._lower_and_register(spec, program_id)
            for array_id in input_ids:
                self._input_record(array_id)
            num_nodes = len(spec.nodes)
            base_seqs = {island: self.sequencers.of(island).take(num_nodes) for island in sorted(islands)}
            base_seq, base_call = base_seqs[min(islands)], self._take_call_ids(num_nodes)
            meshes = spec.value_meshes()
            producer = {v: index for index, node in enumerate(spec.nodes) for v in node.outputs}
            outputs = [self.arrays.new(meshes[v].executor_ids, producer_call=base_call + producer[v])
                       for v in spec.output_values]
            by_value = dict(zip(spec.output_values, outputs))
            first_intermediate = self.arrays.reserve(1 + max(producer))
            for index in lowered.reporting_nodes:
                node = spec.nodes[index]
                positions = [i for i, v in enumerate(node.outputs) if v in by_value]
                records = [by_value[node.outputs[i]] for i in positions]
                # As for a call: a replicated output (a pipeline's loss) stays readable after losing a replica.
                for i, record in zip(positions, records):
                    record.replicated = bool(node.replicated_outputs) and node.replicated_outputs[i]
                call_spec = CallSpec(function_id=node.function_id, name=node.name, mesh=node.mesh, inputs=(),
                                     num_outputs=len(records), call_site=node.call_site,
                                     replicated_outputs=tuple(node.replicated_outputs[i] for i in positions)
                                     if node.replicated_outputs else (), debug=node.debug,
                                     output_positions=tuple(positions))
                self._calls[base_call + index] = _Call(call_spec, base_call + index, base_seq + index, records,
                                                       waiting=set(node.mesh.executor_ids),
                                                       depends_on=frozenset(lowered.plans), run_base=base_call,
                                                       run_nodes=num_nodes, program_id=program_id)
            for executor_id in lowered.plans:
                sequencer = self._sequencer_of(executor_id)
                island_base = base_seqs[sequencer.island]
                run = pb.RunProgram(program_id=program_id, base_seq=island_base, base_call_id=base_call,
                                    input_array_ids=list(input_ids), output_array_ids=[r.array_id for r in outputs],
                                    first_intermediate_id=first_intermediate,
                                    prev_collective_seq=sequencer.last_collective[executor_id])
                last = lowered.last_collective_node.get(executor_id, 0)
                if last:
                    sequencer.chain(executor_id, island_base + last - 1)
                self._send(executor_id, pb.Envelope(run_program=run))
            return outputs

    def _input_record(self, array_id: int) -> ArrayRecord:
        record = self.arrays.get(array_id)
        if record is None or record.released:
            raise ValueError(f"array {array_id} was freed; it cannot be used as an input")
        for executor_id in record.executor_ids:
            if self.resources.executors[executor_id].lost or executor_id in record.lost_holders:
                raise ExecutorLostError(f"array {array_id} has a shard on executor {executor_id}, which was lost"
                                        f"{f': {record.error}' if record.error else ''}; recompute it (or restore a "
                                        f"checkpoint) on live executors", executor_id=executor_id)
        return record

    def _route_input(self, record: ArrayRecord, position: int, executor_id: str, call_id: int) -> pb.ShardRef:
        """Where executor ``executor_id`` finds shard ``position`` of ``record`` for this call."""
        source = record.executor_ids[position]
        if source == executor_id:
            return pb.ShardRef(array_id=record.array_id, shard=position)
        # The shard lives elsewhere: its owner pushes a copy tagged with this call.
        copy = pb.ShardRef(array_id=record.array_id, shard=position, tag=call_id)
        routes = self._calls[call_id].routes
        if (source, executor_id, copy) in routes:
            return copy   # the same array passed twice: one copy serves both
        routes.append((source, executor_id, copy))
        destination = self.resources.executors[executor_id]
        request = pb.SendShard(to_address=self.resources.address_for(source, executor_id),
                               to_public_key=destination.public_key,
                               call_id=call_id)
        request.shard.CopyFrom(pb.ShardRef(array_id=record.array_id, shard=position))
        request.as_ref.CopyFrom(copy)
        self._send(source, pb.Envelope(send_shard=request))
        return copy

    def _ensure_loaded(self, function_id: int, executor_id: str) -> None:
        function = self._functions[function_id]
        if executor_id in function.loaded_on:
            return
        load = pb.LoadFunction(function_id=function_id, name=function.name, sim_seconds=function.sim_seconds)
        load.graph.CopyFrom(function.graph)
        self._send(executor_id, pb.Envelope(load_function=load), function.constants)
        self.program_constant_bytes += sum(memoryview(c).nbytes for c in function.constants)
        function.loaded_on.add(executor_id)

    def _on_done(self, executor_id: str, done: pb.Done, probed: bool = False) -> None:
        if not done.ok and done.failure.type == PROGRAM_RUN_REFUSED:
            # The executor does not hold a program we sent it: none of that run's calls (nor later gang work)
            # can complete there. What depends on it fails now, as for a lost executor.
            info = self.resources.executors.get(executor_id)
            if info is not None and not info.lost:
                self._lose(executor_id, done.failure.message)
            return
        call = self._calls.get(done.call_id)
        if call is None and self._closing_reason:
            return   # closing ended every pending call (ContextClosedError): late Dones are expected, not dropped
        if call is None or executor_id not in call.waiting:
            self._drop(f"Done for unknown call {done.call_id} from {executor_id}")
            return
        if not (done.ok or probed or call.failed) and self.liveness_probe is not None \
                and _looks_like_peer_loss(done.failure.message):
            # A peer's transport error can arrive while the killed process is still being torn down (its sockets
            # close before it can be reaped): the launcher gets a moment to see the exit, then this Done is handled.
            # Polled later, never slept here: this is the I/O thread, under the lock, and heartbeats would wait.
            self.liveness_probe(_PEER_LOSS_PATIENCE_S, lambda: self._on_probed_done(executor_id, done))
            return
        call.waiting.discard(executor_id)
        if not done.ok:
            peer_loss = _looks_like_peer_loss(done.failure.message)
            if self.liveness_probe is not None and not call.failed:   # failed already: a loss was declared
                self.liveness_probe(0.0)   # may fail the call first, with ExecutorLostError
            if peer_loss and call.waiting and not call.failed and self.liveness_probe is None:
                # Executors on other hosts: no process to reap. The peer that went silent is either lost
                # within the heartbeat bound (ExecutorLostError, naming it) or reports itself.
                call.held_failure = call.held_failure or done.failure
            else:
                self._fail_call(call, self._error_for(call, call.held_failure or done.failure))
        else:
            if done.digests:
                call.digests[executor_id] = list(done.digests)
            if done.output_shapes:
                call.shapes[executor_id] = [tuple(meta.shape) for meta in done.output_shapes]
        if not call.waiting:
            if call.held_failure is not None:
                self._fail_call(call, self._error_for(call, call.held_failure))
            self._end(call)   # the liveness probe may have ended it already
            if not call.failed:
                self._complete(call)

    def _complete(self, call: _Call) -> None:
        if call.spec.report_shapes and not self._record_shapes(call):
            return
        for index, record in enumerate(call.outputs):
            replicated = index < len(call.spec.replicated_outputs) and call.spec.replicated_outputs[index]
            if replicated and call.digests:
                position = call.spec.output_positions[index] if call.spec.output_positions else index
                digests = {executor: d[position] for executor, d in call.digests.items()}
                if len(set(digests.values())) > 1:
                    groups = collections.defaultdict(list)
                    for executor, digest in digests.items():
                        groups[digest].append(executor)
                    record.settle(FAILED, ReplicationError(
                        f"output {index} of {call.spec.name!r} is declared Replicate() but its shards differ "
                        f"({len(groups)} distinct values across {', '.join(call.spec.mesh.executor_ids)}); "
                        f"reduce it with pw.all_reduce first or declare it Shard(...)\ncalled from:\n"
                        f"{call.spec.call_site.rstrip()}"))
                    continue
            record.settle(READY)

    def _record_shapes(self, call: _Call) -> bool:
        """Give each output the block shape its executors reported; fail the call if they disagree."""
        executors = call.spec.mesh.executor_ids
        for index, record in enumerate(call.outputs):
            shapes = [call.shapes.get(e, [None] * (index + 1))[index] for e in executors]
            if len(set(shapes)) > 1 or shapes[0] is None:
                described = ", ".join(f"{e}: {list(s) if s is not None else 'none'}" for e, s in zip(executors, shapes))
                self._fail_call(call, PlacementError(
                    f"output {index} of {call.spec.name!r} has a size that depends on the data, and its shards came "
                    f"out with different shapes ({described}); a sharded array needs equal blocks. Fix: make the "
                    f"size agree across shards (e.g. pad to a fixed size, or decide it from an all_reduce), or "
                    f"run the function on a mesh of one executor\ncalled from:\n{call.spec.call_site.rstrip()}"))
                return False
            record.block_shape = shapes[0]
        return True

    def _fail_call(self, call: _Call, error: BaseException) -> None:
        if call.failed:
            return
        call.failed = True
        self._failures.setdefault(call.call_id, error)
        holders = sum(1 for r in call.outputs if not r.released)
        if holders:
            self._failure_holders[call.call_id] = holders
        for record in call.outputs:
            record.settle(FAILED, error)

    def _error_for(self, call: _Call, failure: pb.RemoteFailure) -> BaseException:
        """The error for a failed call: the origin call's own error when the failure came from upstream.

        A dependent's Done can arrive before the origin's (the failure travels
        executor→executor faster than the origin's Done reaches us), so the origin
        call is failed here, first, with an error built from the same report.
        """
        origin = failure.origin_call_id
        if origin and origin != call.call_id:
            if origin in self._failures:
                return self._failures[origin]
            origin_call = self._calls.get(origin)
            if origin_call is not None:
                error = _remote_error(origin_call.spec, failure)
                self._fail_call(origin_call, error)
                return error
        return _remote_error(call.spec, failure)

    # ------------------------------------------------------------ lifetimes

    def release(self, array_id: int) -> None:
        """The client dropped its handle; free the shards once nothing else holds them."""
        with self._lock:
            record = self.arrays.get(array_id)
            if record is None or record.released:
                return
            record.released = True
            self._maybe_forget(record)

    def _maybe_forget(self, record: ArrayRecord) -> None:
        if not record.released or record.landing > 0:
            return
        self.arrays.forget(record.array_id)
        for position, executor_id in enumerate(record.executor_ids):
            pending = self._pending_frees[executor_id]
            pending.append(pb.ShardRef(array_id=record.array_id, shard=position))
            if len(pending) >= _MAX_PENDING_FREES and not self._batching_frees:
                self._flush_frees()
        if record.producer_call in self._failure_holders:
            self._failure_holders[record.producer_call] -= 1
            if self._failure_holders[record.producer_call] == 0:
                # No output of the failed call is left: forget its error.
                del self._failure_holders[record.producer_call]
                self._failures.pop(record.producer_call, None)

    def release_many(self, array_ids) -> None:
        """`release` several arrays, with one Free message per executor for all of them.

        Sent at once, on the calling thread: a Free must never overtake a Run this thread
        queued earlier that still reads the array (deferring the send could reorder them).
        """
        with self._lock:
            self._batching_frees = True
            try:
                for array_id in array_ids:
                    self.release(array_id)
            finally:
                self._batching_frees = False
                self._flush_frees()

    def flush_frees(self) -> None:
        """Send every pending free now (the client is idle, or closing)."""
        with self._lock:
            self._flush_frees()

    def _flush_frees(self) -> None:
        pending, self._pending_frees = self._pending_frees, collections.defaultdict(list)
        for executor_id, shards in pending.items():
            if not self.resources.executors[executor_id].lost:
                self._send(executor_id, pb.Envelope(free=pb.Free(shards=shards)))

    # ------------------------------------------------------------ requests to every executor

    def gather(self, kind: str, timeout_s: float | None = None) -> dict[str, pb.Envelope]:
        """Send a stats or trace request to every live executor; wait for every reply."""
        timeout_s = timeout_s or self.config.request_timeout_s
        with self._lock:
            request_id = next(self._next_request_id)
            targets = [e.executor_id for e in self.resources.ordered() if not e.lost]
            self._replies[request_id], self._reply_events[request_id] = {}, threading.Event()
            self._expected[request_id] = len(targets)
            for executor_id in targets:
                if kind == "stats":
                    envelope = pb.Envelope(stats_request=pb.StatsRequest(request_id=request_id))
                else:
                    envelope = pb.Envelope(trace_request=pb.TraceRequest(request_id=request_id))
                self._send(executor_id, envelope)
            if not targets:
                self._reply_events[request_id].set()
        finished = self._reply_events[request_id].wait(timeout_s)
        with self._lock:
            replies = self._replies.pop(request_id)
            del self._reply_events[request_id], self._expected[request_id]
        if not finished:
            missing = sorted(set(targets) - set(replies))
            raise ExecutorLostError(f"no {kind} reply from {missing} within {timeout_s:.0f} s",
                                    executor_id=missing[0] if missing else "")
        return replies

    def _on_reply(self, executor_id: str, request_id: int, envelope: pb.Envelope) -> None:
        replies = self._replies.get(request_id)
        if replies is None:
            return
        replies[executor_id] = envelope
        if len(replies) >= self._expected[request_id]:
            self._reply_events[request_id].set()

    def fail_pending(self, reason: str) -> int:
        """Fail every array still pending with `ContextClosedError` naming the call that would have made it
        (the client is closing: nothing will complete them). Returns how many were failed."""
        failed = 0
        with self._lock:
            for call in list(self._calls.values()):
                error = ContextClosedError(f"{reason} before {call.spec.name!r} finished; it was called from:\n"
                                           f"{call.spec.call_site.rstrip() or '(unknown)'}")
                for record in call.outputs:
                    if record.state == PENDING:
                        record.settle(FAILED, error)
                        failed += 1
            self._calls.clear()
            self._closing_reason = reason
            self._room.notify_all()
            for record in self.arrays.records():   # puts not yet acknowledged, a program's inputs
                if record.state == PENDING:
                    record.settle(FAILED, ContextClosedError(f"{reason} before array {record.array_id} was ready"))
                    failed += 1
        return failed

    def shutdown_executors(self, reason: str) -> None:
        with self._lock:
            self._shut_down = True
            for info in self.resources.ordered():
                if not info.lost:
                    self._send(info.executor_id, pb.Envelope(shutdown=pb.Shutdown(reason=reason)))

    # ------------------------------------------------------------ helpers

    def _check_live(self, executor_ids) -> None:
        for executor_id in executor_ids:
            info = self.resources.executors.get(executor_id)
            if info is not None and info.lost:
                raise ExecutorLostError(f"executor {executor_id} was lost; a mesh that includes it cannot run",
                                        executor_id=executor_id)

    def _drop(self, why: str) -> None:
        self.dropped_messages += 1
        log_dropped(log, self.dropped_messages, "controller", why)

    def _send(self, executor_id: str, envelope: pb.Envelope, payload: Sequence = ()) -> None:
        """Send on the calling thread's order; pending frees for the executor ride along.

        A free rides on a message sent after the release; any Run that reads the array
        was sent before it (a released array cannot be called with), so it is pinned there.
        """
        frees = self._pending_frees.pop(executor_id, None)
        if frees and not envelope.HasField("free"):
            envelope.frees.extend(frees)
        elif frees:
            envelope.free.shards.extend(frees)
        self.messages_sent[body_name(envelope)] += 1
        self.outbox.to_executor(executor_id, envelope, payload)


_HANDLED = ("done", "transfer_lost", "stats", "trace_reply", "heartbeat")   # on_message's kinds (and register)
# Lost incarnations each heartbeat answer names (per island): the most recent ones.
_MAX_LOST_PEERS = 64

# Frees wait for the next message to their executor, or for the client to idle; past this
# many shards per executor they go at once, in a Free of their own.
_MAX_PENDING_FREES = 256


# A failure that reads like a lost peer (a collective's connection reset or closed) waits up to this long for the
# launcher to see an executor exit, so that it is reported as that executor's loss, not as the model's error.
_PEER_LOSS_PATIENCE_S = 1.0
_PEER_LOSS_MARKERS = ("connection closed by peer", "connection reset", "broken pipe", "remote worker",
                      "socket closed")


def _looks_like_peer_loss(message: str) -> bool:
    lowered = message.lower()
    return any(marker in lowered for marker in _PEER_LOSS_MARKERS)


def _remote_error(spec: CallSpec, failure: pb.RemoteFailure) -> RemoteError:
    return RemoteError(failure.message, function=spec.name, executor_id=failure.executor_id,
                       remote_type=failure.type, remote_traceback=failure.traceback, call_site=spec.call_site,
                       op=failure.op, node_index=failure.node_index, function_id=spec.function_id)
