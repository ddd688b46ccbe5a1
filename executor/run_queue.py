"""The run queue and gang order: an executor's order is the schedule.

Work is queued as *segments* (`executor/segments.py`): a plain Run is a segment of one step, a
registered program's run is a few segments whose steps pass values to each other on the compute
thread. Segments are queued in the island's sequence order (the order the controller sends them; one
that arrives out of it is put in its place) and started in that order among those that are
*startable*: every input present, every function compiled, and, within one program run, the run's
previous segment here started (the program's order is the schedule). Between independent calls, one
whose function is still compiling (in the background) or whose input is still coming lets later ready
ones pass, so a long compile does not stall the executor. Collective-bearing work (a segment with
collective steps, a group formation) keeps strict sequence order among itself (gang scheduling) and
never starts while work queued before it has not started: a blocked gloo call holds the compute thread
(see `pump`).

A job's life here: queued (`_enqueue`), or started at once when nothing is ahead of it (`_start_now`);
handed to the compute thread (`_begin`); stored and reported (`finish`). `cancel` drops the queued work
of calls that failed with a lost peer and steps over their places in gang order.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from typing import Callable

from pathways_torch.wire import pb

from .data_plane import DataPlane
from .jobs import ComputeJob, FormJob, LoadedFunction, RunJob, SegmentJob
from .messages import Outbox, program_run_refused, remote_failure, shard_key, with_origin
from .output_budget import program_budgets, refuse_over_budget
from .segments import Segment, SegmentPlan, instantiate, plan_segments, run_step, single, unpark_chains
from .store import ObjectStore
from .trace import TraceRecorder

__all__ = ["RunQueue"]

log = logging.getLogger(__name__)


class RunQueue:
    """Queued segments and group formations of one executor, started in gang order, finished in order."""

    def __init__(self, *, executor_id: str, store: ObjectStore, functions: dict[int, LoadedFunction],
                 outbox: Outbox, trace: TraceRecorder, data: DataPlane, submit: Callable[[ComputeJob], None],
                 drop: Callable[[str], None], gang_order: bool = True, program_order: bool = True,
                 programs: dict | None = None):
        self.executor_id = executor_id
        self.store = store
        self.functions = functions      # the core's, filled as LoadFunction messages come
        self.outbox = outbox
        self.trace = trace
        self._data = data               # pins a run's inputs and claims its early copies; pushes a program's sends
        self.submit = submit            # hands a job to the compute thread
        self._drop = drop
        # the plan, its segments, and the local intermediates a run stores (freed once it is enqueued)
        self.programs: dict[int, tuple[pb.RegisterProgram, list, list]] = {} if programs is None else programs
        self._run_steps: dict = {}   # the Step of each kind of plain Run (see segments.single)
        self.queued: collections.deque = collections.deque()   # Segments and pb.FormGroups, in arrival order
        # Segments whose run's previous segment here has not started: each waits on that one (`Segment.parked`), not
        # in `queued`, so a pass does not look at a chain of them on every arrival (73 µs a hop for a 128-node
        # program, issue 49); the one before it puts it back at the head of the pass when it starts (`_start`).
        self._parked = 0
        self._submitted = 0             # jobs handed to the compute thread, not yet finished
        # The most work ever waiting here at once (queued + submitted): run-ahead keeps it bounded.
        self.queue_high_water = 0
        self.last_collective_seq = 0    # the last collective action started here (gang order)
        # Only tests turn these off, to show that without them collectives deadlock or order breaks.
        self._gang_order = gang_order
        self._program_order = program_order   # a run's segments in order; collectives behind earlier work
        self._pumping = False           # a pass over the queue is under way (see pump)
        self._pump_again = False        # something became startable during that pass
        # Collective actions cancelled before they started (their calls failed with a lost peer): previous
        # collective seq → the cancelled one's last seq, so gang order steps over them (`_gang_turn`).
        self._skipped: dict[int, int] = {}
        self.cancelled = 0               # queued segments and formations dropped by Cancel
        self.num_computations = 0

    # ------------------------------------------------------------ arrivals

    def on_run(self, run: pb.Run, payload) -> None:
        if not self.queued and not self._pumping and self._start_now(run):
            return
        self._enqueue(single(run, self._run_steps), run.owner, run.donated_inputs, run.output_budget_bytes)

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
        self._data.accept_run(input_keys, output_keys, call_id, run.owner, run.donated_inputs, run.output_budget_bytes)
        if run.collective:
            self.last_collective_seq = seq
        job = RunJob(function, run_step(run, self._run_steps), seq=seq, call_id=call_id,
                     input_keys=input_keys, output_keys=output_keys)
        job.entries = entries
        self._begin(job)
        return True

    def _enqueue(self, segment: Segment, owner: str = "", donated=(), budgets=()) -> None:
        """Queue a segment of a run of the client of role ``owner`` (its outputs are that client's); ``donated``:
        input positions the client gave up with it; ``budgets``: the bytes counted for each output (`accept_run`)."""
        self.trace.record_steps("receive", segment.trace_ids, segment.base_seq, segment.base_call_id, self._name)
        self._data.accept_run(segment.input_keys, segment.output_keys, segment.last_call_id, owner, donated, budgets)
        self._queue_in_order(segment)
        self._note_depth()
        # Wake the queue when a missing input arrives. Only missing ones: a segment that
        # starts (and ends) now frees its transient inputs, which must not be re-claimed.
        for key in segment.input_keys:
            entry = self.store.get(key)
            if not entry.ready:
                entry.waiters.append(lambda _entry: self.pump())
        self.pump()

    def on_form_group(self, msg: pb.FormGroup, payload) -> None:
        self.trace.record("receive", "form group", seq=msg.seq, detail=f"group {msg.group_id} rank {msg.rank}")
        self._queue_in_order(msg)
        self._note_depth()
        self.pump()

    def _queue_in_order(self, item) -> None:
        """Queue a Segment or a FormGroup in sequence order: "queued before" is "earlier in the island's order"
        (`_pump_once`). The controller sends in that order, so this is an append but for reordered deliveries.
        A segment behind its run's previous one, which has not started, is parked on it instead: between the two in
        sequence order there is nothing (a run's segments are queued together), so that is its place."""
        if type(item) is Segment and item.after is not None and not item.after.started:
            item.after.parked = item
            self._parked += 1
            return
        queue = self.queued
        if not queue or queue[-1].seq <= item.seq:
            queue.append(item)
            return
        index = len(queue) - 1
        while index > 0 and queue[index - 1].seq > item.seq:
            index -= 1
        queue.insert(index, item)

    def _note_depth(self) -> None:
        self.queue_high_water = max(self.queue_high_water, len(self.queued) + self._parked + self._submitted)

    def on_register_program(self, msg: pb.RegisterProgram, payload) -> None:
        self.trace.record("receive", f"register program {msg.name}", detail=f"{len(msg.actions)} actions")
        items = plan_segments(msg)
        # A run frees its stored intermediates once all is enqueued; only those a segment stores can be in the store
        # (the rest live in the segment's slots): looking up the others cost a microsecond each, 127 per run of a
        # 128-node chain.
        stored = {(v, shard) for item in items if isinstance(item, SegmentPlan) for v, shard, _ in item.outputs}
        frees = [ref for ref in msg.local_intermediates if (ref.value, ref.shard) in stored]
        self.programs[msg.program_id] = (msg, items, frees)

    def on_run_program(self, msg: pb.RunProgram, payload) -> None:
        """Enqueue one run of a registered program: all its segments and sends at once."""
        registered = self.programs.get(msg.program_id)
        if registered is None:
            # The controller believes this executor holds the program: its state and ours disagree, and no
            # call of the run can be answered here (its call ids are in the program). Say so; the
            # controller treats this executor as lost.
            self._drop(f"run of unknown program {msg.program_id}")
            self.outbox.to_controller(program_run_refused(
                self.executor_id, msg, f"executor {self.executor_id} was asked to run program {msg.program_id}, "
                                       f"which it does not hold (never registered here)"))
            return
        plan, items, frees = registered
        array_id = _value_ids(plan, msg)
        previous = None   # the run's segments are chained: each starts after the one before it here
        for item in items:
            if isinstance(item, SegmentPlan):
                segment = instantiate(item, msg, array_id, after=previous)
                if self._program_order:
                    previous = segment
                self._enqueue(segment, msg.owner, budgets=program_budgets(msg, segment.output_keys))
                continue
            request = pb.SendShard(to_address=item.to_address, to_public_key=item.to_public_key,
                                   call_id=msg.base_call_id + item.to_node, to_inbox=item.to_inbox)
            request.shard.CopyFrom(pb.ShardRef(array_id=array_id(item.value), shard=item.shard))
            request.as_ref.CopyFrom(pb.ShardRef(array_id=array_id(item.value), shard=item.shard,
                                                tag=msg.base_call_id + item.to_node))
            self._data.on_send_shard(request, ())
        # Every use is enqueued (and pins its buffer): stored intermediates can be let go;
        # each is deleted once produced and used.
        for ref in frees:
            self.store.free((array_id(ref.value), ref.shard, 0))

    # ------------------------------------------------------------ refusals and cancellation

    def refuse_run(self, run: pb.Run, exc: BaseException) -> None:
        """A Run whose handling raised (a bug of ours): its outputs fail here, so what reads them fails too,
        and its Done carries the exception and its traceback, so the call's future ends."""
        log.exception("%s: handling the Run of call %d failed; the call fails", self.executor_id, run.call_id)
        failure = remote_failure(exc, self.executor_id, origin_call_id=run.call_id)
        for ref in run.outputs:
            entry = self.store.get(shard_key(ref))
            if entry is None or not entry.ready:
                # Still the run's client's to read (and see the failure), whether or not the run was accepted.
                self.store.claim(shard_key(ref), owned=True).owner = self._data.owners.as_owner(run.owner)
                self.store.fill(shard_key(ref), failure=failure)
        if run.collective and run.prev_collective_seq == self.last_collective_seq:
            # Its turn in gang order has passed: later collective work must not wait for it forever.
            self.last_collective_seq = run.seq
        if not run.quiet:
            self.outbox.to_controller(pb.Envelope(done=pb.Done(call_id=run.call_id, seq=run.seq, ok=False,
                                                               failure=failure)))

    def cancel(self, msg: pb.Cancel) -> None:
        """An executor of this island was lost: drop the queued work of the calls that failed with it (their
        outputs fail with the loss, each reporting step says so in a Done, so the controller ends the call), skip
        their places in gang order, abandon queued formations of its groups. ``call_ids`` names plain calls and
        program runs (by their first call id): every segment of a named run goes, reporting or not.

        Work already started is not touched: a collective blocked on the lost peer was ended by the heartbeat
        thread (`CollectiveRuntime.abandon`); the rest completes, and its Done is ignored.
        """
        calls, groups = set(msg.call_ids), set(msg.group_ids)
        failure = pb.RemoteFailure(type="ExecutorLostError", message=msg.reason,
                                   executor_id=msg.lost_executor.split("@")[0])
        kept: collections.deque = collections.deque()
        dropped = []
        items, self._parked = unpark_chains(self.queued), 0
        for item in items:
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
        self.queued = kept
        with self._pumps_deferred():
            for segment in dropped:
                self._drop_segment(segment, failure)
        self._repark()
        self.trace.record("receive", "cancel", detail=f"{msg.lost_executor} lost: {len(dropped)} segments dropped")
        self.pump()

    def _repark(self) -> None:
        """Park again the queued segments whose run's previous segment has not started (after `cancel`)."""
        queue, self.queued = self.queued, collections.deque()
        for item in queue:
            self._queue_in_order(item)

    def _drop_segment(self, segment: Segment, failure: pb.RemoteFailure) -> None:
        """A queued segment that will never run: its outputs fail, its inputs are let go, its gang turn passes,
        and the next segment of its run is not held behind it."""
        self.cancelled += 1
        segment.started, segment.after = True, None
        if segment.collective:
            self._skip(segment.prev_collective_seq, segment.last_collective_seq)
        for key in segment.output_keys:
            self.store.fill(key, failure=with_origin(failure, key[2] or segment.base_call_id), owned=False)
        for key in segment.input_keys:
            self.store.unpin(key)
            if key[2]:   # a copy made for this call alone (it may still be on its way: then it is refused)
                self.store.abandon(key)
        for step in segment.steps:
            if step.report:
                seq, call_id = segment.ids(step)
                done = pb.Done(call_id=call_id, seq=seq, ok=False)
                done.failure.CopyFrom(with_origin(failure, call_id))
                self.outbox.to_controller(pb.Envelope(done=done))

    def skip_gang(self, prev_collective_seq: int, last_collective_seq: int) -> None:
        """Gang order steps over a run that failed before it came here (its launch was lost with a launch tree's
        executor): its collectives ran from after ``prev_collective_seq`` to ``last_collective_seq``."""
        if self.last_collective_seq < last_collective_seq:
            self._skip(prev_collective_seq, last_collective_seq)

    def _skip(self, prev_collective_seq: int, last_collective_seq: int) -> None:
        self._skipped[prev_collective_seq] = last_collective_seq

    # ------------------------------------------------------------ starting, in order

    def pump(self) -> None:
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
            while again and self.queued:
                self._pump_again = False
                # A collective action started (one held back behind it may start now), or a job ended.
                again = self._pump_once() or self._pump_again
        finally:
            self._pumping = False

    @contextlib.contextmanager
    def _pumps_deferred(self):
        """What wakes the queue inside this block waits for the caller's `pump` after it: a job's outputs filled
        one by one woke a full pass over the queue each (33 passes for a pipeline stage's fused job), and a pass
        must not run while the queue is being rebuilt (`cancel`)."""
        pumping, self._pumping = self._pumping, True
        try:
            yield
        finally:
            self._pumping = pumping

    def _pump_once(self) -> bool:
        """One pass over the queue; True if a collective action started (and another may now be due).

        Once an item stays waiting, no later collective action starts in the pass: it would
        block the compute thread in gloo ahead of earlier work, which another member may
        need first (a deadlock). Later non-collective ones may pass it (they never block).
        """
        waiting, collective_started = collections.deque(), False
        held = False   # an earlier item waits: collective actions wait behind it
        try:
            while self.queued:
                item = self.queued.popleft()
                if isinstance(item, pb.FormGroup):
                    # A rendezvous blocks the compute thread like a collective: the same rules.
                    if held or not self._gang_turn(True, item.prev_collective_seq):
                        waiting.append(item)
                        held = self._program_order
                        continue
                    self.last_collective_seq, collective_started = item.seq, True
                    self._submitted += 1
                    self.submit(FormJob(item))
                    continue
                collective = item.collective
                after = item.after
                if (collective and (held or not self._gang_turn(True, item.prev_collective_seq))
                        or after is not None and not after.started):
                    waiting.append(item)   # behind earlier work, in gang order or in its run
                    held = self._program_order
                    continue
                # Inputs first: a run dispatched ahead waits for them, and its functions need not be looked up.
                ready = item.inputs_here(self.store.get)
                functions = [self.functions.get(step.function_id) for step in item.steps] if ready else ()
                if ready and all(f is None or f.ready for f in functions):
                    if collective:
                        self.last_collective_seq, collective_started = item.last_collective_seq, True
                    self._start(item, functions, [self.store.get(key) for key in item.input_keys])
                else:
                    waiting.append(item)
                    held = self._program_order
        finally:
            self.queued = waiting + self.queued   # items that arrived during the pass stay behind
        return collective_started

    def _gang_turn(self, collective: bool, prev_collective_seq: int) -> bool:
        """Whether gang order lets an action start now: a collective one only once the previous
        collective action it names has started here (or was cancelled: `cancel`)."""
        if not (collective and self._gang_order):
            return True
        while self._skipped and self.last_collective_seq in self._skipped:
            self.last_collective_seq = self._skipped.pop(self.last_collective_seq)
        return prev_collective_seq == self.last_collective_seq

    def _start(self, segment: Segment, functions: list, entries: list) -> None:
        segment.started, segment.after = True, None   # the next segment of its run may start
        successor = segment.parked
        if successor is not None:   # next in this pass (`_pump_once` takes from the head of `queued`)
            segment.parked = None
            self._parked -= 1
            self.queued.appendleft(successor)
        job = SegmentJob(segment, functions)
        job.entries = entries
        self._begin(job)

    def _begin(self, job: ComputeJob) -> None:
        """Mark the job's outputs as being computed (a job queued behind it may read them) and submit it."""
        job.out_entries = [self.store.claim(key) for key in job.output_keys]
        for entry in job.out_entries:
            entry.computing = True
        self._submitted += 1
        self._note_depth()
        self.submit(job)

    # ------------------------------------------------------------ completion

    def finish(self, job: ComputeJob) -> None:
        """Store a job's outputs (or their failures), release its inputs, tell the controller.

        The compute thread calls it right after ``compute(job)``, before it takes the next
        job: a job queued behind this one (local chaining) finds its inputs stored.
        """
        self._submitted -= 1
        if type(job) is FormJob:
            self.pump()
            return
        budgeted = False
        for entry in job.out_entries:
            entry.computing = False
            budgeted = budgeted or entry.budget is not None
        if budgeted:   # under the controller's memory limit: none stored past the bytes counted for it
            refuse_over_budget(job, self.executor_id, self._data.counters)
        # Outputs were claimed (owned) when the run arrived; a Free since then must stand.
        with self._pumps_deferred():
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
        self.pump()

    def _name(self, function_id: int) -> str:
        function = self.functions.get(function_id)
        return function.name if function else ""


def _value_ids(plan: pb.RegisterProgram, run: pb.RunProgram):
    """Map a program value number to the array id it has in this run."""
    fixed = dict(zip(plan.input_values, run.input_array_ids))
    fixed.update(zip(plan.output_values, run.output_array_ids))
    return lambda value: fixed.get(value, run.first_intermediate_id + value)
