"""Device backends: how a decoded graph runs on this executor's device.

A backend turns a ``torch.fx.GraphModule`` into something callable on local
tensors. ``eager`` runs the graph op by op (bit-for-bit with eager PyTorch);
``xla`` runs it through torch_xla on PJRT (CPU here, TPU by ``PJRT_DEVICE``):
XLA compiles each distinct graph + shapes once and caches it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

__all__ = ["Backend", "EagerBackend", "XlaBackend", "make_backend"]


class Backend(Protocol):
    name: str
    device: str

    def load(self, graph_module):
        """Prepare ``graph_module``; return a callable taking and returning local tensors."""

    def run(self, compiled, inputs: Sequence) -> list:
        """Run a prepared function; return its outputs as CPU-reachable tensors."""

    def num_compiles(self) -> int:
        """How many times this backend compiled a graph so far."""


class EagerBackend:
    name = "eager"

    def __init__(self, device: str = "cpu"):
        self.device = device

    def load(self, graph_module):
        return graph_module

    def run(self, compiled, inputs):
        return _as_list(compiled(*inputs))

    def num_compiles(self) -> int:
        return 0


class XlaBackend:
    """Runs graphs on the torch_xla device; the only place that imports torch_xla.

    Inputs are copied to the XLA device, the graph is traced lazily and
    ``torch_xla.sync()`` compiles (once per graph and shape, cached by XLA) and
    runs it; outputs are brought back to the host for the object store.
    """

    name = "xla"

    def __init__(self, device: str = "cpu"):
        import os

        # TPU hosts set PJRT_DEVICE=TPU themselves; everything else here is the CPU client.
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        import torch_xla
        import torch_xla.debug.metrics as metrics

        self._torch_xla, self._metrics = torch_xla, metrics
        self._device = torch_xla.device()
        self.device = str(self._device)

    def load(self, graph_module):
        return graph_module.to(self._device)

    def run(self, compiled, inputs):
        outputs = _as_list(compiled(*[t.to(self._device) for t in inputs]))
        self._torch_xla.sync()
        return [t.cpu() for t in outputs]

    def on_device(self, compiled, inputs) -> list:
        """Like `run` but leaves outputs on the XLA device (tests check no silent fallback)."""
        outputs = _as_list(compiled(*[t.to(self._device) for t in inputs]))
        self._torch_xla.sync()
        return outputs

    def num_compiles(self) -> int:
        data = self._metrics.metric_data("CompileTime")
        return int(data[0]) if data else 0


def _as_list(out) -> list:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def make_backend(name: str, device: str = "cpu") -> Backend:
    if name == "eager":
        return EagerBackend(device)
    if name == "xla":
        return XlaBackend(device)
    raise ValueError(f"backend: expected 'eager' or 'xla', got {name!r}")
