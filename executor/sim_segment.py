"""A simulated device runs a whole segment at once: its clock advances by the steps' declared times in one go.

On a simulating host (`executor.sim_host`) a thousand simulated executors share two cores, and the executor's
Python per step (about 13 µs: the failure scan, two trace events, the clock, the binding, a placeholder per
output) made 1,024 executors × 128 steps cost 1.7 s of CPU per program run: more than the device time being
simulated at small T, and enough to start the last executors hundreds of milliseconds late. None of it is the
control plane's cost, which is what a simulation is for.

So a segment whose steps cannot fail (every function loaded and simulated, no input a failure, the signature of
what comes from outside right) is run here in one pass: the device time of each step is its declared time, only
the segment's stored outputs get placeholders, each reporting step gets its Done (device time: its own and the
quiet steps' before it, as `StepInterpreter` charges it), and the trace gets one span for the segment. Anything
else (a failure to pass on, digests, data-dependent shapes, in-place inputs) goes the step-by-step way.
Imports no torch.
"""

from __future__ import annotations

from pathways_torch.wire import pb

from .jobs import SegmentJob
from .messages import value_or_failure
from .sim import SimTensor, _SimFunction

__all__ = ["run_segment_at_once"]


class _Summary:
    """What a qualifying segment plan does on a simulated device, the same for every run: worked out once per plan
    and functions (walking 128 steps twice per run was a tenth of a simulating host's time per run)."""

    __slots__ = ("total_s", "reports", "placeholders", "external", "name", "first", "last")

    def __init__(self, steps, functions, output_slots):
        stored = set(output_slots)
        self.total_s, unreported = 0.0, 0
        self.reports: list = []          # [step, device ns its Done carries]: its own and the quiet steps' before it
        self.placeholders: list = []     # (slot, shape, dtype) of every stored output
        for step, function in zip(steps, functions):
            simulated: _SimFunction = function.compiled
            device_ns = int(simulated.seconds * 1e9)
            self.total_s += simulated.seconds
            for index, slot in enumerate(step.outputs):
                if slot in stored:
                    self.placeholders.append((slot, *simulated.outputs[index]))
            if step.report:
                self.reports.append([step, unreported + device_ns])
                unreported = 0
            else:
                unreported += device_ns
        if unreported and self.reports:
            self.reports[-1][1] += unreported
        self.external = [(step, function) for step, function in zip(steps, functions) if step.external]
        self.name = f"{functions[0].name} +{len(functions) - 1} steps" if len(functions) > 1 else functions[0].name
        self.first, self.last = steps[0], steps[-1]


def _summary_of(segment, functions) -> _Summary | None:
    """The segment's summary, kept on its plan (a registered program's segment) for the functions it was made with;
    None when the segment does not qualify."""
    plan = segment.plan
    cached = plan.device_summary if plan is not None else None
    if cached is not None and cached[0] == functions:
        return cached[1]
    summary = _Summary(segment.steps, functions, segment.output_slots) if _qualifies(segment, functions) else None
    if plan is not None:
        plan.device_summary = (list(functions), summary)
    return summary


def run_segment_at_once(job: SegmentJob, backend, trace, hand_over, handed_over, check_signature) -> bool:
    """Run ``job`` in one pass if it qualifies (see the module docstring); False: run it step by step."""
    segment = job.segment
    summary = _summary_of(segment, job.functions)
    if summary is None:
        return False
    entries = job.entries
    values = [value_or_failure(e) for e in entries]
    if any(v is None or isinstance(v, pb.RemoteFailure) for v in values):
        return False
    for step, function in summary.external:
        if any(slot >= len(values) for slot in step.inputs) or check_signature(
                segment.ids(step)[1], function, [values[slot] for slot in step.inputs]) is not None:
            return False
    slots: list = [None] * segment.num_slots
    for index, entry in enumerate(entries):
        slots[index] = hand_over(entry, handed_over)
    for slot, shape, dtype in summary.placeholders:
        slots[slot] = SimTensor(shape, dtype)
    for step, device_ns in summary.reports:
        seq, call_id = segment.ids(step)
        job.dones.append(pb.Done(call_id=call_id, seq=seq, ok=True, device_ns=device_ns))
    (first_seq, first_call), (last_seq, last_call) = segment.ids(summary.first), segment.ids(summary.last)
    trace.record("start", summary.name, seq=first_seq, call_id=first_call, function_id=summary.first.function_id,
                 detail="simulated segment")
    backend.advance(summary.total_s)
    trace.record("end", summary.name, seq=last_seq, call_id=last_call, function_id=summary.last.function_id,
                 detail="simulated segment")
    job.computed = len(segment.steps)
    job.values = [slots[slot] for slot in segment.output_slots]
    return True


def _qualifies(segment, functions) -> bool:
    for step, function in zip(segment.steps, functions):
        if function is None or function.failure is not None or function.mutates \
                or not isinstance(function.compiled, _SimFunction) or step.digest or step.report_shapes:
            return False
    return True
