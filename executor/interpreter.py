"""The step interpreter: what the compute thread does with a job, looked up in a table by the job's kind.

`StepInterpreter.compute` maps each kind of job (`executor/jobs.py`) to its handler, as
torch.distributed.pipelining's `_PipelineScheduleRuntime` maps action kinds to handlers: a segment
runs its steps in order, values passing between them in slots; a plain run started at once runs its
one step; a group formation forms the group. A step runs its function on the backend inside its
process groups (`CollectiveRuntime.bind`), or, when an input is a failure or the function cannot run
those inputs (`_refusal`), passes a failure on instead: the dataflow carries failures.

It runs outside the core's lock and touches no shared state but the trace: what a job made is
stored by `RunQueue.finish`, on the same thread, right after.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

from pathways_torch.wire import pb
from pathways_torch.wire.tensors import dtype_name

from .collectives import CollectiveRuntime
from .fusion import FUSE_ENV, FusedSteps, plan_fusion
from .jobs import ComputeJob, FormJob, LoadedFunction, RunJob, SegmentJob
from .messages import remote_failure, with_origin
from .sim_segment import run_segment_at_once
from .trace import TraceRecorder

__all__ = ["StepInterpreter"]

log = logging.getLogger(__name__)


class StepInterpreter:
    """Runs jobs on the compute thread: ``compute(job)`` never raises; ``fail`` covers a bug of ours."""

    def __init__(self, *, executor_id: str, backend, collectives: CollectiveRuntime, trace: TraceRecorder,
                 hand_over: Callable):
        self.executor_id = executor_id
        # An input the store no longer needs is the computation's to free (`ObjectStore.hand_over`); a late
        # reader of it gets this failure instead.
        self._hand_over = hand_over
        self._handed_over = pb.RemoteFailure(type="ProtocolError", executor_id=executor_id,
                                             message="this shard was freed: a computation took it over")
        self.backend = backend
        # A step's device time is read from the device's clock: the wall clock, or a simulated device's own.
        self._clock_ns = getattr(backend, "clock_ns", time.perf_counter_ns)
        # A simulated device on a host that does not sleep runs a whole segment in one pass (executor/sim_segment.py)
        self._at_once = getattr(backend, "runs_segments_at_once", False)
        self.collectives = collectives
        self.trace = trace
        # Consecutive steps as one executable (executor/fusion.py), unless PATHWAYS_FUSE=0.
        self._fuses = hasattr(backend, "fuse") and os.environ.get(FUSE_ENV, "1") != "0"
        # Bound once: the lookup per job allocates nothing.
        self._by_kind: dict[type, Callable[[ComputeJob], ComputeJob]] = {
            SegmentJob: self._compute_segment,
            RunJob: self._compute_run,
            FormJob: self._form_group,
        }

    def compute(self, job: ComputeJob) -> ComputeJob:
        """Run a job's steps in order (called on the compute thread); never raises.

        Values pass from step to step in slots; a failed step's outputs hold its failure,
        which reaches every step that reads them (the dataflow carries failures).
        """
        return self._by_kind[type(job)](job)

    def _compute_segment(self, job: SegmentJob) -> SegmentJob:
        if self._at_once and run_segment_at_once(job, self.backend, self.trace, self._hand_over, self._handed_over,
                                                 self._check_signature):
            return job
        segment = job.segment
        slots = [None] * segment.num_slots
        hand_over, handed_over = self._hand_over, self._handed_over
        for index, entry in enumerate(job.entries):
            slots[index] = hand_over(entry, handed_over)
        unreported = 0   # device time of quiet steps: charged with the next report (a run's last node reports)
        fusion = self._fusion(segment, job.functions) if self._fuses and segment.plan is not None else None
        if fusion is None:
            for step, function in zip(segment.steps, job.functions):
                unreported = self._run_step(job, step, function, slots, unreported)
        else:
            for unit in fusion.units:
                if type(unit) is FusedSteps:
                    unreported = self._run_fused(job, unit, slots, unreported)
                else:
                    unreported = self._run_step(job, unit[0], unit[1], slots, unreported)
        if unreported and job.dones:
            job.dones[-1].device_ns += unreported
        job.values = [slots[slot] for slot in segment.output_slots]
        return job

    def _compute_run(self, job: RunJob) -> RunJob:
        """A plain run started at once (`RunQueue._start_now`): its one step, on its entries' values."""
        hand_over, handed_over = self._hand_over, self._handed_over
        inputs = [hand_over(e, handed_over) for e in job.entries]
        function = job.function
        if function is not None and function.mutates:
            _copy_shared(inputs, function.mutates, _held_alone(job.step, job.entries), self.backend.copy_value)
        outputs, failure, done, _ = self._step(job.step, function, inputs, job.seq, job.call_id)
        job.values = [failure] * len(job.output_keys) if outputs is None else outputs
        job.computed = int(outputs is not None)
        if done is not None:
            job.dones.append(done)
        return job

    def _fusion(self, segment, functions: list):
        """The segment plan's fusion (`executor.fusion`), made once for its loaded functions; None: nothing fused."""
        plan = segment.plan
        fusion = plan.fusion
        if fusion is None or fusion.functions != tuple(functions):
            fusion = plan.fusion = plan_fusion(plan.steps, functions, segment.output_slots, self.backend)
            log.info("%s: %s\n%s", self.executor_id, plan.describe(), fusion.describe())
        return fusion if fusion.fused else None

    def _run_fused(self, job: SegmentJob, unit: FusedSteps, slots: list, unreported: int) -> int:
        """Run consecutive steps as one executable; alone, one by one, where an input is a failure, an input from
        outside the segment does not fit its function, or the executable did not compile."""
        steps = unit.steps
        arguments = [slots[slot] for slot in unit.inputs]
        if unit.executable is None:
            unit.executable = self._compile_fused(unit, arguments)
        if unit.executable is False or self._refuses_any(unit, arguments):
            del arguments
            for step, function in zip(steps, unit.functions):
                unreported = self._run_step(job, step, function, slots, unreported)
            return unreported
        for slot in unit.frees:   # the list passed on holds them now
            slots[slot] = None
        seq, call_id = job.segment.ids(steps[0])
        self.trace.record("start", unit.label, seq=seq, call_id=call_id, function_id=steps[0].function_id)
        started = self._clock_ns()
        try:
            with self.collectives.bind(steps[0].axis_groups, seq=seq, cache=steps[0]):
                outputs = self.backend.run(unit.executable, arguments)
            failure = None
        except Exception as exc:
            outputs, failure = None, remote_failure(exc, self.executor_id, origin_call_id=call_id)
        del arguments
        device_ns = self._clock_ns() - started + unreported
        self.trace.record("end", unit.label, seq=seq, call_id=call_id, function_id=steps[0].function_id)
        for index, slot in enumerate(unit.outputs):
            slots[slot] = failure if outputs is None else outputs[index]
        if outputs is not None:
            job.computed += len(steps)
        reporting = unit.reporting
        for step in reporting:
            step_seq, step_call_id = job.segment.ids(step)
            done = pb.Done(call_id=step_call_id, seq=step_seq, ok=failure is None,
                           device_ns=device_ns if step is reporting[-1] else 0)
            if failure is not None:
                done.failure.CopyFrom(failure)
            job.dones.append(done)
        return 0 if reporting else device_ns

    def _compile_fused(self, unit: FusedSteps, arguments: list):
        """The unit's executable, or False (logged) where it cannot be built: its steps then run alone."""
        if any(isinstance(value, pb.RemoteFailure) for value in arguments):
            return None      # no shapes to trace from this run: the next one compiles it
        self.trace.record("compile_start", unit.label, detail=self.backend.name)
        try:
            return self.backend.fuse(unit, arguments)
        except Exception as exc:
            log.warning("%s: %s did not compile as one executable (%s: %s); its steps run one by one",
                        self.executor_id, unit.label, type(exc).__name__, exc)
            return False
        finally:
            self.trace.record("compile_end", unit.label, detail=unit.describe())

    @staticmethod
    def _refuses_any(unit: FusedSteps, arguments: list) -> bool:
        """An input is a failure, or a value from outside the segment does not fit the step that reads it (the
        steps then run alone, and the lone step's check names the problem)."""
        if any(isinstance(value, pb.RemoteFailure) for value in arguments):
            return True
        where = unit.input_index
        for step, function in zip(unit.steps, unit.functions):
            if not step.external:
                continue
            signature = function.signature
            if len(step.inputs) != len(signature):
                return True
            for (shape, dtype), slot in zip(signature, step.inputs):
                value = arguments[where[slot]] if slot in where else None
                if value is not None and (tuple(value.shape) != shape or dtype_name(value.dtype) != dtype):
                    return True
        return False

    def _run_step(self, job: SegmentJob, step, function: LoadedFunction | None, slots: list, unreported: int) -> int:
        """Run one step of a segment; the device time not yet reported, after it."""
        seq, call_id = job.segment.ids(step)
        inputs = [slots[slot] for slot in step.inputs]
        if function is not None and function.mutates:
            _copy_shared(inputs, function.mutates, _held_alone(step, job.entries), self.backend.copy_value)
        for slot in step.frees:   # the list passed on holds them now; a boxed backend frees them inside
            slots[slot] = None
        outputs, failure, done, device_ns = self._step(step, function, inputs, seq, call_id)
        for index, slot in enumerate(step.outputs):
            slots[slot] = failure if outputs is None else outputs[index]
        if outputs is not None:
            job.computed += 1
        if done is None:
            return unreported + device_ns
        done.device_ns += unreported
        job.dones.append(done)
        return 0

    def _step(self, step, function: LoadedFunction | None, inputs: list, seq: int, call_id: int) -> tuple:
        """Run one step on its input values (a value may be a failure, which it passes on).

        Returns (outputs, None, Done, device ns) or (None, failure, Done, device ns); the Done is None for a quiet
        step. Device ns: how long the backend ran it (the device time a client's share is charged).
        """
        # Not a loop variable: it would hold the last input past its last use (see `ObjectStore.hand_over`).
        failure = next((value for value in inputs if isinstance(value, pb.RemoteFailure)), None)
        if failure is None:
            # Only values from outside the segment can be a bad put or a hostile peer's; the
            # rest were just made here by functions with traced output signatures.
            failure = self._refusal(call_id, step, function, inputs if step.external else None)
        outputs, digests, device_ns = None, [], 0
        if failure is None:
            name = function.name
            # Visible in the trace: what reads these outputs is dispatched only after this ends.
            detail = "data-dependent output shapes: sequential dispatch" if step.report_shapes else ""
            self.trace.record("start", name, seq=seq, call_id=call_id, function_id=step.function_id, detail=detail)
            started = self._clock_ns()
            try:
                with self.collectives.bind(step.axis_groups, seq=seq, cache=step):
                    outputs = self.backend.run(function.compiled, inputs)
                if len(outputs) != len(step.outputs):
                    raise RuntimeError(f"function returned {len(outputs)} outputs, the call expects "
                                       f"{len(step.outputs)}")
                digests = [self.backend.digest(t) for t in outputs] if step.digest else []
            except Exception as exc:
                outputs, failure = None, remote_failure(exc, self.executor_id, origin_call_id=call_id)
            device_ns = self._clock_ns() - started
            self.trace.record("end", name, seq=seq, call_id=call_id, function_id=step.function_id, detail=detail)
        if failure is not None and not failure.origin_call_id:
            failure = with_origin(failure, call_id)
        if not step.report:
            return outputs, failure, None, device_ns
        done = pb.Done(call_id=call_id, seq=seq, ok=failure is None, digests=digests, device_ns=device_ns)
        if failure is not None:
            done.failure.CopyFrom(failure)
        elif step.report_shapes:
            for value in outputs:
                done.output_shapes.add(shape=list(value.shape))
        return outputs, failure, done, device_ns

    def _refusal(self, call_id: int, step, function: LoadedFunction | None,
                 inputs: list | None) -> pb.RemoteFailure | None:
        """Why ``step`` cannot run at all: its function never loaded or failed to, or the inputs (when
        given: None skips the check) do not fit."""
        if function is None:
            return pb.RemoteFailure(type="ProtocolError", executor_id=self.executor_id, origin_call_id=call_id,
                                    message=f"function {step.function_id} was never loaded on this executor")
        if function.failure is not None:
            return function.failure
        return None if inputs is None else self._check_signature(call_id, function, inputs)

    def _check_signature(self, call_id: int, function: LoadedFunction, values: list) -> pb.RemoteFailure | None:
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

    def _form_group(self, job: FormJob) -> FormJob:
        form = job.form
        self.trace.record("start", "form group", seq=form.seq, detail=f"group {form.group_id}")
        try:
            self.collectives.form(form.group_id, form.rank, form.size, form.store_path, form.timeout_s,
                                  members=tuple(form.members))
        except Exception as exc:  # runs that use the group fail with this reason
            log.warning("%s: forming group %s failed: %s", self.executor_id, form.group_id, exc)
        self.trace.record("end", "form group", seq=form.seq, detail=f"group {form.group_id}")
        return job

    def fail(self, job: ComputeJob, exc: BaseException) -> None:
        """A bug of ours outside any function: every output of the job fails with it (on the compute thread)."""
        if type(job) is FormJob:
            return
        failure = remote_failure(exc, self.executor_id, origin_call_id=job.origin_call_id())
        job.values = [failure] * len(job.output_keys)
        job.dones = [pb.Done(call_id=call_id, seq=seq, ok=False, failure=failure) for seq, call_id in job.reporting()]


def _held_alone(step, entries: list) -> Callable[[int], bool]:
    """Whether ``step`` alone holds its input at a position: read by no later step nor stored (``frees``), passed
    once, and made by an earlier step or handed over by the store (the job's first ``len(entries)`` slots)."""
    def alone(position: int) -> bool:
        slot = step.inputs[position]
        return (slot in step.frees and step.inputs.count(slot) == 1
                and (slot >= len(entries) or entries[slot].handed))
    return alone


def _copy_shared(inputs: list, mutated, alone, copy) -> None:
    """Replace each input the function writes in place (or consumes: XLA's donation) by a ``copy``, unless
    ``alone(position)``: the computation alone holds it (handed over by the store, or made by an earlier step,
    and read by nobody after)."""
    for position in mutated:
        value = inputs[position] if position < len(inputs) else None
        if value is not None and not isinstance(value, pb.RemoteFailure) and not alone(position):
            inputs[position] = copy(value)


def _spec(shape, dtype) -> str:
    return f"{dtype_name(dtype)}{list(shape)}"
