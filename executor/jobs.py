"""What the compute thread is handed: one small class per kind of job, and the loaded functions they call.

A job is one of

- `SegmentJob`: a queued segment (`executor/segments.py`), its steps run back to back;
- `RunJob`: a plain Run started at once, without a segment or a pass over the queue (the OpByOp path,
  `RunQueue._start_now`);
- `FormJob`: a process group formation (a rendezvous, which blocks the compute thread like a collective).

The run queue makes them (`executor/run_queue.py`), the step interpreter runs them by kind
(`executor/interpreter.py`), and `RunQueue.finish` stores what they made. This module imports no torch.
"""

from __future__ import annotations

from pathways_torch.wire import pb

from .segments import Segment

__all__ = ["LoadedFunction", "ComputeJob", "SegmentJob", "RunJob", "FormJob"]


class LoadedFunction:
    """A loaded function: its traced input signature and, once compiled, the callable."""

    __slots__ = ("name", "signature", "compiled", "failure", "ready", "mutates")

    def __init__(self, name: str, signature: list):
        self.name, self.signature = name, signature
        self.compiled, self.failure, self.ready = None, None, False
        # Input positions it writes in place, on a backend of mutable values (executor/backends/mutated_inputs.py).
        self.mutates: frozenset[int] = frozenset()


class ComputeJob:
    """What every job carries to the compute thread and back.

    ``input_keys`` and ``output_keys`` are store keys; ``entries`` the input entries, read on the compute
    thread (local chaining); ``out_entries`` the claimed outputs. ``values`` holds, per stored output, its
    tensor or its `pb.RemoteFailure`; ``dones`` the Done of every reporting step; ``computed`` how many
    steps ran.
    """

    __slots__ = ("entries", "out_entries", "values", "dones", "computed", "input_keys", "output_keys")
    segment: Segment | None = None   # the segment a job runs, if it runs one

    def __init__(self, input_keys=(), output_keys=()):
        self.input_keys, self.output_keys = input_keys, output_keys
        self.entries: list = []
        self.out_entries: list = []
        self.values: list = []
        self.dones: list[pb.Done] = []
        self.computed = 0

    @property
    def seq(self) -> int:
        """Its place in the island's sequence order (its first step's)."""
        raise NotImplementedError

    def origin_call_id(self) -> int:
        """The call a failure outside any function is charged to."""
        raise NotImplementedError

    def reporting(self) -> list[tuple[int, int]]:
        """``(seq, call id)`` of each step that reports a Done."""
        raise NotImplementedError


class SegmentJob(ComputeJob):
    """A queued segment started: its steps and, per step, the function it calls."""

    __slots__ = ("segment", "functions")

    def __init__(self, segment: Segment, functions: list):
        super().__init__(segment.input_keys, segment.output_keys)
        self.segment, self.functions = segment, functions

    @property
    def seq(self) -> int:
        return self.segment.seq

    def origin_call_id(self) -> int:
        segment = self.segment
        return segment.ids(segment.steps[0])[1]

    def reporting(self) -> list[tuple[int, int]]:
        segment = self.segment
        return [segment.ids(step) for step in segment.steps if step.report]


class RunJob(ComputeJob):
    """A plain Run started at once: its one ``step``, the ``function`` it calls, its seq and call id."""

    __slots__ = ("function", "step", "seq", "call_id")

    def __init__(self, function: LoadedFunction, step, *, seq: int, call_id: int, input_keys, output_keys):
        super().__init__(input_keys, output_keys)
        self.function, self.step, self.seq, self.call_id = function, step, seq, call_id

    def origin_call_id(self) -> int:
        return self.call_id

    def reporting(self) -> list[tuple[int, int]]:
        return [(self.seq, self.call_id)] if self.step.report else []


class FormJob(ComputeJob):
    """A process group formation: it stores nothing and reports nothing (a run that uses the group
    fails if it did not form)."""

    __slots__ = ("form",)

    def __init__(self, form: pb.FormGroup):
        super().__init__()
        self.form = form

    @property
    def seq(self) -> int:
        return self.form.seq

    def origin_call_id(self) -> int:
        return 0

    def reporting(self) -> list[tuple[int, int]]:
        return []
