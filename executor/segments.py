"""Segments: consecutive computations one executor runs back to back on its compute thread.

Every computation an executor runs belongs to a *segment*: a short list of steps
(function calls) whose inputs are either the segment's external inputs — store
entries, waited for before the segment starts — or outputs of earlier steps of the
same segment, handed from step to step on the compute thread without touching the
store or the I/O thread. Only values someone else needs (program outputs, values
pushed to another executor, values a later segment reads) are stored.

A plain ``Run`` is a segment of one step. A registered program is cut into segments
once, when it is registered (`plan_segments`); each run of it only fills in array
ids and sequence numbers (`instantiate`). A segment ends

- before a step that reads a copy pushed from another executor (that step waits for
  the copy; the steps before it should not), and
- after a step whose output leaves the segment early: a program output (its Done
  should not wait for later steps) or a value pushed to another executor (the
  consumer there should not wait either).

So a chain of local nodes — the common case of a program on one mesh — is a single
segment: one hand-off to the compute thread and one store update per run, instead
of per node, while every node keeps its own sequence number and call id.

Within one run an executor keeps the program's order: each segment starts only once
the run's previous segment here has started (``Segment.after``), so a later segment whose
inputs are local never passes an earlier one that waits for a copy.

Gang order is kept: a program's collective steps on one executor carry consecutive
positions in that executor's collective order, so running them back to back inside
a segment is running them in the island's order. The segment waits for the
predecessor of its first collective step, and after it starts the executor's last
collective action is its last collective step.

This module imports no torch (simulated executors use it).
"""

from __future__ import annotations

from pathways_torch.wire import pb

__all__ = ["Step", "SegmentPlan", "Segment", "plan_segments", "instantiate", "single", "run_step", "trace_ids",
           "unpark_chains"]

_MAX_CACHED_STEPS = 4096


class Step:
    """One computation of a segment: a function applied to slots, writing slots.

    ``offset`` is the node index in its program (0 for a plain run): seq = base_seq + offset,
    call id = base_call_id + offset.
    """

    __slots__ = ("offset", "function_id", "inputs", "outputs", "collective", "axis_groups", "report", "digest",
                 "report_shapes", "binding", "external", "frees")

    def __init__(self, *, offset: int, function_id: int, inputs: list[int], outputs: list[int], collective: bool,
                 axis_groups: dict, report: bool, digest: bool, report_shapes: bool = False):
        self.offset, self.function_id, self.inputs, self.outputs = offset, function_id, inputs, outputs
        self.collective, self.axis_groups, self.report, self.digest = collective, axis_groups, report, digest
        self.report_shapes = report_shapes   # data-dependent output sizes: Done carries them
        self.binding = None                  # the resolved process groups (CollectiveRuntime.bind)
        self.external = True                 # reads a segment input (a stored value): checked against its signature
        # The slots no later step reads and the segment does not store: emptied once this step has read them,
        # so that an input handed over (`ObjectStore.hand_over`) is freed inside the function (its last use).
        self.frees: tuple[int, ...] = tuple(inputs)


def trace_ids(steps) -> tuple:
    """(offset, function id) of each step: what a trace entry keeps of a segment (`TraceRecorder.record_steps`)."""
    return tuple((step.offset, step.function_id) for step in steps)


class SegmentPlan:
    """A segment of a registered program, the same for every run of it.

    ``inputs[i]`` fills slot i: ``(value, shard, copy_node)``, where copy_node is the consuming
    node of a pushed copy (its call id tags the copy) or -1 for a value stored here.
    ``outputs``: ``(value, shard, slot)`` of the values the segment stores.
    """

    __slots__ = ("steps", "inputs", "outputs", "produced", "num_slots", "first_prev_collective_node",
                 "last_collective_node", "_trace_ids", "device_summary", "fusion")

    def __init__(self):
        self.steps: list[Step] = []
        self.produced: list[tuple[int, int, int]] = []   # (value, shard, slot) of every step output
        self.inputs: list[tuple[int, int, int]] = []
        self.outputs: list[tuple[int, int, int]] = []
        self.num_slots = 0
        self.first_prev_collective_node = -1   # the first collective step's ProgramNode.prev_collective_node
        self.last_collective_node = -1
        self._trace_ids: tuple | None = None
        self.device_summary = None   # what a simulated device does with it, worked out once (executor/sim_segment.py)
        self.fusion = None           # which steps run as one executable (executor/fusion.py), worked out once

    @property
    def trace_ids(self) -> tuple:
        """(offset, function id) of each step: what a trace entry keeps of them (not the steps, whose resolved
        process groups it would keep alive)."""
        if self._trace_ids is None:
            self._trace_ids = trace_ids(self.steps)
        return self._trace_ids

    def describe(self) -> str:
        """One line, e.g. ``segment n0..n127 (128 steps, 1 in, 1 out, collective)``."""
        first, last = self.steps[0].offset, self.steps[-1].offset
        collective = ", collective" if self.last_collective_node >= 0 else ""
        steps = f"{len(self.steps)} step{'s' if len(self.steps) > 1 else ''}"
        return (f"segment n{first}..n{last} ({steps}, {len(self.inputs)} in, "
                f"{len(self.outputs)} out{collective})")


class Segment:
    """A queued segment of one run: store keys and sequence numbers filled in.

    ``after``: the previous segment of the same program run on this executor (None for the
    first, and for a plain run): the program's order is the schedule, so this one starts only
    once that one has started (``started``; the compute thread runs jobs in order).
    """

    __slots__ = ("steps", "base_seq", "base_call_id", "input_keys", "output_keys", "output_slots", "num_slots",
                 "collective", "prev_collective_seq", "last_collective_seq", "after", "started", "plan",
                 "inputs_ready", "parked")

    def __init__(self, *, steps, base_seq, base_call_id, input_keys, output_keys, output_slots, num_slots,
                 collective, prev_collective_seq, last_collective_seq, after: "Segment | None" = None,
                 plan: "SegmentPlan | None" = None):
        self.plan = plan   # the registered program's segment it is a run of (None: a plain Run)
        self.steps, self.base_seq, self.base_call_id = steps, base_seq, base_call_id
        self.input_keys, self.output_keys, self.output_slots = input_keys, output_keys, output_slots
        self.num_slots, self.collective = num_slots, collective
        self.prev_collective_seq, self.last_collective_seq = prev_collective_seq, last_collective_seq
        self.after, self.started = after, False
        # The next segment of its run, kept out of the queue until this one starts (`RunQueue._queue_in_order`).
        self.parked: "Segment | None" = None
        # How many leading inputs were seen ready (or being computed here): once so, an input stays so while the
        # segment is queued (it pins them), and the queue's next pass starts its look from there.
        self.inputs_ready = 0

    def inputs_here(self, get) -> bool:
        """Whether every input is stored or being computed here (the compute thread runs jobs in order), looking
        only past those seen so before (``inputs_ready``); ``get``: the store's lookup."""
        keys, index = self.input_keys, self.inputs_ready
        while index < len(keys):
            entry = get(keys[index])
            if entry is None or not (entry.ready or entry.computing):
                break
            index += 1
        self.inputs_ready = index
        return index == len(keys)

    def ids(self, step: Step) -> tuple[int, int]:
        """(sequence number, call id) of one of its steps."""
        return self.base_seq + step.offset, self.base_call_id + step.offset

    @property
    def trace_ids(self) -> tuple:
        """(offset, function id) of each step (`SegmentPlan.trace_ids`)."""
        return self.plan.trace_ids if self.plan is not None else trace_ids(self.steps)

    @property
    def seq(self) -> int:
        """The sequence number of the first step."""
        return self.ids(self.steps[0])[0]

    @property
    def last_call_id(self) -> int:
        return self.ids(self.steps[-1])[1]


def run_step(run: pb.Run, steps: dict | None = None) -> Step:
    """The `Step` of a plain Run (inputs in slots 0..n-1, outputs after them).

    ``steps``: a cache of the step of each kind of run seen before — a call site run
    again and again reuses one, with its resolved process groups.
    """
    num_inputs = len(run.inputs)
    key = (run.function_id, num_inputs, len(run.outputs), run.collective, tuple(sorted(run.axis_groups.items())),
           run.quiet, run.digest_outputs, run.report_shapes)
    step = steps.get(key) if steps is not None else None
    if step is None:
        step = Step(offset=0, function_id=run.function_id, inputs=list(range(num_inputs)),
                    outputs=list(range(num_inputs, num_inputs + len(run.outputs))), collective=run.collective,
                    axis_groups=dict(run.axis_groups), report=not run.quiet, digest=run.digest_outputs,
                    report_shapes=run.report_shapes)
        if steps is not None:
            if len(steps) >= _MAX_CACHED_STEPS:
                steps.clear()
            steps[key] = step
    return step


def single(run: pb.Run, steps: dict | None = None) -> Segment:
    """A plain Run as a segment of one step (see `run_step` for ``steps``)."""
    step = run_step(run, steps)
    num_inputs, outputs = len(step.inputs), step.outputs
    return Segment(steps=[step], base_seq=run.seq, base_call_id=run.call_id,
                   input_keys=[(r.array_id, r.shard, r.tag) for r in run.inputs],
                   output_keys=[(r.array_id, r.shard, r.tag) for r in run.outputs], output_slots=outputs,
                   num_slots=num_inputs + len(outputs), collective=run.collective,
                   prev_collective_seq=run.prev_collective_seq, last_collective_seq=run.seq)


def plan_segments(program: pb.RegisterProgram) -> list:
    """Cut a registered program into segments: a list of `SegmentPlan` and `pb.ProgramSend`, in action order."""
    sent = {(a.send.value, a.send.shard) for a in program.actions if a.WhichOneof("kind") == "send"}
    program_outputs = set(program.output_values)
    items: list = []
    current: SegmentPlan | None = None
    produced_in_current: dict[tuple[int, int], int] = {}
    for action in program.actions:
        if action.WhichOneof("kind") == "send":
            items.append(action.send)
            continue
        node = action.run
        if current is None or any(ref.copy for ref in node.inputs):
            current, produced_in_current = SegmentPlan(), {}
            items.append(current)
        _add_step(current, node, produced_in_current)
        if any(v in program_outputs or (v, node.shard) in sent for v in node.outputs):
            current = None
    _choose_outputs([i for i in items if isinstance(i, SegmentPlan)], program_outputs, sent)
    return items


def _add_step(plan: SegmentPlan, node: pb.ProgramNode, produced: dict) -> None:
    """Append ``node`` to ``plan``: its inputs become slots (new external ones, or earlier steps' outputs)."""
    inputs = []
    for ref in node.inputs:
        if not ref.copy and (ref.value, ref.shard) in produced:
            inputs.append(produced[(ref.value, ref.shard)])
            continue
        source = (ref.value, ref.shard, node.node if ref.copy else -1)
        if source not in plan.inputs:
            plan.inputs.append(source)
        inputs.append(("input", plan.inputs.index(source)))
    outputs = []
    for value in node.outputs:
        outputs.append(plan.num_slots)
        produced[(value, node.shard)] = plan.num_slots
        plan.produced.append((value, node.shard, plan.num_slots))
        plan.num_slots += 1
    if node.collective:
        if plan.first_prev_collective_node < 0:
            plan.first_prev_collective_node = node.prev_collective_node
        plan.last_collective_node = node.node
    plan.steps.append(Step(offset=node.node, function_id=node.function_id, inputs=inputs, outputs=outputs,
                           collective=node.collective, axis_groups=dict(node.axis_groups), report=node.report,
                           digest=node.digest_outputs))


def _choose_outputs(plans: list[SegmentPlan], program_outputs: set, sent: set) -> None:
    """Store what leaves a segment (program outputs, pushed values, inputs of later segments); number the slots.

    External inputs take the first slots: a step's ``("input", i)`` becomes slot i and
    every produced slot moves up by the number of inputs.
    """
    read_later: set[tuple[int, int]] = set()
    for plan in reversed(plans):
        shift = len(plan.inputs)
        for step in plan.steps:
            step.inputs = [ref[1] if isinstance(ref, tuple) else ref + shift for ref in step.inputs]
            step.outputs = [slot + shift for slot in step.outputs]
            step.external = any(slot < shift for slot in step.inputs)
        plan.num_slots += shift
        plan.outputs = [(value, shard, slot + shift) for value, shard, slot in plan.produced
                        if value in program_outputs or (value, shard) in sent or (value, shard) in read_later]
        _mark_frees(plan)
        read_later |= {(value, shard) for value, shard, copy_node in plan.inputs if copy_node < 0}


def _mark_frees(plan: SegmentPlan) -> None:
    """Each step's ``frees``: the slots whose last reader it is, less the ones the segment stores."""
    kept = {slot for _, _, slot in plan.outputs}
    last_reader = {slot: step for step in plan.steps for slot in step.inputs}
    for step in plan.steps:
        step.frees = tuple(slot for slot in dict.fromkeys(step.inputs) if last_reader[slot] is step and slot not in kept)


def instantiate(plan: SegmentPlan, run: pb.RunProgram, array_id, after: Segment | None = None) -> Segment:
    """``plan`` for one run: ``array_id(value)`` is the value's array in this run; ``after`` the run's
    previous segment on this executor (see `Segment`)."""
    input_keys = [(array_id(value), shard, run.base_call_id + copy_node if copy_node >= 0 else 0)
                  for value, shard, copy_node in plan.inputs]
    collective = plan.last_collective_node >= 0
    prev = plan.first_prev_collective_node
    return Segment(steps=plan.steps, base_seq=run.base_seq, base_call_id=run.base_call_id, input_keys=input_keys,
                   output_keys=[(array_id(value), shard, 0) for value, shard, _ in plan.outputs],
                   output_slots=[slot for _, _, slot in plan.outputs], num_slots=plan.num_slots,
                   collective=collective,
                   prev_collective_seq=(run.base_seq + prev - 1 if prev > 0 else run.prev_collective_seq),
                   last_collective_seq=run.base_seq + plan.last_collective_node if collective else 0, after=after,
                   plan=plan)


def unpark_chains(queued) -> list:
    """Every item of ``queued`` in order, each parked segment (`Segment.parked`) right behind the one it waited on,
    its link cut (`RunQueue.cancel` parks again what must wait)."""
    items = []
    for item in queued:
        while item is not None:
            items.append(item)
            item, parked = getattr(item, "parked", None), item
            if item is not None:
                parked.parked = None
    return items
