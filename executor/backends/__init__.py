"""Device backends: how a decoded graph is compiled and run on this executor's device.

``compile(graph_module, example_inputs)`` returns a callable on device values
(called once per graph and input signature, possibly on the compile thread);
``run`` calls it and leaves the outputs on the device, where the object store
keeps them in the backend's own form; ``from_frame`` / ``to_frame`` convert at the
wire.

- ``xla``: XLA, by the installed route (`resolve_backend_name`): ``xla:torchax``
  (the default: torch graphs lowered to XLA through JAX, values kept as jax
  arrays) or ``xla:torch_xla`` (torch_xla 2.9's lazy tensors, torch 2.9 only).
- ``eager``: no compile; runs the aten graph op by op (bit-for-bit with eager PyTorch).
- ``inductor``: ``torch._inductor.compile`` of the aten graph (the CUDA default).
- ``sim``: a simulated device that occupies itself for a declared time and imports no torch.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from pathways_torch.wire import pb
from pathways_torch.wire.backend_names import BACKEND_NAMES, XLA_ROUTES, resolve_backend_name

__all__ = ["Backend", "make_backend", "resolve_backend_name", "BACKEND_NAMES", "XLA_ROUTES"]


class Backend(Protocol):
    name: str
    device: str
    compiles_in_background: bool

    def prepare(self, load: pb.LoadFunction, payload: list) -> tuple:
        """Decode a received function: (what to compile, example inputs for the compile)."""

    def from_frame(self, meta: pb.TensorMeta, frames: list):
        """A received tensor frame as this backend's value (on its device)."""

    def to_frame(self, value, meta: pb.TensorMeta, frame_index: int):
        """A stored value as a frame to send (fills ``meta``)."""

    def digest(self, value) -> bytes:
        """A digest of a value's bytes and shape (debug mode's replication check)."""

    def compile(self, graph_module, example_inputs: Sequence):
        """Return a callable taking and returning device tensors for this input signature."""

    def run(self, compiled, inputs: Sequence) -> list:
        """Run a compiled function on device tensors; return its outputs (on the device)."""

    def num_compiles(self) -> int:
        """How many graphs this backend compiled so far."""

    def counters(self) -> dict[str, int]:
        """Backend counters for ``ctx.stats()`` (conversions, fallbacks); may be empty."""



def make_backend(name: str, device: str = "cpu", threads: int = 1) -> Backend:
    """The backend ``name`` (resolved first: ``"xla"`` becomes a route) on ``device``."""
    name = resolve_backend_name(name)
    if name == "eager":
        from .torch_based import EagerBackend

        return EagerBackend(device)
    if name == "xla:torchax":
        from .torchax_route import TorchaxBackend

        return TorchaxBackend(device, threads)
    if name == "xla:torch_xla":
        from .torch_xla import XlaBackend

        return XlaBackend(device, threads)
    if name == "inductor":
        from .torch_based import InductorBackend

        return InductorBackend(device)
    from ..sim import SimBackend

    return SimBackend(device)
