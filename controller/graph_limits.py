"""Bounds on what a client registers with a shared controller: its programs' nodes, its graphs' bytes, its costs.

A remote client's program is lowered on the controller (seconds for a large one on many executors) and its graphs
run on executors every tenant shares. So `pathways-controller` refuses, before anything is lowered or sent:

- a program of more than ``ServiceConfig.max_program_nodes`` nodes (`check_program`);
- a function whose graph constants plus the tensors its creation ops make (``aten.zeros``, ``full``, ``arange``,
  ``rand``… computed from their shape arguments) come to more than ``ServiceConfig.max_graph_bytes``, or that has
  one creation op of an absurd shape (a negative or non-finite size) (`check_graph`);
- a simulated time per run that is not 0 (none) or within `COST_SECONDS` (`check_sim_seconds`): it is the
  scheduler's estimate of the function's calls too.

Each refusal is a ValueError that names what came, the bound, and what to do. A creation op whose size is not a
literal (a size computed in the graph) is not counted here: the executor's own checks still apply to it. Elements
of a dtype the graph does not name count 8 bytes (the widest common one), so the estimate errs on the high side.

Stdlib only: the controller never touches tensors.
"""

from __future__ import annotations

import math

from pathways_torch.wire import pb
from pathways_torch.wire.limits import COST_SECONDS, bounded
from pathways_torch.wire.seam import ProgramSpec

from .config import ServiceConfig

__all__ = ["check_program", "check_graph", "check_sim_seconds", "graph_bytes", "CREATION_OPS"]

# Ops that make a tensor from sizes in their arguments (the *_like ones take an input's size: bounded by it).
_SIZED = frozenset(["aten.zeros", "aten.ones", "aten.empty", "aten.full", "aten.rand", "aten.randn", "aten.randint",
                    "aten.empty_strided", "aten.empty_permuted", "aten._efficientzerotensor", "aten.new_empty",
                    "aten.new_full", "aten.new_ones", "aten.new_zeros", "aten.new_empty_strided"])
_COUNTED = frozenset(["aten.arange", "aten.eye", "aten.linspace", "aten.logspace", "aten.randperm",
                      "aten.scalar_tensor"])
CREATION_OPS = _SIZED | _COUNTED

_ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int16": 2, "uint16": 2,
             "float16": 2, "half": 2, "bfloat16": 2, "int32": 4, "uint32": 4, "float32": 4, "float": 4,
             "complex32": 4, "int64": 8, "uint64": 8, "long": 8, "float64": 8, "double": 8, "complex64": 8,
             "complex128": 16}
_UNNAMED_ITEMSIZE = 8

_GRAPH_FIX = ("make the tensor smaller, pass it in as an input array (ctx.put) rather than building it in the "
              "function, or ask the controller's operator to raise --max-graph-bytes")


def check_sim_seconds(name: str, sim_seconds) -> float:
    """A function's simulated seconds per run: 0 (none: not simulated, no estimate) or within `COST_SECONDS`."""
    if not isinstance(sim_seconds, bool) and isinstance(sim_seconds, (int, float)) and sim_seconds == 0:
        return 0.0
    return bounded(sim_seconds, f"function {name!r}: sim_time_s", COST_SECONDS,
                   "give the seconds one run takes on a simulated executor, or 0 for none")


def check_program(spec: ProgramSpec, config: ServiceConfig) -> None:
    """Refuse a program of more nodes than ``config.max_program_nodes``."""
    nodes = len(spec.nodes)
    if nodes > config.max_program_nodes:
        raise ValueError(f"program {spec.name!r}: {nodes} nodes; a program may have at most "
                         f"{config.max_program_nodes} (--max-program-nodes). Fix: split it into smaller programs "
                         f"(several @pw.program steps), or ask the controller's operator to raise --max-program-nodes")


def check_graph(graph: pb.Graph, constants: list, config: ServiceConfig, name: str = "") -> int:
    """Refuse a graph whose constants plus creation-op outputs pass ``config.max_graph_bytes``, or with a creation op
    of an absurd shape; returns the bytes counted."""
    limit, what = config.max_graph_bytes, f"function {name!r}" if name else "a function"
    total = _constant_bytes(constants, what)
    if total > limit:
        raise ValueError(f"{what}: its graph constants take {total} bytes; a graph's constants and created tensors "
                         f"may take at most {limit} bytes (--max-graph-bytes). Fix: {_GRAPH_FIX}")
    for position, node in enumerate(graph.nodes):
        made = _created_bytes(node, position, what, limit)
        total += made
        if total > limit:
            raise ValueError(f"{what}: its graph constants and created tensors take {total} bytes or more (node "
                             f"{position} {node.target} adds {made}); at most {limit} bytes (--max-graph-bytes). "
                             f"Fix: {_GRAPH_FIX}")
    return total


def graph_bytes(graph: pb.Graph, constants: list) -> int:
    """The bytes `check_graph` counts for ``graph`` (no bound: for tests and reports)."""
    return check_graph(graph, constants, ServiceConfig(max_graph_bytes=1 << 62))


# ---------------------------------------------------------------- counting

def _constant_bytes(constants: list, what: str) -> int:
    total = 0
    for index, constant in enumerate(constants):
        try:
            total += memoryview(constant).nbytes
        except TypeError:
            raise ValueError(f"{what}: graph constant {index} is a {type(constant).__name__}: expected bytes "
                             f"(a tensor's frame)") from None
    return total


def _created_bytes(node: pb.GraphNode, position: int, what: str, limit: int) -> int:
    """The bytes creation op ``node`` makes (0: not a creation op, or a size not written in the graph)."""
    family = node.target.rpartition(".")[0]
    if node.op != "call_function" or family not in CREATION_OPS:
        return 0
    args = list(node.args)
    kwargs = {k.name: k.value for k in node.kwargs}
    if family in _SIZED:
        shape = _sizes(args, kwargs)
        elements = _elements(shape, what, position, node, limit) if shape is not None else None
    else:
        elements = _counted_elements(family, args, what, position, node)
    if elements is None:
        return 0
    dtype = kwargs.get("dtype")
    itemsize = _ITEMSIZE.get(dtype.dtype, _UNNAMED_ITEMSIZE) if dtype is not None and \
        dtype.WhichOneof("kind") == "dtype" else _UNNAMED_ITEMSIZE
    made = elements * itemsize
    if made > limit:
        raise ValueError(f"{what}: node {position} ({node.name or '?'}) {node.target} makes at least {elements} "
                         f"elements ({made} bytes or more); one created tensor, like the whole graph, may take at most "
                         f"{limit} bytes (--max-graph-bytes). Fix: {_GRAPH_FIX}")
    return made


def _sizes(args: list, kwargs: dict) -> list | None:
    """The size list of a sized creation op: its ``size`` keyword, else its first list argument."""
    found = kwargs.get("size")
    if found is None:
        found = next((a for a in args if a.WhichOneof("kind") == "list"), None)
    if found is None or found.WhichOneof("kind") != "list":
        return None
    return [_literal(item) for item in found.list.items]


def _literal(arg: pb.Arg):
    kind = arg.WhichOneof("kind")
    return arg.int_value if kind == "int_value" else arg.float_value if kind == "float_value" else None


def _elements(shape: list, what: str, position: int, node: pb.GraphNode, limit: int) -> int | None:
    if any(d is not None and (not isinstance(d, int) or d < 0) for d in shape):
        raise ValueError(f"{what}: node {position} ({node.name or '?'}) {node.target} has shape {shape}: expected "
                         f"sizes >= 0. Fix: give the tensor a valid shape")
    if None in shape:
        return None
    elements = 1
    for d in shape:
        elements *= d
        if elements > limit:   # past the bound already (it is refused): no need to multiply on
            return elements
    return elements


def _counted_elements(family: str, args: list, what: str, position: int, node: pb.GraphNode) -> int | None:
    """Elements of arange, eye, linspace, logspace, randperm and scalar_tensor, from their number arguments."""
    numbers = [_literal(a) for a in args]
    if family == "aten.scalar_tensor":
        return 1
    if family == "aten.arange":   # arange(end), arange(start, end), arange(start, end, step)
        if not numbers or None in numbers[:3]:
            return None
        start, end, step = (0, numbers[0], 1) if len(numbers) == 1 else \
            (numbers[0], numbers[1], numbers[2] if len(numbers) > 2 else 1)
        count = (end - start) / step if step else math.inf
    elif family == "aten.eye":
        n = numbers[0] if numbers else None
        m = numbers[1] if len(numbers) > 1 and numbers[1] is not None else n
        count = None if n is None else n * m
    elif family in ("aten.linspace", "aten.logspace"):
        count = numbers[2] if len(numbers) > 2 else None
    else:   # randperm
        count = numbers[0] if numbers else None
    if count is None:
        return None
    if not math.isfinite(count) or count < 0:
        raise ValueError(f"{what}: node {position} ({node.name or '?'}) {node.target} with arguments {numbers} makes "
                         f"{count} elements: expected a finite count >= 0. Fix: give it finite bounds and a step "
                         f"that is not 0")
    return math.ceil(count)
