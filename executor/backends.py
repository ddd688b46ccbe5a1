"""Device backends: how a decoded graph is compiled and run on this executor's device.

``compile(graph_module, example_inputs)`` returns a callable on device tensors
(called once per graph and input signature, possibly on the compile thread);
``run`` calls it and leaves the outputs on the device, where the object store
keeps them; ``to_device`` brings an arriving host tensor there.

- ``eager``: no compile; runs the aten graph op by op (bit-for-bit with eager PyTorch).
- ``xla``: torch_xla on PJRT (CPU here; ``PJRT_DEVICE=TPU`` on a TPU host). The graph
  is traced lazily and XLA compiles each distinct graph + shapes once; ``compile``
  runs it once on zeros so that compile happens off the compute thread.
- ``inductor``: ``torch._inductor.compile`` of the aten graph (for CUDA hosts, where
  torch_xla has no GPU support; on CPU it works but compiles slowly).
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Protocol, Sequence

from pathways_torch.wire import pb
from pathways_torch.wire.graph_schema import decode_graph
from pathways_torch.wire.tensors import frame_to_tensor, tensor_to_frame

__all__ = ["Backend", "TorchBackend", "EagerBackend", "XlaBackend", "InductorBackend", "make_backend",
           "BACKEND_NAMES"]

log = logging.getLogger(__name__)

BACKEND_NAMES = ("eager", "xla", "inductor", "sim")


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

    def to_device(self, tensor):
        """Move a host tensor that arrived over the wire to this backend's device."""

    def num_compiles(self) -> int:
        """How many graphs this backend compiled so far."""


class TorchBackend:
    """What every torch-based backend shares: graphs decoded from the schema, tensors from frames."""

    device = "cpu"

    def prepare(self, load, payload):
        import torch

        graph_module = decode_graph(load.graph, payload, device=self.device)
        examples = [torch.empty(tuple(m.shape), dtype=getattr(torch, m.dtype), device="meta")
                    for m in load.graph.inputs]
        return graph_module, examples

    def from_frame(self, meta, frames):
        return self.to_device(frame_to_tensor(meta, frames))

    def to_frame(self, value, meta, frame_index):
        return tensor_to_frame(value, meta, frame_index)

    def digest(self, value) -> bytes:
        import torch

        data = value.detach().cpu().contiguous()
        view = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b""
        return hashlib.blake2b(view, digest_size=16).digest() + str(tuple(data.shape)).encode()

    def _use_device(self, device: str) -> None:
        import torch

        self._device = torch.device(device)
        self.device = str(self._device)

    def run(self, compiled, inputs):
        return _as_list(compiled(*inputs))

    def to_device(self, tensor):
        return tensor if tensor.device == self._device else tensor.to(self._device)


class EagerBackend(TorchBackend):
    """Op by op, as eager PyTorch runs it."""

    name = "eager"
    compiles_in_background = False

    def __init__(self, device: str = "cpu"):
        self._use_device(device)

    def compile(self, graph_module, example_inputs):
        from pathways_torch.wire.collective_ops import call_runtime_directly

        return call_runtime_directly(graph_module.to(self._device)).forward

    def num_compiles(self) -> int:
        return 0


class XlaBackend(TorchBackend):
    """torch_xla's lazy tensors on PJRT; the only place that imports torch_xla.

    Each thread syncs only the tensors it produced (``_xla_sync_multi``), so a
    background compile never materialises the compute thread's pending work.
    """

    name = "xla"
    compiles_in_background = True

    def __init__(self, device: str = "cpu", threads: int = 1):
        # TPU hosts set PJRT_DEVICE=TPU themselves; everywhere else this is the CPU client.
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        # ``threads`` is not honoured: XLA's CPU runtime runs its kernels on its own thread
        # pool, whatever torch.set_num_threads says (measured 1.8 CPU-seconds per second on
        # 2 cores; --xla_cpu_multi_thread_eigen=false did not change it). See docs/backends.md.
        self.threads = threads
        import torch_xla
        import torch_xla.debug.metrics as metrics

        self._xla, self._metrics = torch_xla, metrics
        self._device = torch_xla.device()
        self.device = str(self._device)

    def compile(self, graph_module, example_inputs):
        import torch

        module = graph_module.to(self._device)
        # Device data, as real inputs will be: zeros made on the XLA device would be graph
        # constants and give a different graph (and a second compile).
        zeros = [torch.zeros(t.shape, dtype=t.dtype).to(self._device) for t in example_inputs]
        module = _sync_before_collectives(module, self._sync)
        # The warm-up run: XLA compiles here and caches the executable.
        fallbacks = self._fallbacks_of(module, zeros)
        decomposed = self._decomposed(module, zeros, fallbacks) if fallbacks else None
        if decomposed is not None:
            module = _sync_before_collectives(decomposed, self._sync)
            fallbacks = self._fallbacks_of(module, zeros)
        if fallbacks:
            # torch_xla ran these aten ops on the host: correct, but slow. Say so.
            log.warning("xla: ops executed by CPU fallback, not XLA: %s", ", ".join(sorted(fallbacks)))
        return module

    def _fallbacks_of(self, module, zeros) -> set[str]:
        """Run ``module`` once lazily and return the aten ops torch_xla ran on the host meanwhile."""
        before = self._fallback_counts()
        self._sync(_as_list(module(*zeros)))
        after = self._fallback_counts()
        return {op for op, count in after.items() if count > before.get(op, 0)}

    def _fallback_counts(self) -> dict[str, int]:
        return {op: self._metrics.counter_value(op) or 0 for op in self._metrics.executed_fallback_ops()}

    def _decomposed(self, module, zeros, ops: set[str]):
        """Re-trace ``module`` with torch's decompositions of the ops torch_xla lacks (e.g. LayerNorm's backward);
        None when none of them has one.

        The re-trace runs on fake tensors (a re-trace on real lazy XLA tensors computed
        wrong values); ops without a decomposition stay as they are. The inserted syncs
        skip fake tensors, so the new graph has none: the caller inserts them again.
        """
        import torch
        from torch._decomp import get_decompositions
        from torch.fx.experimental.proxy_tensor import make_fx

        packets = [getattr(torch.ops.aten, op.split("::", 1)[1], None) for op in ops if op.startswith("aten::")]
        table = get_decompositions([p for p in packets if p is not None])
        if not table:
            return None
        return make_fx(module, decomposition_table=table, tracing_mode="fake")(*zeros)

    def run(self, compiled, inputs):
        outputs = _as_list(compiled(*inputs))
        self._sync(outputs)
        return outputs

    def to_device(self, tensor):
        return tensor.to(self._device)

    def num_compiles(self) -> int:
        data = self._metrics.metric_data("CompileTime")
        return int(data[0]) if data else 0

    def _sync(self, tensors) -> None:
        self._xla._XLAC._xla_sync_multi(list(tensors), [], wait=True)


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


def _sync_before_collectives(graph_module, sync):
    """Materialise every live lazy value in one execution before each collective.

    A collective's XLA kernel moves its input to the host, which executes only the
    graph *that tensor* needs. Values computed alongside it (the other gradient
    buckets, the loss, new buffers) stay pending and their next use re-executes the
    shared forward and backward. Syncing all values still live at the cut computes
    the segment once.
    """
    import torch
    from torch._subclasses.fake_tensor import is_fake

    nodes = list(graph_module.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    last_use = {node: max((position[u] for u in node.users), default=-1) for node in nodes}
    cuts = [n for n in nodes if n.op == "call_function" and getattr(n.target, "namespace", "") == "pathways"]
    if not cuts:
        return graph_module

    def sync_tensors(values):
        # Fake tensors come through when the graph is re-traced (see XlaBackend._decomposed).
        tensors = [v for v in values if isinstance(v, torch.Tensor) and not is_fake(v)]
        if tensors:
            sync(tensors)

    for cut in cuts:
        live = [n for n in nodes[:position[cut]] if n.op == "call_function" and last_use[n] >= position[cut]]
        with graph_module.graph.inserting_before(cut):
            graph_module.graph.call_function(sync_tensors, (live,))
    graph_module.recompile()
    return graph_module


def _as_list(out) -> list:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def make_backend(name: str, device: str = "cpu", threads: int = 1) -> Backend:
    if name == "eager":
        return EagerBackend(device)
    if name == "xla":
        return XlaBackend(device, threads)
    if name == "inductor":
        return InductorBackend(device)
    if name == "sim":
        from .sim import SimBackend

        return SimBackend(device)
    raise ValueError(f"backend: expected one of {BACKEND_NAMES}, got {name!r}")
