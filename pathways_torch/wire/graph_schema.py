"""A captured fx graph as a schema message: no Python source, no pickle.

Encoding walks an aten-level ``torch.fx.GraphModule`` (as ``make_fx`` produces) and
writes each node's op, its target's qualified name and its arguments in a closed
set of kinds (node refs, ints, floats, bools, None, strings, dtypes, memory
formats, layouts, devices, lists, tensor constants). Decoding resolves every
target against ``torch.ops`` (plus ``operator.getitem``) on the receiving side and
rebuilds a GraphModule; an unknown op, an op off the allow-list (`op_allowlist`:
what capture produces, and the collectives) or a malformed graph is refused with an
error that names it. Encoding refuses an op off the allow-list too, so a function
that needs one fails at capture, on the client.
"""

from __future__ import annotations

import operator
from typing import Any

from . import pathways_pb2 as pb
from .op_allowlist import is_allowed
from .tensors import dtype_from_name, dtype_name, frame_to_tensor, tensor_to_frame

__all__ = ["encode_graph", "decode_graph", "GraphSchemaError", "ALLOWED_NAMESPACES"]

# Op namespaces an executor will resolve; within them, only the ops of `op_allowlist`.
ALLOWED_NAMESPACES = ("aten", "pathways")

_NODE_OPS = ("placeholder", "call_function", "output")


class GraphSchemaError(ValueError):
    """A graph that cannot be encoded, or a received graph that is malformed or names an unknown op."""


# ---------------------------------------------------------------- encoding

def encode_graph(graph_module) -> tuple[pb.Graph, list]:
    """Return the schema message for ``graph_module`` and its constant frames (in order)."""
    message = pb.Graph()
    index_of: dict[Any, int] = {}
    constants: list = []
    placeholders = []
    for node in graph_module.graph.nodes:
        if node.op == "get_attr":
            # Tensor constants that make_fx lifted onto the module travel as frames.
            value = _resolve_attr(graph_module, node.target)
            index_of[node] = ("constant", _add_constant(message, constants, value))
            continue
        out = message.nodes.add(op=node.op, name=node.name)
        if node.op == "placeholder":
            placeholders.append(node)
        if node.op == "call_function":
            out.target = _target_name(node.target, node)
        elif node.op not in ("placeholder", "output"):
            raise GraphSchemaError(f"node {node.name}: op {node.op!r} cannot travel; expected one of {_NODE_OPS}")
        for arg in node.args:
            _encode_arg(out.args.add(), arg, index_of, message, constants, node)
        for name, value in node.kwargs.items():
            named = out.kwargs.add(name=name)
            _encode_arg(named.value, value, index_of, message, constants, node)
        index_of[node] = len(message.nodes) - 1
    for node in placeholders:
        _add_input_signature(message, node)
    _add_output_signature(message, graph_module)
    return message, constants


def _add_output_signature(message: pb.Graph, graph_module) -> None:
    import torch

    output = next((n for n in graph_module.graph.nodes if n.op == "output"), None)
    if output is None:
        return
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    for value in values:
        fake = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
        if isinstance(fake, torch.Tensor):
            # -1: a size only the data decides (e.g. after torch.nonzero or a boolean mask)
            message.outputs.add(dtype=dtype_name(fake.dtype), shape=[d if isinstance(d, int) else -1 for d in fake.shape])


def _add_input_signature(message: pb.Graph, node) -> None:
    value = node.meta.get("val")
    if value is None or not hasattr(value, "shape"):
        raise GraphSchemaError(f"placeholder {node.name} has no traced shape; capture with make_fx")
    message.inputs.add(dtype=dtype_name(value.dtype), shape=[int(d) for d in value.shape])


def _resolve_attr(module, target: str):
    value = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _add_constant(message: pb.Graph, constants: list, tensor) -> int:
    meta = message.constants.add()
    constants.append(tensor_to_frame(tensor, meta, len(constants) + 1))
    return len(constants) - 1


def _target_name(target, node) -> str:
    if target is operator.getitem:
        return "operator.getitem"
    import torch

    if isinstance(target, torch._ops.OpOverload):
        namespace = target.namespace
        if namespace not in ALLOWED_NAMESPACES:
            raise GraphSchemaError(f"node {node.name}: op namespace {namespace!r} is not one of {ALLOWED_NAMESPACES}")
        name = str(target)   # "namespace.op.overload" ("aten.add.Tensor", "aten.view.default")
        if not is_allowed(name):
            raise GraphSchemaError(_not_allowed(name, f"node {node.name}"))
        return name
    raise GraphSchemaError(
        f"node {node.name}: target {target!r} is not an aten op; capture with make_fx so every call is a torch op")


def _encode_arg(out: pb.Arg, value, index_of, message, constants, node) -> None:
    import torch

    if isinstance(value, torch.fx.Node):
        ref = index_of[value]
        if isinstance(ref, tuple):
            out.constant = ref[1]
        else:
            out.node = ref
    elif isinstance(value, bool):
        out.bool_value = value
    elif isinstance(value, int):
        out.int_value = value
    elif isinstance(value, float):
        out.float_value = value
    elif value is None:
        out.none = True
    elif isinstance(value, str):
        out.str_value = value
    elif isinstance(value, torch.dtype):
        out.dtype = dtype_name(value)
    elif isinstance(value, torch.memory_format):
        out.memory_format = str(value).removeprefix("torch.")
    elif isinstance(value, torch.layout):
        out.layout = str(value).removeprefix("torch.")
    elif isinstance(value, torch.device):
        out.device = str(value)
    elif isinstance(value, (list, tuple)):
        out.list.is_tuple = isinstance(value, tuple)
        for item in value:
            _encode_arg(out.list.items.add(), item, index_of, message, constants, node)
    elif isinstance(value, torch.Tensor):
        out.constant = _add_constant(message, constants, value)
    else:
        raise GraphSchemaError(
            f"node {node.name}: argument {value!r} of type {type(value).__name__} cannot travel in the graph schema")


# ---------------------------------------------------------------- decoding

def decode_graph(message: pb.Graph, frames: list, device=None):
    """Rebuild a ``torch.fx.GraphModule`` from ``message`` and its constant ``frames``.

    ``device`` replaces every device argument (the graph was traced on the client's
    device; it runs on the executor's). Constants are moved to ``device``.
    """
    import torch

    constants = [frame_to_tensor(meta, frames) for meta in message.constants]
    if device is not None:
        constants = [c.to(device) for c in constants]
    root = torch.nn.Module()
    graph = torch.fx.Graph()
    constant_nodes: dict[int, Any] = {}
    built: list = []
    saw_output = False
    calls = 0
    for position, node in enumerate(message.nodes):
        where = f"node {position} ({node.name or '?'})"
        if saw_output:
            raise GraphSchemaError(f"{where}: nodes after the output node")
        if node.op == "placeholder":
            built.append(graph.placeholder(_safe_name(node.name, position)))
            continue
        decode = _ArgDecoder(graph, root, built, constants, constant_nodes, device, where)
        args = tuple(decode(a) for a in node.args)
        kwargs = {k.name: decode(k.value) for k in node.kwargs}
        if node.op == "call_function":
            built.append(graph.call_function(resolve_target(node.target, where), args, kwargs))
            # Its position among call_function nodes, as on the client (copies of the node keep it): how a
            # backend's error names the op to the client, which finds the user's line there.
            calls += 1
            built[-1].meta["pathways_index"] = calls
        elif node.op == "output":
            if len(args) != 1:
                raise GraphSchemaError(f"{where}: output node needs exactly one argument, got {len(args)}")
            built.append(graph.output(args[0]))
            saw_output = True
        else:
            raise GraphSchemaError(f"{where}: unknown node op {node.op!r}; expected one of {_NODE_OPS}")
    if not saw_output:
        raise GraphSchemaError("graph has no output node")
    num_placeholders = sum(1 for n in message.nodes if n.op == "placeholder")
    if len(message.inputs) != num_placeholders:
        raise GraphSchemaError(f"graph has {num_placeholders} placeholders but an input signature of "
                               f"{len(message.inputs)}")
    try:
        graph.lint()
    except Exception as exc:
        raise GraphSchemaError(f"graph failed validation: {exc}") from None
    return torch.fx.GraphModule(root, graph)


def _safe_name(name: str, position: int) -> str:
    return name if name.isidentifier() else f"input_{position}"


class _ArgDecoder:
    def __init__(self, graph, root, built, constants, constant_nodes, device, where):
        self.graph, self.root, self.built = graph, root, built
        self.constants, self.constant_nodes = constants, constant_nodes
        self.device, self.where = device, where

    def __call__(self, arg: pb.Arg):
        import torch

        kind = arg.WhichOneof("kind")
        if kind == "node":
            if arg.node >= len(self.built):
                raise GraphSchemaError(f"{self.where}: refers to node {arg.node}, only {len(self.built)} come before it")
            return self.built[arg.node]
        if kind in ("int_value", "float_value", "bool_value", "str_value"):
            return getattr(arg, kind)
        if kind == "none":
            return None
        if kind == "dtype":
            return dtype_from_name(arg.dtype)
        if kind == "memory_format":
            return _torch_enum(arg.memory_format, torch.memory_format, self.where)
        if kind == "layout":
            return _torch_enum(arg.layout, torch.layout, self.where)
        if kind == "device":
            return torch.device(self.device) if self.device is not None else torch.device(arg.device)
        if kind == "list":
            items = [self(item) for item in arg.list.items]
            return tuple(items) if arg.list.is_tuple else items
        if kind == "constant":
            return self._constant(arg.constant)
        raise GraphSchemaError(f"{self.where}: argument has no kind")

    def _constant(self, index: int):
        if index >= len(self.constants):
            raise GraphSchemaError(f"{self.where}: constant {index} out of range (graph has {len(self.constants)})")
        if index not in self.constant_nodes:
            name = f"_constant{index}"
            self.root.register_buffer(name, self.constants[index])
            self.constant_nodes[index] = self.graph.get_attr(name)
        return self.constant_nodes[index]


def _torch_enum(name: str, kind, where: str):
    import torch

    value = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(value, kind):
        raise GraphSchemaError(f"{where}: {name!r} is not a torch.{kind.__name__}")
    return value


def resolve_target(name: str, where: str = "graph"):
    """Resolve ``"aten.mm.default"`` against ``torch.ops``; refuse anything unknown or off the allow-list."""
    if name == "operator.getitem":
        return operator.getitem
    import torch

    parts = name.split(".")
    if len(parts) != 3 or not all(p.isidentifier() for p in parts):
        raise GraphSchemaError(f"{where}: op name {name!r} is not of the form namespace.op.overload")
    namespace, op, overload = parts
    if namespace not in ALLOWED_NAMESPACES:
        raise GraphSchemaError(f"{where}: op namespace {namespace!r} is not one of {ALLOWED_NAMESPACES}")
    if namespace == "pathways":
        from . import collective_ops  # noqa: F401  (registers torch.ops.pathways.*)
    try:
        packet = getattr(getattr(torch.ops, namespace), op)
        target = getattr(packet, overload)
    except (AttributeError, RuntimeError):
        raise GraphSchemaError(f"{where}: unknown op {name!r}: this executor's torch has no such operator") from None
    if not isinstance(target, torch._ops.OpOverload):
        raise GraphSchemaError(f"{where}: {name!r} is not an operator overload")
    if not is_allowed(name):
        raise GraphSchemaError(_not_allowed(name, where))
    return target


def _not_allowed(name: str, where: str) -> str:
    return (f"{where}: op {name!r} is not on the allow-list of ops a graph may name (expected what capture and its "
            f"decompositions produce, or a pathways collective); if a model needs it, add its family to "
            f"pathways_torch/wire/op_allowlist.py, with a test that captures a function using it")
