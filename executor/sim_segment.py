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


def run_segment_at_once(job: SegmentJob, backend, trace, hand_over, handed_over, check_signature) -> bool:
    """Run ``job`` in one pass if it qualifies (see the module docstring); False: run it step by step."""
    segment, functions = job.segment, job.functions
    if not _qualifies(segment, functions):
        return False
    entries = job.entries
    values = [value_or_failure(e) for e in entries]
    if any(v is None or isinstance(v, pb.RemoteFailure) for v in values):
        return False
    for step, function in zip(segment.steps, functions):
        if not step.external:
            continue
        if any(slot >= len(values) for slot in step.inputs) or check_signature(
                segment.ids(step)[1], function, [values[slot] for slot in step.inputs]) is not None:
            return False
    slots: list = [None] * segment.num_slots
    for index, entry in enumerate(entries):
        slots[index] = hand_over(entry, handed_over)
    stored = set(segment.output_slots)
    total = unreported = 0
    for step, function in zip(segment.steps, functions):
        simulated: _SimFunction = function.compiled
        device_ns = int(simulated.seconds * 1e9)
        total += simulated.seconds
        for index, slot in enumerate(step.outputs):
            if slot in stored:
                shape, dtype = simulated.outputs[index]
                slots[slot] = SimTensor(shape, dtype)
        if step.report:
            seq, call_id = segment.ids(step)
            job.dones.append(pb.Done(call_id=call_id, seq=seq, ok=True, device_ns=unreported + device_ns))
            unreported = 0
        else:
            unreported += device_ns
    if unreported and job.dones:
        job.dones[-1].device_ns += unreported
    first, last = segment.steps[0], segment.steps[-1]
    name = f"{functions[0].name} +{len(functions) - 1} steps" if len(functions) > 1 else functions[0].name
    trace.record("start", name, seq=segment.ids(first)[0], call_id=segment.ids(first)[1],
                 function_id=first.function_id, detail="simulated segment")
    backend.advance(total)
    trace.record("end", name, seq=segment.ids(last)[0], call_id=segment.ids(last)[1], function_id=last.function_id,
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
