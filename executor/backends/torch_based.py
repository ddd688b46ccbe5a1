"""What the torch-based backends share, and the two that run torch code as it is: eager and inductor."""

from __future__ import annotations

import hashlib

from pathways_torch.wire.graph_schema import decode_graph
from pathways_torch.wire.tensors import frame_to_tensor, tensor_to_frame

__all__ = ["TorchBackend", "EagerBackend", "InductorBackend", "as_list", "meta_examples", "bytes_digest"]


def bytes_digest(data, shape) -> bytes:
    """Debug mode's digest of a value: a hash of its bytes (a uint8 buffer) and its shape; one form for
    every backend."""
    return hashlib.blake2b(data, digest_size=16).digest() + str(tuple(shape)).encode()


def meta_examples(load):
    """The traced input signature of a received function as meta tensors (no memory)."""
    import torch

    return [torch.empty(tuple(m.shape), dtype=getattr(torch, m.dtype), device="meta") for m in load.graph.inputs]


class TorchBackend:
    """What every torch-based backend shares: graphs decoded from the schema, tensors from frames."""

    device = "cpu"

    def prepare(self, load, payload):
        return decode_graph(load.graph, payload, device=self.device), meta_examples(load)

    def from_frame(self, meta, frames):
        tensor = frame_to_tensor(meta, frames)
        if tensor.data_ptr() % _ALIGNMENT:
            # A frame's bytes sit where the message put them; torch's allocator aligns to 64 bytes, and some CPU
            # kernels sum in another order on an unaligned input (measured: a float64 step differed by one ulp
            # after a state put from a checkpoint). One copy keeps every input as the computation's own outputs.
            tensor = tensor.clone()
        return self.to_device(tensor)

    def to_frame(self, value, meta, frame_index):
        return tensor_to_frame(value, meta, frame_index)

    def digest(self, value) -> bytes:
        import torch

        data = value.detach().cpu().contiguous()
        view = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b""
        return bytes_digest(view, data.shape)

    def _use_device(self, device: str) -> None:
        import torch

        self._device = torch.device(device)
        self.device = str(self._device)

    boxed = False   # compiled(inputs) takes the list and clears it (executor/backends/boxed.py)
    mutable_values = True   # an in-place op writes the input itself (executor/backends/mutated_inputs.py)

    def run(self, compiled, inputs):
        return [_stored(out) for out in as_list(compiled(inputs) if self.boxed else compiled(*inputs))]

    def copy_value(self, value):
        """A stored value's own copy (an input a computation would write but does not hold alone)."""
        return value.clone()

    def to_device(self, tensor):
        return tensor if tensor.device == self._device else tensor.to(self._device)

    def counters(self) -> dict[str, int]:
        return {}


class EagerBackend(TorchBackend):
    """Op by op, as eager PyTorch runs it."""

    name = "eager"
    compiles_in_background = False
    boxed = True

    def __init__(self, device: str = "cpu"):
        self._use_device(device)

    def compile(self, graph_module, example_inputs):
        from pathways_torch.wire.collective_ops import call_runtime_directly

        from .boxed import boxed

        return boxed(call_runtime_directly(graph_module.to(self._device), issue_gathers_ahead=True)).forward

    def num_compiles(self) -> int:
        return 0


class InductorBackend(TorchBackend):
    """``torch._inductor.compile`` on the captured aten graph."""

    name = "inductor"
    compiles_in_background = True

    def __init__(self, device: str = "cpu"):
        self._use_device(device)
        self._compiles = 0

    def compile(self, graph_module, example_inputs):
        import torch
        import torch._inductor

        module = graph_module.to(self._device)
        examples = [torch.zeros(t.shape, dtype=t.dtype, device=self._device) for t in example_inputs]
        compiled = torch._inductor.compile(module, examples)
        self._compiles += 1
        return compiled

    def num_compiles(self) -> int:
        return self._compiles


def _stored(out):
    """An output as the store keeps it: dense (a view's strides would travel to the wire and the signature
    check), and owning its memory: a small view of a big intermediate (a loss sliced out of a packed gradient)
    would keep all of it alive as long as the output lives."""
    out = out.contiguous()
    if out.untyped_storage().nbytes() > 2 * out.nbytes + 4096:
        return out.clone()
    return out


def as_list(out) -> list:
    return list(out) if isinstance(out, (list, tuple)) else [out]


_ALIGNMENT = 64
