"""Caps on what a remote client registers (controller/graph_limits.py; issue 46, point 6): a program's nodes, and a
function's graph constants plus the tensors its creation ops make; an absurd creation op is refused by itself. Each
refusal names what came, the bound and the fix. The embedded client is not capped."""

from __future__ import annotations

import pytest

from controller import CallSpec, Controller
from controller.client_ops import ClientOps
from controller.config import ServiceConfig
from controller.graph_limits import check_graph, check_program, graph_bytes
from controller.resources import MeshAllocation
from pathways_torch.wire import pb
from pathways_torch.wire.seam import ProgramSpec
from pathways_torch.wire.seam import RegisterFunction, RegisterProgram

pytestmark = pytest.mark.timeout(60)

MESH = MeshAllocation(1, (("data", 1),), ("e0",))


def _ints(*values) -> pb.Arg:
    return pb.Arg(list=pb.ArgList(items=[pb.Arg(int_value=v) for v in values]))


def _node(target: str, *args: pb.Arg, dtype: str | None = None, name: str = "made") -> pb.GraphNode:
    node = pb.GraphNode(op="call_function", target=target, name=name, args=list(args))
    if dtype is not None:
        node.kwargs.add(name="dtype", value=pb.Arg(dtype=dtype))
    return node


def _graph(*nodes: pb.GraphNode) -> pb.Graph:
    return pb.Graph(nodes=[pb.GraphNode(op="placeholder", name="x"), *nodes,
                           pb.GraphNode(op="output", args=[pb.Arg(node=0)])])


def _program(nodes: int) -> ProgramSpec:
    return ProgramSpec(name="long", input_values=(0,), input_meshes=(MESH,), output_values=(nodes,), nodes=tuple(
        CallSpec(name=f"n{i}", function_id=1, mesh=MESH, inputs=(i,), outputs=(i + 1,)) for i in range(nodes)))


def test_a_program_past_the_node_cap_is_refused_naming_the_cap_and_the_fix():
    config = ServiceConfig(max_program_nodes=4)
    check_program(_program(4), config)
    with pytest.raises(ValueError) as refused:
        check_program(_program(5), config)
    assert str(refused.value) == (
        "program 'long': 5 nodes; a program may have at most 4 (--max-program-nodes). Fix: split it into smaller "
        "programs (several @pw.program steps), or ask the controller's operator to raise --max-program-nodes")


def test_creation_ops_count_their_bytes_from_their_shapes_and_dtypes():
    graph = _graph(_node("aten.zeros.default", _ints(1000, 1000), dtype="float32"),     # 4,000,000
                   _node("aten.full.default", _ints(10, 10), pb.Arg(float_value=2.0)),   # 800 (no dtype: 8 each)
                   _node("aten.arange.start_step", pb.Arg(int_value=0), pb.Arg(int_value=100), pb.Arg(int_value=3),
                         dtype="int64"),                                                  # 34 x 8
                   _node("aten.eye.m", pb.Arg(int_value=3), pb.Arg(int_value=5), dtype="bool"),   # 15
                   _node("aten.linspace.default", pb.Arg(int_value=0), pb.Arg(int_value=1), pb.Arg(int_value=7),
                         dtype="float16"),                                                # 14
                   _node("aten.add.Tensor", pb.Arg(node=0), pb.Arg(node=0)))              # not a creation op
    assert graph_bytes(graph, [b"\0" * 100]) == 100 + 4_000_000 + 800 + 34 * 8 + 15 + 14
    assert check_graph(graph, [b"\0" * 100], ServiceConfig(max_graph_bytes=4_001_201)) == 4_001_201


def test_a_graph_past_the_byte_cap_is_refused_naming_the_bytes_the_cap_and_the_fix():
    config = ServiceConfig(max_graph_bytes=1_000_000)
    with pytest.raises(ValueError) as refused:
        check_graph(_graph(), [b"\0" * 600_000, b"\0" * 600_000], config, "step")
    assert str(refused.value).startswith("function 'step': its graph constants take 1200000 bytes; a graph's "
                                         "constants and created tensors may take at most 1000000 bytes "
                                         "(--max-graph-bytes). Fix: make the tensor smaller, pass it in as an input")
    two = _graph(_node("aten.ones.default", _ints(600, 1000), dtype="uint8"),
                 _node("aten.rand.default", _ints(600, 1000), dtype="uint8"))
    with pytest.raises(ValueError, match=r"function 'step': its graph constants and created tensors take 1200000 "
                                         r"bytes or more \(node 2 aten\.rand\.default adds 600000\); at most 1000000"):
        check_graph(two, [], config, "step")


@pytest.mark.parametrize("node, says", [
    (_node("aten.zeros.default", _ints(-1, 5)), "has shape [-1, 5]: expected sizes >= 0"),
    (_node("aten.empty.memory_format", _ints(2 ** 40, 2 ** 40)),   # counted until past the bound, then refused
     "makes at least 1099511627776 elements (8796093022208 bytes or more)"),
    (_node("aten.new_full.default", pb.Arg(node=0), _ints(1 << 62, 1 << 62, 1 << 62), pb.Arg(float_value=1.0)),
     "makes at least 4611686018427387904 elements"),
    (_node("aten.arange.start_step", pb.Arg(float_value=-1e308), pb.Arg(float_value=1e308),
           pb.Arg(float_value=1e-308)), "makes inf elements: expected a finite count >= 0"),
    (_node("aten.arange.start_step", pb.Arg(int_value=0), pb.Arg(int_value=10), pb.Arg(int_value=0)),
     "makes inf elements"),
    (_node("aten.randperm.default", pb.Arg(int_value=1 << 62)), "makes at least 4611686018427387904 elements"),
])
def test_one_creation_op_of_an_absurd_shape_is_refused_by_itself(node, says):
    with pytest.raises(ValueError) as refused:
        check_graph(_graph(node), [], ServiceConfig(), "evil")
    text = str(refused.value)
    assert text.startswith(f"function 'evil': node 1 (made) {node.target}") and says in text, text


def test_a_size_not_written_in_the_graph_is_left_to_the_executor():
    unknown = pb.Arg(list=pb.ArgList(items=[pb.Arg(int_value=4), pb.Arg(node=0)]))
    assert graph_bytes(_graph(_node("aten.zeros.default", unknown)), []) == 0


def test_a_captured_function_is_counted_as_traced():
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from pathways_torch.wire.graph_schema import encode_graph

    def step(x):
        return x + torch.zeros(100, 100) + torch.full((100, 100), 2.0, dtype=torch.float16) + torch.arange(10000.0) \
            .reshape(100, 100)

    graph, constants = encode_graph(make_fx(step)(torch.ones(100, 100)))
    assert graph_bytes(graph, constants) == 100 * 100 * (8 + 2 + 8)   # float32 unnamed in the graph: counted as 8
    with pytest.raises(ValueError, match="function 'step'.*at most 100000 bytes"):
        check_graph(graph, constants, ServiceConfig(max_graph_bytes=100_000), "step")


class _Outbox:
    def to_executor(self, executor_id, envelope, payload=()):
        pass


def test_a_remote_clients_ops_apply_the_caps_and_the_embedded_ones_do_not():
    controller = Controller(_Outbox())
    config = ServiceConfig(max_graph_bytes=1000, max_program_nodes=2)
    bob, embedded = ClientOps(controller, None, "bob", limits=config), ClientOps(controller, None)
    with pytest.raises(ValueError, match="function 'big': its graph constants take 2000 bytes; .* at most 1000"):
        bob.handle(RegisterFunction("big", _graph(), [b"\0" * 2000]))
    with pytest.raises(ValueError, match="program 'long': 3 nodes; a program may have at most 2"):
        bob.handle(RegisterProgram(_program(3)))
    assert not bob.functions and not bob.programs
    assert embedded.handle(RegisterFunction("big", _graph(), [b"\0" * 2000])) in embedded.functions
    assert ClientOps(controller, None, "carol").limits == ServiceConfig()   # a remote client: the defaults at least
