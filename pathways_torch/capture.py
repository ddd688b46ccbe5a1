"""Capture a per-shard function with torch.fx for one input signature.

The function is traced by ``make_fx`` on fake tensors of the *local block*
shapes, so nothing runs and nothing is allocated; the output shapes and dtypes
come from the fake tensors. The aten graph is then encoded in the wire schema.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Sequence

from .attention import portable_attention
from .errors import CaptureError
from .graph_cut import CAPTURE_LOCK as _CAPTURE_LOCK
from .user_code import library_dirs
from .wire import pb
from .wire.graph_schema import GraphSchemaError, encode_graph
from .wire.tensors import dtype_name

__all__ = ["CapturedVersion", "InputSpec", "capture", "DECOMPOSITIONS", "decompositions"]

DECOMPOSITIONS: dict = {}
"""Op → the function a captured graph runs in its place. Ops that exist only while a step is written (the
tensor-parallel moves, whose gradient rules must reach the pipeline's own autograd) add theirs here when
defined; the executors never see them, only the ``pathways::`` collectives and aten ops they become."""


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """What the trace sees of one array argument: its local block shape and dtype."""

    shape: tuple[int, ...]
    dtype: object

    def __str__(self) -> str:
        return f"{dtype_name(self.dtype)}{['?' if d is None else d for d in self.shape]}"


@dataclasses.dataclass
class CapturedVersion:
    """One traced version of a function: its graph, wire form and output metadata."""

    name: str
    inputs: tuple[InputSpec, ...]
    graph_module: object
    graph: pb.Graph
    constants: list
    outputs: tuple[InputSpec, ...]
    single_output: bool
    collective_axes: tuple[str, ...] = ()   # mesh axes its collectives communicate over
    sim_seconds: float = 0.0                # device time on a simulated executor
    # The same trace again, with each node's stack trace (costs ~0.7 ms a node: only on the error path).
    retrace: Callable | None = dataclasses.field(default=None, repr=False, compare=False)

    def user_line(self, node_index: int) -> str:
        """``file, line N, in F: code`` of the user's code that made the ``node_index``-th call (1-based)."""
        if self.retrace is None or node_index < 1:
            return ""
        try:
            with _CAPTURE_LOCK:
                graph_module = self.retrace()
        except Exception:
            return ""
        calls = [n for n in graph_module.graph.nodes if n.op == "call_function"]
        if node_index > len(calls):
            return ""
        return _innermost_user_frame(calls[node_index - 1].meta.get("stack_trace") or "")

    @property
    def data_dependent(self) -> bool:
        """Whether an output's shape depends on the data: callers learn it only after the run."""
        return any(d is None for spec in self.outputs for d in spec.shape)

    def describe(self) -> str:
        ins = ", ".join(map(str, self.inputs))
        outs = ", ".join(map(str, self.outputs))
        return f"{self.name}({ins}) -> ({outs})"


def capture(fn: Callable, name: str, inputs: Sequence[InputSpec], rebuild: Callable,
            graph_pass: Callable | None = None) -> CapturedVersion:
    """Trace ``fn``; ``rebuild(tensors)`` turns the traced tensors into ``fn``'s (args, kwargs); ``graph_pass``
    (graph module → graph module) rewrites the trace before it is encoded (a sharded step's unit schedule).
    Thread-safe: one capture at a time in a process."""
    with _CAPTURE_LOCK:
        return _capture(fn, name, inputs, rebuild, graph_pass or (lambda graph_module: graph_module))


def _capture(fn: Callable, name: str, inputs: Sequence[InputSpec], rebuild: Callable,
             graph_pass: Callable) -> CapturedVersion:
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    shown = ", ".join(map(str, inputs))

    def flat(*tensors):
        args, kwargs = rebuild(tensors)
        with portable_attention():   # ecosystem SDPA options in forms every backend carries
            return fn(*args, **kwargs)

    data_dependent = False
    try:
        graph_module = _trace(flat, inputs, data_dependent_sizes=False)
    except DynamicOutputShapeException:
        # An op whose output size depends on the data (nonzero, a boolean mask, unique):
        # trace again with a shape environment, where that size is a symbol.
        graph_module = _trace_data_dependent(flat, inputs, name, shown)
        data_dependent = True
    except Exception as exc:
        raise _capture_error(exc, name, shown) from exc
    graph_module = graph_pass(graph_module)
    single, outputs = _output_specs(graph_module, name)
    try:
        graph, constants = encode_graph(graph_module)
    except GraphSchemaError as exc:
        raise CaptureError(f"function {name!r}: {exc}") from exc
    return CapturedVersion(name, tuple(inputs), graph_module, graph, constants, outputs, single,
                           _collective_axes(graph_module),
                           retrace=_retracer(flat, inputs, data_dependent, graph_pass))


def _retracer(flat, inputs, data_dependent: bool, graph_pass: Callable) -> Callable:
    """The same trace with stack traces, later: under the mesh axes this capture ran under (collectives)."""
    from .collectives import _MESH_AXES, tracing_mesh

    axes = _MESH_AXES.get()

    def retrace():
        with tracing_mesh(axes) if axes else contextlib.nullcontext():
            # The same pass: node numbers must match the graph the executors ran.
            return graph_pass(_trace(flat, inputs, data_dependent_sizes=data_dependent, record_stack_traces=True))

    return retrace


def _trace(flat, inputs, *, data_dependent_sizes: bool, record_stack_traces: bool = False):
    """``make_fx`` on fake tensors of the static input shapes; sizes decided by data become symbols
    only when ``data_dependent_sizes`` (a shape environment costs tracing time and is rarely needed)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv() if data_dependent_sizes else None
    with FakeTensorMode(shape_env=shape_env, static_shapes=True):
        fakes = [torch.empty(spec.shape, dtype=spec.dtype) for spec in inputs]
    if not record_stack_traces:
        return make_fx(flat, tracing_mode="fake", decomposition_table=decompositions())(*fakes)
    # make_fx keeps only the frames of modules' forward methods; a plain function's own lines matter too.
    from unittest import mock

    from torch.fx.experimental import proxy_tensor

    with mock.patch.object(proxy_tensor.PythonKeyTracer, "_filter_traceback_frames", lambda self, summary: summary):
        return make_fx(flat, tracing_mode="fake", record_stack_traces=True,
                       decomposition_table=decompositions())(*fakes)


_DEFAULT_TABLE: dict | None = None


def decompositions() -> dict:
    """`DECOMPOSITIONS` on top of what ``make_fx`` decomposes when given no table: some torch versions then record
    ``detach`` as an alias, and a table of ours must not change the graphs of functions that use none of its ops."""
    global _DEFAULT_TABLE
    if _DEFAULT_TABLE is None:
        import torch
        from torch.fx.experimental.proxy_tensor import make_fx

        probe = make_fx(lambda x: x.detach())(torch.empty(1))
        aliased = any(n.target is torch.ops.aten.alias.default for n in probe.graph.nodes)
        _DEFAULT_TABLE = {torch.ops.aten.detach.default: lambda x: torch.ops.aten.alias.default(x)} if aliased else {}
    return {**_DEFAULT_TABLE, **DECOMPOSITIONS}


def _innermost_user_frame(stack_trace: str) -> str:
    """The last ``File "...", line N, in F`` of a node's stack trace in the user's code (`user_code`)."""
    import os

    library = library_dirs()
    lines = stack_trace.splitlines()
    found = ""
    for index, line in enumerate(lines):
        stripped = line.strip()
        if not stripped.startswith('File "'):
            continue
        path = stripped[len('File "'):stripped.index('"', len('File "'))]
        if os.path.abspath(path).startswith(library):
            continue
        following = lines[index + 1].strip() if index + 1 < len(lines) else ""
        code = "" if following.startswith('File "') else following
        found = stripped.removeprefix("File ") + (f": {code}" if code else "")
    return found


def _trace_data_dependent(flat, inputs, name, shown):
    """The trace with data-dependent sizes as symbols; refused if the function uses one as a number."""
    try:
        graph_module = _trace(flat, inputs, data_dependent_sizes=True)
    except Exception as exc:
        raise _capture_error(exc, name, shown) from exc
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and "sym_size" in str(node.target):
            raise CaptureError(
                f"function {name!r} uses a size that depends on the data as a number ({node.name}: {node.target}); "
                f"fix: keep data-dependent sizes inside tensors (e.g. count with .sum() of a mask instead of "
                f"len() of the masked tensor), or return the masked tensor and continue in another function")
    return graph_module


# What the usual capture failures mean, by the aten op they stop at: the fix a user can act on.
_FIXES = {
    "_local_scalar_dense": "a tensor's value is read as a Python number or truth value (float(t), t.item(), "
                           "if t > 0:, int(t)); a captured function must not depend on tensor values: keep it "
                           "a tensor (torch.where(cond, a, b) for a branch, clamp/min/max for a bound)",
    "nonzero": "a size depends on the data (nonzero, a boolean mask, unique); keep the size fixed (multiply by "
               "the mask instead of selecting) or compute it in a function of its own",
}


def _capture_error(exc: BaseException, name: str, shown: str) -> CaptureError:
    message = _first_line(exc)
    fix = next((text for op, text in _FIXES.items() if op in message), None)
    fix = fix or ("call it with inputs whose local blocks have shapes it accepts; control flow that depends on "
                  "tensor values cannot be captured")
    return CaptureError(
        f"function {name!r} cannot be captured for local block shapes ({shown}): "
        f"{type(exc).__name__}: {message}\nfix: {fix}")


def _collective_axes(graph_module) -> tuple[str, ...]:
    axes = []
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", "") == "pathways":
            if node.args[1] not in axes:
                axes.append(node.args[1])
    return tuple(axes)


def _output_specs(graph_module, name: str) -> tuple[bool, tuple[InputSpec, ...]]:
    import torch

    output = next(n for n in graph_module.graph.nodes if n.op == "output")
    value = output.args[0]
    single = not isinstance(value, (list, tuple))
    nodes = [value] if single else list(value)
    specs = []
    for index, node in enumerate(nodes):
        fake = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(fake, torch.Tensor):
            raise CaptureError(f"function {name!r}: output {index} is {node!r}, expected a tensor; "
                               f"return tensors (or a tuple of tensors) only")
        # None: a size the data decides (known once the function has run)
        specs.append(InputSpec(tuple(d if isinstance(d, int) else None for d in fake.shape), fake.dtype))
    if not specs:
        raise CaptureError(f"function {name!r} returns nothing; return at least one tensor")
    return single, tuple(specs)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
