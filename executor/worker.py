"""The executor's logic, independent of sockets and threads.

`ExecutorCore` reacts to decoded messages and emits messages through an
`Outbox`; work goes to a `submit` callable (the compute thread in a real
process, a synchronous fake in unit tests) and comes back through `finish`.
The core is single-threaded: in a process, the I/O thread (messages) and the
compute thread (`finish`) take turns under one lock; `compute` runs outside it.

Work is queued as *segments* (`executor/segments.py`): a plain Run is a segment
of one step, a registered program's run is a few segments whose steps pass values
to each other on the compute thread. Segments are queued in the island's sequence
order (the order the controller sends them; one that arrives out of it is put in its
place) and started in that order among those that are *startable*: every input present,
every function compiled, and, within one program run, the run's previous segment here
started (the program's order is the schedule). Between independent calls, one whose
function is still compiling (in the background) or whose input is still coming lets later
ready ones pass, so a long compile does not stall the executor. Collective-bearing work
(a segment with collective steps, a group formation) keeps strict sequence order among
itself (gang scheduling) and never starts while work queued before it has not started:
a blocked gloo call holds the compute thread (see `_pump`).
"""

from __future__ import annotations

import collections
import logging
import time
import traceback
from typing import Callable, Protocol, Sequence

from pathways_torch.errors import TRANSFER_LOST
from pathways_torch.wire import pb
from pathways_torch.wire.framing import PROGRAM_RUN_REFUSED, body_name, log_dropped
from pathways_torch.wire.tensors import dtype_name, frame_to_tensor

from .collectives import CollectiveRuntime
from .compile_cache import CompileCache, graph_key
from .data_roles import DataGate
from .segments import Segment, SegmentPlan, instantiate, plan_segments, run_step, single
from .shard_writer import ShardWriter
from .store import ObjectStore
from .trace import TraceRecorder

__all__ = ["ExecutorCore", "Outbox", "ComputeJob"]

log = logging.getLogger(__name__)


class Outbox(Protocol):
    def to_controller(self, envelope: pb.Envelope, payload: Sequence = ()) -> None: ...
    def to_peer(self, address: str, envelope: pb.Envelope, payload: Sequence = (), public_key: bytes = b"") -> None: ...
    def to_client(self, identity: bytes, envelope: pb.Envelope, payload: Sequence = ()) -> None: ...


def _key(ref: pb.ShardRef) -> tuple:
    return (ref.array_id, ref.shard, ref.tag)


class ComputeJob:
    """One segment, one plain run started at once (``run``: its (seq, call id) and its ``step``), or
    one group formation, handed to the compute thread.

    ``values`` holds, per stored output, its tensor or its `pb.RemoteFailure`; ``dones`` the
    Done of every reporting step; ``computed`` how many steps ran.
    """

    __slots__ = ("segment", "functions", "entries", "out_entries", "values", "dones", "computed", "form",
                 "input_keys", "output_keys", "run", "step")

    def __init__(self, segment: Segment | None, functions: list | None = None, form: pb.FormGroup | None = None,
                 *, run: tuple[int, int] | None = None, step=None, input_keys=(), output_keys=()):
        self.segment, self.functions, self.form = segment, functions or [], form
        self.run, self.step = run, step
        if segment is not None:
            input_keys, output_keys = segment.input_keys, segment.output_keys
        self.input_keys, self.output_keys = input_keys, output_keys
        self.entries: list = []       # input entries, read on the compute thread (local chaining)
        self.out_entries: list = []
        self.values: list = []
        self.dones: list[pb.Done] = []
        self.computed = 0

    @property
    def seq(self) -> int:
        if self.form is not None:
            return self.form.seq
        return self.run[0] if self.run is not None else self.segment.seq


class _Function:
    """A loaded function: its traced input signature and, once compiled, the callable."""

    __slots__ = ("name", "signature", "compiled", "failure", "ready")

    def __init__(self, name: str, signature: list):
        self.name, self.signature = name, signature
        self.compiled, self.failure, self.ready = None, None, False


class ExecutorCore:
    """Object store, run queue, transfers and fetches of one executor."""

    def __init__(self, *, executor_id: str, backend, outbox: Outbox,
                 submit: Callable[[ComputeJob], None], trace: TraceRecorder | None = None,
                 compiler: CompileCache | None = None, collectives: CollectiveRuntime | None = None,
                 gang_order: bool = True, program_order: bool = True):
        self.executor_id = executor_id
        self.backend = backend
        self.outbox = outbox
        self._submit = submit
        self.trace = trace if trace is not None else TraceRecorder()  # an empty recorder is falsy
        self.store = ObjectStore()
        self.compiler = compiler if compiler is not None else CompileCache(backend, self.trace, background=False)
        self.functions: dict[int, _Function] = {}
        self.programs: dict[int, tuple[pb.RegisterProgram, list]] = {}   # the plan and its segments
        self._run_steps: dict = {}   # the Step of each kind of plain Run (see segments.single)
        self.collectives = collectives if collectives is not None else CollectiveRuntime()
        self._queue: collections.deque = collections.deque()   # Segments and pb.FormGroups, in arrival order
        self._submitted = 0             # jobs handed to the compute thread, not yet finished
        # The most work ever waiting here at once (queued + submitted): run-ahead keeps it bounded.
        self.queue_high_water = 0
        self._last_collective_seq = 0   # the last collective action started here (gang order)
        # Only tests turn these off, to show that without them collectives deadlock or order breaks.
        self._gang_order = gang_order
        self._program_order = program_order   # a run's segments in order; collectives behind earlier work
        self._pumping = False           # a pass over the queue is under way (see _pump)
        self._pump_again = False        # something became startable during that pass
        self.hop_bytes: collections.Counter = collections.Counter()
        self.num_computations = 0
        self.num_function_loads = 0
        self.dropped_messages = 0
        self.counters: collections.Counter = collections.Counter()  # reported with Stats (e.g. refused connections)
        self._last_run_call_id = 0      # Runs arrive in call-id order: a transfer tagged at or below it is late
        self._early: set[tuple] = set()  # transfers that arrived before their Run (another connection)
        # Early transfers refused for want of room (past _MAX_EARLY_TRANSFERS): their Run fails at once rather
        # than waiting forever for a copy that came and went. Bounded, oldest forgotten first.
        self._refused_early: collections.OrderedDict = collections.OrderedDict()
        self.stopped = False
        self.writer = ShardWriter()      # checkpoint shards, on a thread of its own
        self.heartbeat_settings: tuple[float, float] | None = None   # (interval, timeout) from Welcome
        self.epoch = 0                   # this incarnation of the executor id (from Welcome)
        # Collective actions cancelled before they started (their calls failed with a lost peer): previous
        # collective seq → the cancelled one's last seq, so gang order steps over them (`_gang_turn`).
        self._skipped: dict[int, int] = {}
        self.cancelled = 0               # queued segments and formations dropped by Cancel
        # Admits a replacement's fresh key on this process's sockets (set by ExecutorProcess; None in tests).
        self.admit_key: Callable[[str, bytes], None] | None = None
        # Transfers sent and not yet acknowledged: (to address, copy key) → (deadline, copy ref, bytes, sent at).
        self._unacked: dict[tuple, tuple] = {}
        self.transfer_timeout_s = _TRANSFER_TIMEOUT_S   # from Welcome
        self.transfers_lost = 0
        self.data_gate = DataGate()      # who may send what on the data socket

    # ------------------------------------------------------------ control plane

    def on_control(self, envelope: pb.Envelope, payload: list) -> None:
        for ref in envelope.frees:   # frees ride on the next message; they come before its body
            self.store.free(_key(ref))
        kind = body_name(envelope)
        if kind == "transfer" and envelope.transfer.failed:
            # The controller fails a copy whose sender was lost: no one else will ever push it.
            self.counters["handled:command:transfer"] += 1
            self._on_transfer(envelope.transfer, payload)
            return
        handler = getattr(self, f"_on_{kind}", None)
        if handler is None or kind in _DATA_KINDS:
            self._drop(f"control message of type {kind!r} not expected from the controller")
            return
        self.counters[f"handled:command:{kind}"] += 1   # reached its handler (Stats reports it; bench/fuzz.py)
        try:
            handler(getattr(envelope, kind), payload)
        except Exception as exc:
            if kind == "run":
                self._refuse_run(envelope.run, exc)
            elif kind == "run_program":
                log.exception("%s: handling a run of program %d failed", self.executor_id,
                              envelope.run_program.program_id)
                self._refuse_program_run(envelope.run_program, self._failure(exc, origin_call_id=0).traceback)
            else:
                raise    # the compute loop logs it; these kinds name no call

    def _refuse_program_run(self, msg: pb.RunProgram, why: str) -> None:
        """Tell the controller this program run cannot be taken here: it treats this executor as lost."""
        failure = pb.RemoteFailure(type=PROGRAM_RUN_REFUSED, executor_id=self.executor_id,
                                   origin_call_id=msg.base_call_id, message=why)
        self.outbox.to_controller(pb.Envelope(done=pb.Done(call_id=msg.base_call_id, seq=msg.base_seq, ok=False,
                                                           failure=failure)))

    def _refuse_run(self, run: pb.Run, exc: BaseException) -> None:
        """A Run whose handling raised (a bug of ours): its outputs fail here, so what reads them fails too,
        and its Done carries the exception and its traceback, so the call's future ends."""
        log.exception("%s: handling the Run of call %d failed; the call fails", self.executor_id, run.call_id)
        failure = self._failure(exc, origin_call_id=run.call_id)
        for ref in run.outputs:
            entry = self.store.get(_key(ref))
            if entry is None or not entry.ready:
                self.store.fill(_key(ref), failure=failure)
        if run.collective and run.prev_collective_seq == self._last_collective_seq:
            # Its turn in gang order has passed: later collective work must not wait for it forever.
            self._last_collective_seq = run.seq
        if not run.quiet:
            self.outbox.to_controller(pb.Envelope(done=pb.Done(call_id=run.call_id, seq=run.seq, ok=False,
                                                               failure=failure)))

    def _on_welcome(self, msg: pb.Welcome, payload) -> None:
        self.trace.record("receive", "welcome", detail=f"index {msg.index}")
        # The controller's heartbeat settings rule (an executor that joined from another host was started
        # without them): the liveness thread reads this pair on its next beat.
        if 0 < msg.heartbeat_interval_s < msg.heartbeat_timeout_s:
            self.heartbeat_settings = (msg.heartbeat_interval_s, msg.heartbeat_timeout_s)
        if msg.transfer_timeout_s > 0:
            self.transfer_timeout_s = msg.transfer_timeout_s
        self.epoch = msg.epoch

    def _on_admit_key(self, msg: pb.AdmitKey, payload) -> None:
        self.trace.record("receive", "admit key", detail=msg.role)
        if self.admit_key is None:
            self._drop(f"admit_key for {msg.role}: no gatekeeper here")
            return
        self.admit_key(msg.role, bytes(msg.public_key))

    def _on_cancel(self, msg: pb.Cancel, payload) -> None:
        """An executor of this island was lost: drop the queued work of the calls that failed with it (their
        outputs fail with the loss, each reporting step says so in a Done, so the controller ends the call), skip
        their places in gang order, abandon queued formations of its groups. ``call_ids`` names plain calls and
        program runs (by their first call id): every segment of a named run goes, reporting or not.

        Work already started is not touched: a collective blocked on the lost peer was ended by the heartbeat
        thread (`CollectiveRuntime.abandon`); the rest completes, and its Done is ignored.
        """
        self.data_gate.retire(msg.lost_executor)   # its transfers still on their way are refused from now on
        calls, groups = set(msg.call_ids), set(msg.group_ids)
        failure = pb.RemoteFailure(type="ExecutorLostError", message=msg.reason,
                                   executor_id=msg.lost_executor.split("@")[0])
        kept: collections.deque = collections.deque()
        dropped = []
        for item in self._queue:
            if isinstance(item, pb.FormGroup):
                if item.group_id in groups:
                    self._skip(item.prev_collective_seq, item.seq)
                    self.cancelled += 1
                    continue
            elif item.base_call_id in calls or any(item.ids(step)[1] in calls for step in item.steps):
                dropped.append(item)
                continue
            kept.append(item)
        # The queue first, then the drops: filling a dropped output wakes what reads it, and a pass over the queue
        # must not run inside this one (it would take items from the queue being rebuilt).
        self._queue = kept
        pumping, self._pumping = self._pumping, True
        try:
            for segment in dropped:
                self._drop_segment(segment, failure)
        finally:
            self._pumping = pumping
        self.trace.record("receive", "cancel", detail=f"{msg.lost_executor} lost: {len(dropped)} segments dropped")
        self._pump()

    def _drop_segment(self, segment: Segment, failure: pb.RemoteFailure) -> None:
        """A queued segment that will never run: its outputs fail, its inputs are let go, its gang turn passes,
        and the next segment of its run is not held behind it."""
        self.cancelled += 1
        segment.started, segment.after = True, None
        if segment.collective:
            self._skip(segment.prev_collective_seq, segment.last_collective_seq)
        for key in segment.output_keys:
            self.store.fill(key, failure=_with_origin(failure, key[2] or segment.base_call_id), owned=False)
        for key in segment.input_keys:
            self.store.unpin(key)
            if key[2]:   # a copy made for this call alone (it may still be on its way: then it is refused)
                self.store.abandon(key)
        for step in segment.steps:
            if step.report:
                seq, call_id = segment.ids(step)
                done = pb.Done(call_id=call_id, seq=seq, ok=False)
                done.failure.CopyFrom(_with_origin(failure, call_id))
                self.outbox.to_controller(pb.Envelope(done=done))

    def _skip(self, prev_collective_seq: int, last_collective_seq: int) -> None:
        self._skipped[prev_collective_seq] = last_collective_seq

    def _on_heartbeat(self, msg: pb.Heartbeat, payload) -> None:
        pass  # liveness is tracked by the process wrapper on any message

    def _on_shutdown(self, msg: pb.Shutdown, payload) -> None:
        log.info("%s: shutdown requested (%s)", self.executor_id, msg.reason)
        self.stopped = True

    def _on_load_function(self, msg: pb.LoadFunction, payload) -> None:
        self.trace.record("receive", f"load {msg.name}", function_id=msg.function_id)
        self.num_function_loads += 1
        function = self.functions[msg.function_id] = _Function(msg.name, [])
        try:
            function.signature = [(tuple(m.shape), m.dtype) for m in msg.graph.inputs]
            graph_module, examples = self.backend.prepare(msg, payload)
        except Exception as exc:
            log.warning("%s: function %s refused: %s", self.executor_id, msg.name, exc)
            self._function_ready(function, None, exc)
            return
        # The declared sim time is part of what the function is (two sim steps may share a graph).
        key = graph_key(msg.graph.SerializeToString(deterministic=True) + repr(msg.sim_seconds).encode(),
                        payload_bytes(payload))
        self.compiler.request(key, msg.name, graph_module, examples,
                              lambda compiled, error: self._function_ready(function, compiled, error))

    def _function_ready(self, function: _Function, compiled, error: BaseException | None) -> None:
        function.compiled, function.ready = compiled, True
        if error is not None:
            function.failure = self._failure(error, origin_call_id=0)
        self._pump()

    def _on_run(self, run: pb.Run, payload) -> None:
        if not self._queue and not self._pumping and self._start_now(run):
            return
        self._enqueue(single(run, self._run_steps))

    def _start_now(self, run: pb.Run) -> bool:
        """Start a plain Run that can start now, without a segment or a pass over the queue.

        The OpByOp path: an awaited call reaches an idle executor whose inputs are
        stored. Only when nothing is queued ahead of it (queue order holds), its
        function is ready, it is next in gang order and every input is here; else it
        is queued like any other (`_enqueue`). In process it costs 46 µs of Python per
        run against 52 µs through the queue (docs/programs.md).
        """
        function = self.functions.get(run.function_id)
        if function is None or not function.ready:
            return False
        if not self._gang_turn(run.collective, run.prev_collective_seq):
            return False
        input_keys = [(r.array_id, r.shard, r.tag) for r in run.inputs]
        entries = [self.store.get(key) for key in input_keys]
        if not all(e is not None and e.ready for e in entries):
            return False
        seq, call_id = run.seq, run.call_id
        self.trace.record("receive", function.name, seq=seq, call_id=call_id, function_id=run.function_id)
        output_keys = [(r.array_id, r.shard, r.tag) for r in run.outputs]
        self._accept(input_keys, output_keys, call_id)
        if run.collective:
            self._last_collective_seq = seq
        job = ComputeJob(None, [function], run=(seq, call_id), step=run_step(run, self._run_steps),
                         input_keys=input_keys, output_keys=output_keys)
        job.entries = entries
        self._begin(job)
        return True

    def _accept(self, input_keys: list, output_keys: list, last_call_id: int) -> None:
        """A run's inputs are pinned until it ends, its outputs owned until freed; copies for calls
        up to ``last_call_id`` that arrive from now on are late."""
        for key in input_keys:
            self.store.claim(key, pin=True)
            if self._refused_early and key in self._refused_early:
                self.store.fill(key, failure=self._refused_early.pop(key))
        for key in output_keys:
            self.store.claim(key, owned=True)
        self._last_run_call_id = max(self._last_run_call_id, last_call_id)
        if self._early:
            self._forget_early(last_call_id)

    def _enqueue(self, segment: Segment) -> None:
        for step in segment.steps:
            seq, call_id = segment.ids(step)
            self.trace.record("receive", self._name(step.function_id) or "run", seq=seq, call_id=call_id,
                              function_id=step.function_id)
        self._accept(segment.input_keys, segment.output_keys, segment.last_call_id)
        self._queue_in_order(segment)
        self._note_depth()
        # Wake the queue when a missing input arrives. Only missing ones: a segment that
        # starts (and ends) now frees its transient inputs, which must not be re-claimed.
        for key in segment.input_keys:
            entry = self.store.get(key)
            if not entry.ready:
                entry.waiters.append(lambda _entry: self._pump())
        self._pump()

    def _on_form_group(self, msg: pb.FormGroup, payload) -> None:
        self.trace.record("receive", "form group", seq=msg.seq, detail=f"group {msg.group_id} rank {msg.rank}")
        self._queue_in_order(msg)
        self._note_depth()
        self._pump()

    def _queue_in_order(self, item) -> None:
        """Queue a Segment or a FormGroup in sequence order: "queued before" is "earlier in the island's order"
        (`_pump_once`). The controller sends in that order, so this is an append but for reordered deliveries."""
        queue = self._queue
        if not queue or queue[-1].seq <= item.seq:
            queue.append(item)
            return
        index = len(queue) - 1
        while index > 0 and queue[index - 1].seq > item.seq:
            index -= 1
        queue.insert(index, item)

    def _note_depth(self) -> None:
        self.queue_high_water = max(self.queue_high_water, len(self._queue) + self._submitted)

    def _on_register_program(self, msg: pb.RegisterProgram, payload) -> None:
        self.trace.record("receive", f"register program {msg.name}", detail=f"{len(msg.actions)} actions")
        self.programs[msg.program_id] = (msg, plan_segments(msg))

    def _on_run_program(self, msg: pb.RunProgram, payload) -> None:
        """Enqueue one run of a registered program: all its segments and sends at once."""
        registered = self.programs.get(msg.program_id)
        if registered is None:
            # The controller believes this executor holds the program: its state and ours disagree, and no
            # call of the run can be answered here (its call ids are in the program). Say so; the
            # controller treats this executor as lost.
            self._drop(f"run of unknown program {msg.program_id}")
            self._refuse_program_run(msg, f"executor {self.executor_id} was asked to run program {msg.program_id}, "
                                          f"which it does not hold (never registered here)")
            return
        plan, items = registered
        array_id = _value_ids(plan, msg)
        previous = None   # the run's segments are chained: each starts after the one before it here
        for item in items:
            if isinstance(item, SegmentPlan):
                segment = instantiate(item, msg, array_id, after=previous)
                if self._program_order:
                    previous = segment
                self._enqueue(segment)
                continue
            request = pb.SendShard(to_address=item.to_address, to_public_key=item.to_public_key,
                                   call_id=msg.base_call_id + item.to_node)
            request.shard.CopyFrom(pb.ShardRef(array_id=array_id(item.value), shard=item.shard))
            request.as_ref.CopyFrom(pb.ShardRef(array_id=array_id(item.value), shard=item.shard,
                                                tag=msg.base_call_id + item.to_node))
            self._on_send_shard(request, ())
        # Every use is enqueued (and pins its buffer): stored intermediates can be let go;
        # each is deleted once produced and used.
        for ref in plan.local_intermediates:
            self.store.free((array_id(ref.value), ref.shard, 0))

    def _on_send_shard(self, msg: pb.SendShard, payload) -> None:
        key = _key(msg.shard)
        self.store.claim(key, pin=True)
        self.store.when_ready(key, lambda entry: self._push(msg, key, entry))

    def _on_free(self, msg: pb.Free, payload) -> None:
        for ref in msg.shards:
            self.store.free(_key(ref))

    def _on_stats_request(self, msg: pb.StatsRequest, payload) -> None:
        stats = pb.Stats(request_id=msg.request_id, executor_id=self.executor_id,
                         store_bytes=self.store.bytes, store_buffers=len(self.store),
                         num_computations=self.num_computations, num_function_loads=self.num_function_loads,
                         num_compiles=self.backend.num_compiles(), backend=self.backend.name,
                         queue_high_water=self.queue_high_water,
                         store_bytes_high_water=self.store.take_high_water(), transfers_lost=self.transfers_lost)
        for name, count in self.backend.counters().items():
            stats.backend_counters[name] = count
        for hop, count in self.hop_bytes.items():
            stats.hop_bytes[hop] = count
        # Stats has no fields for these counts yet: they ride in hop_bytes under reserved names.
        stats.hop_bytes["dropped_messages"] = self.dropped_messages
        for name, count in self.counters.items():
            stats.hop_bytes[name] = count
        self.outbox.to_controller(pb.Envelope(stats=stats))

    def _on_trace_request(self, msg: pb.TraceRequest, payload) -> None:
        reply = pb.TraceReply(request_id=msg.request_id, executor_id=self.executor_id)
        self.trace.fill(reply)
        self.outbox.to_controller(pb.Envelope(trace_reply=reply))

    # ------------------------------------------------------------ data plane

    def on_data(self, identity: bytes, envelope: pb.Envelope, payload: list, *, role: str | None,
                key: bytes | None = None) -> None:
        """A put, transfer or fetch sent with a key of ``role`` (its connection's User-Id); one whose handling raises
        still ends its request (never a silent drop). One from a sender its kind does not admit (`DataGate`) is
        dropped unanswered: it came from no one we would answer."""
        refused = self.data_gate.refusal(role, envelope, key)
        if refused:
            self.counters["refused_data_messages"] += 1
            self._drop(refused)
            return
        kind = body_name(envelope)
        handlers = {"put": lambda: self._on_put(identity, envelope.put, payload),
                    "transfer": lambda: self._on_transfer(envelope.transfer, payload, identity),
                    "fetch": lambda: self._on_fetch(identity, envelope.fetch),
                    "save_shards": lambda: self._on_save(identity, envelope.save_shards)}
        if kind not in handlers:
            self._drop(f"data message of type {kind!r} not expected")
            return
        self.counters[f"handled:data:{kind}"] += 1
        try:
            handlers[kind]()
        except Exception as exc:
            self._refuse_data(identity, kind, getattr(envelope, kind), exc)

    def _refuse_data(self, identity: bytes, kind: str, msg, exc: BaseException) -> None:
        """Handling a data message raised: answer the client's request with the failure, or fail the run
        waiting for a transfer (its copy could not be kept), so no future waits for it."""
        self._drop(f"{kind} refused: {exc}")
        failure = self._failure(exc, origin_call_id=msg.shard.tag if kind == "transfer" else 0)
        if kind == "put":
            ack = pb.PutAck(request_id=msg.request_id, failed=True, failure=failure)
            ack.shard.CopyFrom(msg.shard)
            self.outbox.to_client(identity, pb.Envelope(put_ack=ack))
        elif kind == "fetch":
            reply = pb.FetchReply(request_id=msg.request_id, failed=True, failure=failure)
            self.outbox.to_client(identity, pb.Envelope(fetch_reply=reply))
        elif kind == "save_shards":
            reply = pb.SaveReply(request_id=msg.request_id, failed=True, failure=failure)
            self.outbox.to_client(identity, pb.Envelope(save_reply=reply))
        elif self._expects_transfer(_key(msg.shard)):
            self.store.fill(_key(msg.shard), failure=failure)

    def _on_put(self, identity: bytes, msg: pb.Put, payload) -> None:
        ack = pb.PutAck(request_id=msg.request_id)
        ack.shard.CopyFrom(msg.shard)
        for item in (msg, *msg.more):
            try:
                tensor = self.backend.from_frame(item.tensor, payload)
            except Exception as exc:   # a frame that does not match its header: the put fails, and says why
                self._drop(f"put {msg.request_id} refused: {exc}")   # nothing is stored: still a dropped message
                ack.failed = True
                ack.failure.CopyFrom(self._failure(exc, origin_call_id=0))
                break
            self.hop_bytes["client->executor"] += tensor.nbytes
            self.store.fill(_key(item.shard), tensor)
        self.outbox.to_client(identity, pb.Envelope(put_ack=ack))

    def _on_transfer(self, msg: pb.Transfer, payload, identity: bytes | None = None) -> None:
        key = _key(msg.shard)
        if not self._expects_transfer(key):
            self._drop(f"transfer of array {key[0]} shard {key[1]} for call {key[2]}: no run waits for it")
            return
        if msg.failed:
            self.store.fill(key, failure=msg.failure)
            if identity is None and msg.failure.type == TRANSFER_LOST:
                # A copy the sender's link lost, which a run here did wait for: say so (the controller abandons the
                # island's groups only then; a copy that had arrived lost only its acknowledgement).
                confirm = pb.TransferLost(shard=msg.shard, missing=True, failure=msg.failure)
                self.outbox.to_controller(pb.Envelope(transfer_lost=confirm))
        else:
            tensor = self.backend.from_frame(msg.tensor, payload)
            self.hop_bytes["executor->executor received"] += tensor.nbytes
            self.trace.record("receive", "transfer", call_id=msg.shard.tag, detail=f"array {msg.shard.array_id}")
            self.store.fill(key, tensor)
        if identity is not None:   # from a peer (not the controller's failed copy), and kept: say so
            ack = pb.TransferAck()
            ack.shard.CopyFrom(msg.shard)
            self.outbox.to_client(identity, pb.Envelope(transfer_ack=ack))

    def _on_fetch(self, identity: bytes, msg: pb.Fetch) -> None:
        key = _key(msg.shard)
        if key not in self.store:
            reply = pb.FetchReply(request_id=msg.request_id, failed=True)
            reply.failure.CopyFrom(pb.RemoteFailure(
                type="KeyError", executor_id=self.executor_id,
                message=f"executor {self.executor_id} holds no shard {msg.shard.shard} of array {msg.shard.array_id}"))
            self.outbox.to_client(identity, pb.Envelope(fetch_reply=reply))
            return
        self.store.claim(key, pin=True)
        self.store.when_ready(key, lambda entry: self._reply_fetch(identity, msg, key, entry))

    def _reply_fetch(self, identity: bytes, msg: pb.Fetch, key: tuple, entry) -> None:
        reply = pb.FetchReply(request_id=msg.request_id)
        payload = []
        if entry.failure is not None:
            reply.failed = True
            reply.failure.CopyFrom(entry.failure)
        else:
            payload = [self.backend.to_frame(entry.value, reply.tensor, 1)]
            self.hop_bytes["executor->client"] += entry.nbytes
        self.outbox.to_client(identity, pb.Envelope(fetch_reply=reply), payload)
        self.store.unpin(key)

    def _on_save(self, identity: bytes, msg: pb.SaveShards) -> None:
        """Write shards of this store to one file, once each is ready (checkpoints written by the executors)."""
        from .shard_writer import check_save_path

        check_save_path(msg.path)
        if len(msg.names) != len(msg.shards) or len(set(msg.names)) != len(msg.names):
            raise ValueError(f"save: expected one distinct name per shard, got {len(msg.names)} names for "
                             f"{len(msg.shards)} shards")
        keys = [_key(ref) for ref in msg.shards]
        absent = [k for k in keys if k not in self.store]
        if absent:
            raise KeyError(f"executor {self.executor_id} holds no shard {absent[0][1]} of array {absent[0][0]}")
        tensors: dict = {}

        def ready(name: str, key: tuple, entry) -> None:
            if name in tensors:
                return
            if entry.failure is not None:
                tensors[name] = entry.failure
            else:   # a host copy: the store may free the shard at once, the write takes its time
                meta = pb.TensorMeta()
                frame = self.backend.to_frame(entry.value, meta, 1)
                tensors[name] = frame_to_tensor(meta, [frame]).clone()
            self.store.unpin(key)
            if len(tensors) == len(keys):
                self._write_shards(identity, msg, tensors)

        # The span covers the wait for the shards, their host copy and the write (the request is the save's start).
        self.trace.record("save_start", "save shards", call_id=msg.request_id, detail=msg.path)
        for name, key in zip(msg.names, keys):
            self.store.claim(key, pin=True)
        for name, key in zip(msg.names, keys):
            self.store.when_ready(key, lambda entry, name=name, key=key: ready(name, key, entry))

    def _write_shards(self, identity: bytes, msg: pb.SaveShards, tensors: dict) -> None:
        failed = next((t for t in tensors.values() if isinstance(t, pb.RemoteFailure)), None)
        if failed is not None:   # a shard that never came: its producer's failure is the save's
            reply = pb.SaveReply(request_id=msg.request_id, failed=True, failure=failed)
            self.trace.record("save_end", "save shards", call_id=msg.request_id, detail="failed")
            self.outbox.to_client(identity, pb.Envelope(save_reply=reply))
            return

        def done(nbytes: int, error) -> None:   # on the writer thread; the outbox is safe from any thread
            reply = pb.SaveReply(request_id=msg.request_id, bytes=nbytes)
            if error is not None:
                reply.failed = True
                reply.failure.CopyFrom(self._failure(error, origin_call_id=0))
            self.trace.record("save_end", "save shards", call_id=msg.request_id,
                              detail=f"{len(tensors)} shards, {nbytes} B -> {msg.path}")
            self.outbox.to_client(identity, pb.Envelope(save_reply=reply))

        self.hop_bytes["executor->disk"] += sum(t.numel() * t.element_size() for t in tensors.values())
        self.writer.write(msg.path, tensors, done)

    def _push(self, msg: pb.SendShard, key: tuple, entry) -> None:
        transfer = pb.Transfer()
        transfer.shard.CopyFrom(msg.as_ref)
        payload = []
        if entry.failure is not None:
            transfer.failed = True
            transfer.failure.CopyFrom(entry.failure)
        else:
            payload = [self.backend.to_frame(entry.value, transfer.tensor, 1)]
            self.hop_bytes["executor->executor"] += entry.nbytes
        self.trace.record("send", "transfer", call_id=msg.call_id, detail=f"array {msg.shard.array_id} -> {msg.to_address}")
        nbytes = 0 if entry.failure is not None else entry.nbytes
        now = time.monotonic()
        # A link may take a while for big shards: the deadline grows with the bytes (at 1 MB/s at worst).
        self._unacked[(msg.to_address, _key(msg.as_ref))] = (now + self.transfer_timeout_s + nbytes / _SLOWEST_LINK,
                                                             msg.as_ref, nbytes, now)
        # The epoch names this incarnation: once it is replaced, the receiver refuses what it still sends.
        self.outbox.to_peer(msg.to_address, pb.Envelope(transfer=transfer, epoch=self.epoch), payload,
                            msg.to_public_key)
        self.store.unpin(key)

    def on_peer_reply(self, address: str, envelope: pb.Envelope) -> None:
        """A message back on the connection to a peer: the acknowledgement of a transfer we sent it."""
        if body_name(envelope) != "transfer_ack":
            self._drop(f"{body_name(envelope)!r} from the peer at {address}")
            return
        self._unacked.pop((address, _key(envelope.transfer_ack.shard)), None)

    def check_transfers(self, now: float) -> None:
        """Report each transfer not acknowledged by its deadline (run every second): the controller fails the run
        that waits for it, which would otherwise wait forever (a frame lost on a cut link)."""
        expired = [k for k, (deadline, *_rest) in self._unacked.items() if deadline <= now]
        for address, key in expired:
            _, ref, nbytes, sent_at = self._unacked.pop((address, key))
            self.transfers_lost += 1
            lost = pb.TransferLost(to_address=address, waited_s=now - sent_at, nbytes=nbytes)
            lost.shard.CopyFrom(ref)
            log.warning("%s: the transfer of array %d shard %d to %s was not acknowledged within %.0f s",
                        self.executor_id, ref.array_id, ref.shard, address, now - sent_at)
            self.outbox.to_controller(pb.Envelope(transfer_lost=lost))

    def _expects_transfer(self, key: tuple) -> bool:
        """Whether a transfer for ``key`` fills a copy a run waits for (or may soon wait for).

        A copy is tagged with its consuming call. Its Run may arrive after it (the
        copy comes on another connection), but Runs arrive in call-id order: once
        a later Run has come, an unclaimed copy is late or bogus, and is refused
        rather than kept forever.
        """
        entry = self.store.get(key)
        if entry is not None:
            return not entry.ready
        if key[2] <= self._last_run_call_id:
            return False
        if len(self._early) >= _MAX_EARLY_TRANSFERS:
            self._refuse_early(key)
            return False
        self._early.add(key)
        return True

    def _refuse_early(self, key: tuple) -> None:
        """Remember a refused early copy, so that its Run fails (with this reason) instead of waiting for it."""
        self._refused_early[key] = pb.RemoteFailure(
            type="TransferRefused", executor_id=self.executor_id, origin_call_id=key[2],
            message=f"executor {self.executor_id} refused the copy of array {key[0]} shard {key[1]} for call "
                    f"{key[2]}: it arrived before its Run with {_MAX_EARLY_TRANSFERS} early copies already kept")
        while len(self._refused_early) > _MAX_REFUSED_EARLY:
            self._refused_early.popitem(last=False)

    def _forget_early(self, call_id: int) -> None:
        """Release early copies for calls up to ``call_id``: their Run has come and pinned what it needs."""
        for key in [k for k in self._early if k[2] <= call_id]:
            self._early.discard(key)
            self.store.free(key)

    # ------------------------------------------------------------ computations

    def _pump(self) -> None:
        """Start, in queue order, every queued action that can start now.

        Collective actions (group formation, computations with collectives) start
        strictly in the island's order: each names the previous one on this
        executor, and waits for it, however the messages arrived. Not re-entered:
        what a job finished during a pass wakes (a synchronous submit, in tests) is
        seen by another pass, so one pass sees every item still waiting.
        """
        if self._pumping:
            self._pump_again = True
            return
        self._pumping = True
        try:
            again = True
            while again and self._queue:
                self._pump_again = False
                # A collective action started (one held back behind it may start now), or a job ended.
                again = self._pump_once() or self._pump_again
        finally:
            self._pumping = False

    def _pump_once(self) -> bool:
        """One pass over the queue; True if a collective action started (and another may now be due).

        Once an item stays waiting, no later collective action starts in the pass: it would
        block the compute thread in gloo ahead of earlier work, which another member may
        need first (a deadlock). Later non-collective ones may pass it (they never block).
        """
        waiting, collective_started = collections.deque(), False
        held = False   # an earlier item waits: collective actions wait behind it
        try:
            while self._queue:
                item = self._queue.popleft()
                if isinstance(item, pb.FormGroup):
                    # A rendezvous blocks the compute thread like a collective: the same rules.
                    if held or not self._gang_turn(True, item.prev_collective_seq):
                        waiting.append(item)
                        held = self._program_order
                        continue
                    self._last_collective_seq, collective_started = item.seq, True
                    self._submitted += 1
                    self._submit(ComputeJob(None, form=item))
                    continue
                collective = item.collective
                after = item.after
                if (collective and (held or not self._gang_turn(True, item.prev_collective_seq))
                        or after is not None and not after.started):
                    waiting.append(item)   # behind earlier work, in gang order or in its run
                    held = self._program_order
                    continue
                entries = [self.store.get(key) for key in item.input_keys]
                functions = [self.functions.get(step.function_id) for step in item.steps]
                # An input still being computed here is fine: the compute thread runs jobs in order.
                if (all(e is not None and (e.ready or e.computing) for e in entries)
                        and all(f is None or f.ready for f in functions)):
                    if collective:
                        self._last_collective_seq, collective_started = item.last_collective_seq, True
                    self._start(item, functions, entries)
                else:
                    waiting.append(item)
                    held = self._program_order
        finally:
            self._queue = waiting + self._queue   # items that arrived during the pass stay behind
        return collective_started

    def _gang_turn(self, collective: bool, prev_collective_seq: int) -> bool:
        """Whether gang order lets an action start now: a collective one only once the previous
        collective action it names has started here (or was cancelled: `_on_cancel`)."""
        if not (collective and self._gang_order):
            return True
        while self._skipped and self._last_collective_seq in self._skipped:
            self._last_collective_seq = self._skipped.pop(self._last_collective_seq)
        return prev_collective_seq == self._last_collective_seq

    def _start(self, segment: Segment, functions: list, entries: list) -> None:
        segment.started, segment.after = True, None   # the next segment of its run may start
        job = ComputeJob(segment, functions)
        job.entries = entries
        self._begin(job)

    def _begin(self, job: ComputeJob) -> None:
        """Mark the job's outputs as being computed (a job queued behind it may read them) and submit it."""
        job.out_entries = [self.store.claim(key) for key in job.output_keys]
        for entry in job.out_entries:
            entry.computing = True
        self._submitted += 1
        self._note_depth()
        self._submit(job)

    def compute(self, job: ComputeJob) -> ComputeJob:
        """Run a job's steps in order (called on the compute thread); never raises.

        Values pass from step to step in slots; a failed step's outputs hold its failure,
        which reaches every step that reads them (the dataflow carries failures).
        """
        if job.form is not None:
            return self._form_group(job)
        if job.run is not None:
            return self._compute_run(job)
        segment = job.segment
        slots = [None] * segment.num_slots
        for index, entry in enumerate(job.entries):
            slots[index] = _value_or_failure(entry)
        for step, function in zip(segment.steps, job.functions):
            self._run_step(job, step, function, slots)
        job.values = [slots[slot] for slot in segment.output_slots]
        return job

    def _compute_run(self, job: ComputeJob) -> ComputeJob:
        """A plain run started at once (`_start_now`): its one step, on its entries' values."""
        seq, call_id = job.run
        outputs, failure, done = self._step(job.step, job.functions[0], [_value_or_failure(e) for e in job.entries],
                                            seq, call_id)
        job.values = [failure] * len(job.output_keys) if outputs is None else outputs
        job.computed = int(outputs is not None)
        if done is not None:
            job.dones.append(done)
        return job

    def _run_step(self, job: ComputeJob, step, function: _Function | None, slots: list) -> None:
        seq, call_id = job.segment.ids(step)
        outputs, failure, done = self._step(step, function, [slots[slot] for slot in step.inputs], seq, call_id)
        for index, slot in enumerate(step.outputs):
            slots[slot] = failure if outputs is None else outputs[index]
        if outputs is not None:
            job.computed += 1
        if done is not None:
            job.dones.append(done)

    def _step(self, step, function: _Function | None, inputs: list, seq: int, call_id: int) -> tuple:
        """Run one step on its input values (a value may be a failure, which it passes on).

        Returns (outputs, None, Done) or (None, failure, Done); the Done is None for a quiet step.
        """
        failure = None
        for value in inputs:
            if isinstance(value, pb.RemoteFailure):
                failure = value
                break
        if failure is None:
            # Only values from outside the segment can be a bad put or a hostile peer's; the
            # rest were just made here by functions with traced output signatures.
            failure = self._refusal(call_id, step, function, inputs if step.external else None)
        outputs, digests = None, []
        if failure is None:
            name = function.name
            # Visible in the trace: what reads these outputs is dispatched only after this ends.
            detail = "data-dependent output shapes: sequential dispatch" if step.report_shapes else ""
            self.trace.record("start", name, seq=seq, call_id=call_id, function_id=step.function_id, detail=detail)
            try:
                with self.collectives.bind(step.axis_groups, seq=seq, cache=step):
                    outputs = self.backend.run(function.compiled, inputs)
                if len(outputs) != len(step.outputs):
                    raise RuntimeError(f"function returned {len(outputs)} outputs, the call expects "
                                       f"{len(step.outputs)}")
                digests = [self.backend.digest(t) for t in outputs] if step.digest else []
            except Exception as exc:
                outputs, failure = None, self._failure(exc, origin_call_id=call_id)
            self.trace.record("end", name, seq=seq, call_id=call_id, function_id=step.function_id, detail=detail)
        if failure is not None and not failure.origin_call_id:
            failure = _with_origin(failure, call_id)
        if not step.report:
            return outputs, failure, None
        done = pb.Done(call_id=call_id, seq=seq, ok=failure is None, digests=digests)
        if failure is not None:
            done.failure.CopyFrom(failure)
        elif step.report_shapes:
            for value in outputs:
                done.output_shapes.add(shape=list(value.shape))
        return outputs, failure, done

    def _refusal(self, call_id: int, step, function: _Function | None, inputs: list | None) -> pb.RemoteFailure | None:
        """Why ``step`` cannot run at all: its function never loaded or failed to, or the inputs (when
        given: None skips the check) do not fit."""
        if function is None:
            return pb.RemoteFailure(type="ProtocolError", executor_id=self.executor_id, origin_call_id=call_id,
                                    message=f"function {step.function_id} was never loaded on this executor")
        if function.failure is not None:
            return function.failure
        return None if inputs is None else self._check_signature(call_id, function, inputs)

    def _check_signature(self, call_id: int, function: _Function, values: list) -> pb.RemoteFailure | None:
        """Refuse inputs that do not match the traced signature (a bad put or a hostile peer)."""
        if len(values) != len(function.signature):
            problem = f"expected {len(function.signature)} inputs, got {len(values)}"
        else:
            problem = next((f"input {i}: expected {_spec(shape, dtype)}, got {_spec(tuple(v.shape), v.dtype)}"
                            for i, (v, (shape, dtype)) in enumerate(zip(values, function.signature))
                            if tuple(v.shape) != shape or dtype_name(v.dtype) != dtype), None)
        if problem is None:
            return None
        return pb.RemoteFailure(type="SignatureError", executor_id=self.executor_id, origin_call_id=call_id,
                                message=f"function {function.name!r}: {problem}")

    def fail(self, job: ComputeJob, exc: BaseException) -> None:
        """A bug of ours outside any function: every output of the job fails with it (on the compute thread)."""
        if job.form is not None:
            return
        if job.run is not None:
            origin, reporting = job.run[1], [job.run] if job.step.report else []
        else:
            segment = job.segment
            origin = segment.ids(segment.steps[0])[1]
            reporting = [segment.ids(step) for step in segment.steps if step.report]
        failure = self._failure(exc, origin_call_id=origin)
        job.values = [failure] * len(job.output_keys)
        job.dones = [pb.Done(call_id=call_id, seq=seq, ok=False, failure=failure) for seq, call_id in reporting]

    def _form_group(self, job: ComputeJob) -> ComputeJob:
        form = job.form
        self.trace.record("start", "form group", seq=form.seq, detail=f"group {form.group_id}")
        try:
            self.collectives.form(form.group_id, form.rank, form.size, form.store_path, form.timeout_s,
                                  members=tuple(form.members))
        except Exception as exc:  # runs that use the group fail with this reason
            log.warning("%s: forming group %s failed: %s", self.executor_id, form.group_id, exc)
        self.trace.record("end", "form group", seq=form.seq, detail=f"group {form.group_id}")
        return job

    def finish(self, job: ComputeJob) -> None:
        """Store a job's outputs (or their failures), release its inputs, tell the controller.

        The compute thread calls it right after ``compute(job)``, before it takes the next
        job: a job queued behind this one (local chaining) finds its inputs stored.
        """
        self._submitted -= 1
        if job.form is not None:
            self._pump()
            return
        for entry in job.out_entries:
            entry.computing = False
        # Outputs were claimed (owned) when the run arrived; a Free since then must stand.
        for key, value in zip(job.output_keys, job.values):
            if isinstance(value, pb.RemoteFailure):
                self.store.fill(key, failure=value, owned=False)
            else:
                self.store.fill(key, value, owned=False)
        self.num_computations += job.computed
        for key in job.input_keys:
            self.store.unpin(key)
            if key[2]:  # a transient copy made for this call alone
                self.store.free(key)
        for done in job.dones:
            self.outbox.to_controller(pb.Envelope(done=done))
        self._pump()

    # ------------------------------------------------------------ helpers

    def _name(self, function_id: int) -> str:
        function = self.functions.get(function_id)
        return function.name if function else ""

    def _failure(self, exc: BaseException, *, origin_call_id: int) -> pb.RemoteFailure:
        return pb.RemoteFailure(type=type(exc).__name__, message=str(exc), executor_id=self.executor_id,
                                traceback="".join(traceback.format_exception(exc)), origin_call_id=origin_call_id,
                                op=getattr(exc, "op", ""), node_index=getattr(exc, "node_index", 0))

    def _drop(self, why: str) -> None:
        self.dropped_messages += 1
        log_dropped(log, self.dropped_messages, self.executor_id, why)


_DATA_KINDS = {"put", "transfer", "fetch", "save_shards"}
_TRANSFER_TIMEOUT_S = 20.0        # until Welcome says (the controller's transfer_timeout_s)
_SLOWEST_LINK = 1e6               # bytes/s: a transfer's deadline allows this slow a link
_MAX_EARLY_TRANSFERS = 4096
_MAX_REFUSED_EARLY = 65536


def _with_origin(failure: pb.RemoteFailure, call_id: int) -> pb.RemoteFailure:
    copy = pb.RemoteFailure()
    copy.CopyFrom(failure)
    copy.origin_call_id = call_id
    return copy


def _value_or_failure(entry):
    """An input's value, or the failure its producer stored instead."""
    return entry.failure if entry.failure is not None else entry.value


def _value_ids(plan: pb.RegisterProgram, run: pb.RunProgram):
    """Map a program value number to the array id it has in this run."""
    fixed = dict(zip(plan.input_values, run.input_array_ids))
    fixed.update(zip(plan.output_values, run.output_array_ids))
    return lambda value: fixed.get(value, run.first_intermediate_id + value)


def _spec(shape, dtype) -> str:
    return f"{dtype_name(dtype)}{list(shape)}"


def payload_bytes(payload: list) -> list:
    """The raw buffers of received frames (for hashing)."""
    return [f.buffer if hasattr(f, "buffer") else f for f in payload]
