"""Fusion: consecutive steps of a program's segment compiled into one executable.

A segment (`executor.segments`) already runs its steps back to back on the compute
thread, values passing in slots. Where the backend can compose its compiled functions
(``xla:torchax``: each function one XLA executable, collectives inside it), a run of
consecutive steps that bind the same process groups becomes one executable: a Chained
program's 128 nodes, a pipeline stage's F/B actions with no transfer between them. What
one step hands the next stays inside XLA; one call, one binding, one trace span.

A step is not fused, and the plan says why (`FusionPlan.describe`), where its function
is not one executable (a host stage, a fallback op, data-dependent output sizes), it
consumes (donates) its inputs, its outputs are digested (debug mode) or their sizes
reported, or the fused executable would pass `MAX_FUSED_OPS` ops. Results do not change:
a fused run whose inputs include a failure, or whose executable failed to compile, runs
its steps one by one instead.

The plan is made once per segment plan and set of loaded functions; its executables are
compiled at the segment's first run, from that run's values.
"""

from __future__ import annotations

import logging

__all__ = ["MAX_FUSED_OPS", "FUSE_ENV", "FusedSteps", "FusionPlan", "plan_fusion", "fusion_text"]

log = logging.getLogger(__name__)

FUSE_ENV = "PATHWAYS_FUSE"   # "0": every step runs alone (to measure what fusion changes)
MAX_FUSED_OPS = 8192   # aten ops in one fused executable: past it, a new one starts (compile time grows with it)


class FusedSteps:
    """Consecutive steps run as one executable: the slots it reads and writes, and those it frees.

    ``executable``: None until the first run compiles it; False where that failed (the steps then run alone).
    """

    __slots__ = ("steps", "functions", "inputs", "input_index", "outputs", "frees", "executable", "num_ops", "label",
                 "reporting")

    def __init__(self, steps: list, functions: list, kept_slots: set, num_ops: int):
        self.steps, self.functions, self.num_ops = steps, functions, num_ops
        produced = {slot for step in steps for slot in step.outputs}
        self.inputs = list(dict.fromkeys(slot for step in steps for slot in step.inputs if slot not in produced))
        self.input_index = {slot: index for index, slot in enumerate(self.inputs)}
        self.outputs = [slot for step in steps for slot in step.outputs if slot in kept_slots]
        freed = {slot for step in steps for slot in step.frees}
        self.frees = tuple(slot for slot in self.inputs if slot in freed)
        self.executable = None
        self.reporting = [step for step in steps if step.report]   # the steps whose Done goes out
        self.label = f"fused n{steps[0].offset}..n{steps[-1].offset}"

    def describe(self) -> str:
        return (f"{self.label}: {len(self.steps)} steps, one executable ({self.num_ops} ops, "
                f"{len(self.inputs)} in, {len(self.outputs)} out)")


class FusionPlan:
    """A segment's steps as units: ``(step, function)`` run alone, or `FusedSteps`; and why each lone step is
    alone."""

    __slots__ = ("functions", "units", "reasons")

    def __init__(self, functions: tuple, units: list, reasons: dict):
        self.functions, self.units, self.reasons = functions, units, reasons

    @property
    def fused(self) -> list:
        return [unit for unit in self.units if type(unit) is FusedSteps]

    def describe(self) -> str:
        lines = []
        for unit in self.units:
            if type(unit) is FusedSteps:
                lines.append(unit.describe())
            else:
                offset = unit[0].offset
                lines.append(f"n{offset}: not fused: {self.reasons.get(offset, 'alone')}")
        return "\n".join(lines)


def plan_fusion(steps: list, functions: list, output_slots, backend) -> FusionPlan:
    """The units of a segment whose steps call ``functions`` (loaded), storing ``output_slots``."""
    refusal = getattr(backend, "fusion_refusal", None)
    reasons: dict[int, str] = {}
    runs: list[list] = []          # runs of fusable (step, function, ops), split where the binding changes
    for step, function in zip(steps, functions):
        why = _step_refusal(step, function, refusal)
        if why:
            reasons[step.offset] = why
            runs.append([])
            continue
        if not runs or not runs[-1] or runs[-1][-1][0].axis_groups != step.axis_groups:
            runs.append([])
        runs[-1].append((step, function, backend.fusion_ops(function.compiled)))
    read_from = _reads_from(steps)
    position = {step.offset: index for index, step in enumerate(steps)}
    fused_at: dict[int, FusedSteps] = {}
    for run in runs:
        for chunk in _chunks(run, reasons):
            if len(chunk) > 1:
                after = position[chunk[-1][0].offset] + 1
                unit = FusedSteps([s for s, _, _ in chunk], [f for _, f, _ in chunk],
                                  set(output_slots) | read_from[after], sum(ops for _, _, ops in chunk))
                fused_at[chunk[0][0].offset] = unit
            elif chunk:
                reasons.setdefault(chunk[0][0].offset, "no neighbour to fuse with (the steps beside it cannot be)")
    units, skip_until = [], -1
    for index, step in enumerate(steps):
        if index <= skip_until:
            continue
        unit = fused_at.get(step.offset)
        if unit is None:
            units.append((step, functions[index]))
        else:
            units.append(unit)
            skip_until = index + len(unit.steps) - 1
    return FusionPlan(tuple(functions), units, reasons)


def _step_refusal(step, function, refusal) -> str:
    if refusal is None:
        return "this backend does not fuse"
    if function is None or function.failure is not None:
        return "its function did not load"
    if function.mutates:
        return "it consumes (donates) inputs"
    if step.digest:
        return "its outputs are digested (debug mode)"
    if step.report_shapes:
        return "its output sizes depend on the data"
    return refusal(function.compiled)


def _chunks(run: list, reasons: dict) -> list[list]:
    """``run`` cut where the fused executable would pass `MAX_FUSED_OPS`."""
    chunks, ops = [[]], 0
    for item in run:
        if chunks[-1] and ops + item[2] > MAX_FUSED_OPS:
            reasons[item[0].offset] = f"starts a new executable: one would pass {MAX_FUSED_OPS} ops"
            chunks.append([])
            ops = 0
        chunks[-1].append(item)
        ops += item[2]
    return chunks


def _reads_from(steps: list) -> list[set]:
    """``[i]``: the slots steps i, i+1, ... read (what a unit ending before step i must hand out, besides the
    segment's stored values; the rest of its values stay inside its executable)."""
    reads = [set() for _ in range(len(steps) + 1)]
    for index in range(len(steps) - 1, -1, -1):
        reads[index] = reads[index + 1] | set(steps[index].inputs)
    return reads


def fusion_text(programs: dict) -> list[str]:
    """Per segment of a held program that has run (its fusion is planned at the first run): which steps run as
    one executable and why the others do not. ``programs``: `RunQueue.programs`."""
    texts = []
    for program_id, (msg, items, _) in programs.items():
        for item in items:
            fusion = getattr(item, "fusion", None)
            if fusion is not None:
                texts.append(f"program {msg.name} ({program_id}) {item.describe()}\n{fusion.describe()}")
    return texts
