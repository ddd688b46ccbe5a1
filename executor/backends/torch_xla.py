"""The ``xla:torch_xla`` route: torch_xla 2.9's lazy tensors on PJRT; the only place that imports torch_xla.

torch_xla's last release pins torch 2.9.0 and Python 3.11 (``pip install
'pathways-torch[torch-xla]'``); the default route is ``xla:torchax`` (docs/backends.md).
"""

from __future__ import annotations

import logging
import os

from .graph_stages import is_collective
from .torch_based import TorchBackend, as_list

__all__ = ["XlaBackend"]

log = logging.getLogger(__name__)


class XlaBackend(TorchBackend):
    """torch_xla's lazy tensors on PJRT; the only place that imports torch_xla.

    Each thread syncs only the tensors it produced (``_xla_sync_multi``), so a
    background compile never materialises the compute thread's pending work.
    """

    name = "xla:torch_xla"
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
        self._counts: dict[str, int] = {}

    def prepare(self, load, payload):
        graph_module, examples = super().prepare(load, payload)
        graph_module.meta["pathways_function"] = load.name    # for the per-function counts
        return graph_module, examples

    def counters(self) -> dict[str, int]:
        return dict(self._counts)

    def compile(self, graph_module, example_inputs):
        import torch

        name = graph_module.meta.get("pathways_function", "?")
        module = _with_our_attention(graph_module, example_inputs, self._device).to(self._device)
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
            log.warning("xla:torch_xla: function %s: ops executed by CPU fallback, not XLA: %s", name,
                        ", ".join(sorted(fallbacks)))
        self._counts[f"fallback_ops:{name}"] = len(fallbacks)
        self._counts[f"collective_cuts:{name}"] = sum(1 for n in graph_module.graph.nodes if is_collective(n))
        return module

    def _fallbacks_of(self, module, zeros) -> set[str]:
        """Run ``module`` once lazily and return the aten ops torch_xla ran on the host meanwhile.

        A warm-up on zeros: its collectives are dry runs (they communicate nothing)."""
        from ..collectives import dry_runs

        before = self._fallback_counts()
        with dry_runs():
            self._sync(as_list(module(*zeros)))
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
        outputs = as_list(compiled(*inputs))
        self._sync(outputs)
        return outputs

    def to_device(self, tensor):
        return tensor.to(self._device)

    def num_compiles(self) -> int:
        data = self._metrics.metric_data("CompileTime")
        return int(data[0]) if data else 0

    def _sync(self, tensors) -> None:
        self._xla._XLAC._xla_sync_multi(list(tensors), [], wait=True)


def _with_our_attention(graph_module, example_inputs, device):
    """The graph with CPU flash attention in plain ops (executor/backends/attention.py), re-traced if it has any."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from .attention import flash_attention_decompositions

    table = flash_attention_decompositions()
    if not any(n.op == "call_function" and n.target in table for n in graph_module.graph.nodes):
        return graph_module
    import torch

    examples = [torch.empty(t.shape, dtype=t.dtype) for t in example_inputs]
    traced = make_fx(graph_module, decomposition_table=table, tracing_mode="fake")(*examples)
    for node in traced.graph.nodes:   # the re-trace ran on CPU: its new constructors run on the device
        if "device" in node.kwargs:
            node.kwargs = {**node.kwargs, "device": device}
    traced.recompile()
    return traced


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
    cuts = [n for n in nodes if is_collective(n)]
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


