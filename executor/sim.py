"""The simulated device: occupies its device for a declared time and imports no torch.

A function's `LoadFunction.sim_seconds` says how long one run keeps the device
busy; the graph itself is not run (nor decoded). Outputs are placeholders with the
traced shapes and dtypes, so the dataflow (transfers, fetches, lifetimes) behaves
as with real tensors, and a fetch returns zeros of the right size. The device
clock advances by the declared time per run and the compute thread sleeps to that
absolute deadline, so sleep overshoot does not accumulate. Without torch, 64+
executors fit on a small machine.

On a simulating host (`executor.sim_host`: many simulated executors in one process)
nothing sleeps: ``sleeps=False``, the host says when each job became ready
(``ready_at``), `run` only advances the clock, and the host finishes the job when
the clock's deadline (`free_at`) comes.
"""

from __future__ import annotations

import hashlib
import time

from pathways_torch.wire import pb

__all__ = ["SimBackend", "SimTensor"]

_ITEM_SIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}

# No spinning: on a machine with fewer cores than simulated devices, a spinning device
# steals the CPU the others need. Overshoot (tens of microseconds) does not accumulate,
# because each deadline is the previous deadline plus the step, not "now" plus the step.
_SPIN_S = 0.0


class SimTensor:
    """A placeholder value: shape, dtype name and (for puts) the bytes that came."""

    __slots__ = ("shape", "dtype", "data")

    def __init__(self, shape, dtype: str, data=None):
        self.shape, self.dtype, self.data = tuple(shape), dtype, data

    def numel(self) -> int:
        count = 1
        for d in self.shape:
            count *= d
        return count

    def element_size(self) -> int:
        return _ITEM_SIZES.get(self.dtype, 4)

    @property
    def nbytes(self) -> int:
        return self.numel() * self.element_size()

    def contiguous(self) -> "SimTensor":
        return self


class _SimFunction:
    __slots__ = ("seconds", "outputs")

    def __init__(self, seconds: float, outputs: list[tuple[tuple[int, ...], str]]):
        self.seconds, self.outputs = seconds, outputs


class SimBackend:
    """Runs nothing; keeps a device clock; never imports torch."""

    name = "sim"
    compiles_in_background = False

    def __init__(self, device: str = "sim", *, sleeps: bool = True):
        self.device = "sim"
        self.sleeps = sleeps
        self._free_at = 0.0   # when the simulated device finishes its queued work (time.monotonic)
        # A host that does not sleep: when the job now computed became ready (it starts then, or when the device
        # is free, whichever is later), so that the host's lateness in finishing the last job does not accumulate.
        self.ready_at: float | None = None

    @property
    def runs_segments_at_once(self) -> bool:
        """Whether a segment's steps advance the clock in one go (`executor.sim_segment`): on a host that does not
        sleep, where the per-step Python would be the simulation's cost, not the system's."""
        return not self.sleeps

    def advance(self, seconds: float) -> None:
        """Occupy the device for ``seconds`` more, from when the job became ready or the device is free."""
        now = time.monotonic() if self.ready_at is None else self.ready_at
        self._free_at = max(self._free_at, now) + seconds

    @property
    def free_at(self) -> float:
        """When the simulated device is done with the work it was given (time.monotonic)."""
        return self._free_at

    def clock_ns(self) -> int:
        """The device's clock, which a step's device time is read from: the wall clock while it sleeps, else its
        own (the start of the next step, then its end)."""
        if self.sleeps:
            return time.perf_counter_ns()
        return int(max(self._free_at, self.ready_at or 0.0) * 1e9)

    def prepare(self, load: pb.LoadFunction, payload: list):
        outputs = [(tuple(m.shape), m.dtype) for m in load.graph.outputs]
        if not outputs:
            raise ValueError(f"function {load.name!r} declares no outputs; the sim backend needs the traced "
                             f"output signature")
        if any(d < 0 for shape, _ in outputs for d in shape):
            raise ValueError(f"function {load.name!r} has output sizes that depend on the data; a simulated "
                             f"device has no data to decide them: use a real backend for it")
        return _SimFunction(max(0.0, load.sim_seconds), outputs), []

    def compile(self, function, example_inputs):
        return function

    def run(self, function: _SimFunction, inputs) -> list:
        self.advance(function.seconds)
        if self.sleeps:
            _sleep_until(self._free_at)
        return [SimTensor(shape, dtype) for shape, dtype in function.outputs]

    def from_frame(self, meta: pb.TensorMeta, frames: list) -> SimTensor:
        if not 1 <= meta.frame <= len(frames):
            raise ValueError(f"tensor header names frame {meta.frame}, message has frames 1..{len(frames)}")
        frame = frames[meta.frame - 1]
        data = bytes(frame.buffer if hasattr(frame, "buffer") else frame)
        value = SimTensor(meta.shape, meta.dtype, data)
        if len(data) != value.numel() * value.element_size():
            raise ValueError(f"tensor {meta.dtype}{list(meta.shape)} does not match its {len(data)}-byte frame")
        return value

    def to_frame(self, value: SimTensor, meta: pb.TensorMeta, frame_index: int):
        meta.dtype, meta.frame = value.dtype, frame_index
        meta.shape[:] = list(value.shape)
        return value.data if value.data is not None else bytes(value.numel() * value.element_size())

    def digest(self, value: SimTensor) -> bytes:
        return hashlib.blake2b(value.data or repr(value.shape).encode(), digest_size=16).digest()

    def to_device(self, value):
        return value

    def counters(self) -> dict[str, int]:
        return {}

    def num_compiles(self) -> int:
        return 0


def _sleep_until(deadline: float) -> None:
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(max(left - _SPIN_S, 0.0))
