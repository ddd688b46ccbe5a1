"""Device backends: how a decoded graph runs on this executor's device.

A backend turns a ``torch.fx.GraphModule`` into something callable on local
tensors. ``eager`` runs the graph op by op (bit-for-bit with eager PyTorch).
"""

from __future__ import annotations

from typing import Protocol, Sequence

__all__ = ["Backend", "EagerBackend", "make_backend"]


class Backend(Protocol):
    name: str
    device: str

    def load(self, graph_module):
        """Prepare ``graph_module``; return a callable taking and returning local tensors."""

    def run(self, compiled, inputs: Sequence) -> list:
        """Run a prepared function; return its outputs as CPU-reachable tensors."""


class EagerBackend:
    name = "eager"

    def __init__(self, device: str = "cpu"):
        self.device = device

    def load(self, graph_module):
        return graph_module

    def run(self, compiled, inputs):
        out = compiled(*inputs)
        return list(out) if isinstance(out, (list, tuple)) else [out]


def make_backend(name: str, device: str = "cpu") -> Backend:
    if name == "eager":
        return EagerBackend(device)
    raise ValueError(f"backend: expected 'eager', got {name!r}")
