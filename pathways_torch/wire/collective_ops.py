"""The ``pathways::`` collective ops: part of the graph schema, defined once for client and executor.

Inside a ``@pw.function`` a collective traces as one opaque node
(``pathways.all_reduce.default`` …) whose fake implementation gives the output
shape, so the client needs no process group. On an executor the same op runs
through a *runtime* the executor installs (``set_runtime``): it binds each mesh
axis to a real ``torch.distributed`` group. Kernels exist for CPU tensors and for
XLA tensors; on XLA the kernel brings the tensor to the host, which ends the lazy
XLA graph there — the XLA-compiled code is cut at every collective.

Importing this module imports torch (it registers ops); the wire package itself does not.
"""

from __future__ import annotations

import torch

__all__ = ["OPS", "REDUCE_OPS", "set_runtime", "all_reduce", "all_gather", "reduce_scatter", "call_runtime_directly",
           "Ready"]

REDUCE_OPS = ("sum", "mean", "max")
OPS = ("all_reduce", "all_gather", "reduce_scatter")


class _NoRuntime:
    def run(self, name, x, axis, **kwargs):
        from pathways_torch.errors import PathwaysError

        raise PathwaysError(f"pw.{name} runs only inside a @pw.function on executors; "
                            f"call it from a function you run on a mesh")


_runtime = _NoRuntime()


def set_runtime(runtime) -> None:
    """Install the object whose ``run(name, x, axis, **kwargs)`` performs collectives (executors only)."""
    global _runtime
    _runtime = runtime


@torch.library.custom_op("pathways::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, axis: str, op: str) -> torch.Tensor:
    return _runtime.run("all_reduce", x, axis, op=op)


@all_reduce.register_fake
def _(x, axis, op):
    return torch.empty_like(x)


@torch.library.custom_op("pathways::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, axis: str, size: int, dim: int) -> torch.Tensor:
    return _runtime.run("all_gather", x, axis, size=size, dim=dim)


@all_gather.register_fake
def _(x, axis, size, dim):
    shape = list(x.shape)
    shape[dim] *= size
    return x.new_empty(shape)


@torch.library.custom_op("pathways::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, axis: str, size: int, op: str, dim: int) -> torch.Tensor:
    return _runtime.run("reduce_scatter", x, axis, size=size, op=op, dim=dim)


@reduce_scatter.register_fake
def _(x, axis, size, op, dim):
    shape = list(x.shape)
    shape[dim] //= size
    return x.new_empty(shape)


def _direct_all_reduce(x, axis, op):
    return _runtime.run("all_reduce", x, axis, op=op)


def _direct_all_gather(x, axis, size, dim):
    return _runtime.run("all_gather", x, axis, size=size, dim=dim)


def _direct_reduce_scatter(x, axis, size, op, dim):
    return _runtime.run("reduce_scatter", x, axis, size=size, op=op, dim=dim)


_DIRECT = {torch.ops.pathways.all_reduce.default: _direct_all_reduce,
           torch.ops.pathways.all_gather.default: _direct_all_gather,
           torch.ops.pathways.reduce_scatter.default: _direct_reduce_scatter}


class Ready:
    """A gather issued ahead that is already done: what a runtime without `start` gives (computed at once), and a
    dry run's zeros."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def _direct_all_gather_start(x, axis, size, dim):
    start = getattr(_runtime, "start", None)
    if start is None:
        return Ready(_runtime.run("all_gather", x, axis, size=size, dim=dim))
    return start("all_gather", x, axis, size=size, dim=dim)


def _direct_wait(pending):
    return pending.result()


def call_runtime_directly(graph_module, issue_gathers_ahead: bool = False):
    """Make an eager graph's collective nodes call the runtime as plain Python functions.

    Through the dispatcher, a custom op costs some 40 µs of Python per call (autograd
    wrapper, redispatch, dynamo guard) — most of a scalar all-reduce's cost here.
    Only for graphs run op by op on the host or CUDA: compilers (XLA, inductor) need
    the op itself. Returns the same module, recompiled if a node changed.

    ``issue_gathers_ahead``: an all-gather of a graph input that other ops separate from its first reader (a
    sharded step's prefetch, `pathways_torch.training.unit_schedule`) is issued where it stands and waited for
    just before that reader, so that the ops between overlap it.
    """
    changed = False
    for node in list(graph_module.graph.nodes):
        if node.op == "call_function" and node.target in _DIRECT:
            node.target, changed = _DIRECT[node.target], True
            if issue_gathers_ahead and node.target is _direct_all_gather:
                _issue_ahead(graph_module.graph, node)
    if changed:
        graph_module.recompile()
    return graph_module


def _issue_ahead(graph, gather) -> None:
    if gather.args[0].op != "placeholder" or not gather.users:
        return
    order = {node: i for i, node in enumerate(graph.nodes)}
    first = min(gather.users, key=order.__getitem__)
    if first is gather.next:
        return      # nothing to overlap
    gather.target = _direct_all_gather_start
    with graph.inserting_before(first):
        wait = graph.call_function(_direct_wait, (gather,))
    gather.replace_all_uses_with(wait, delete_user_cb=lambda user: user is not wait)


def _on_host(name):
    """An XLA kernel: run the collective on a host copy and return to the device (the cut)."""

    def kernel(x, *args):
        result = getattr(torch.ops.pathways, name).default(x.cpu(), *args)
        return result.to(x.device)

    return kernel


for _name in OPS:
    torch.library.register_kernel(f"pathways::{_name}", "xla", _on_host(_name))
