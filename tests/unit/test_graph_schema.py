"""The graph schema: make_fx graphs encode, travel as bytes, decode and run like eager."""

import importlib.resources
import operator
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from pathways_torch.wire import pb
from pathways_torch.wire.graph_schema import (
    ALLOWED_NAMESPACES, GraphSchemaError, decode_graph, encode_graph, resolve_target,
)

pytestmark = [pytest.mark.compat, pytest.mark.timeout(60)]

WIRE_DIR = Path(__file__).resolve().parents[2] / "pathways_torch" / "wire"


def capture(fn, *inputs):
    """Trace ``fn`` on fake tensors as pathways_torch.capture does."""
    return make_fx(fn, tracing_mode="fake")(*inputs)


def over_the_wire(graph_module):
    """Encode, serialize to bytes, parse back, decode."""
    message, constants = encode_graph(graph_module)
    received = pb.Graph.FromString(message.SerializeToString())
    frames = [bytes(memoryview(c)) for c in constants]
    return decode_graph(received, frames), message, constants


def as_tuple(out):
    return tuple(out) if isinstance(out, (list, tuple)) else (out,)


def assert_round_trip(fn, *inputs):
    gm = capture(fn, *inputs)
    decoded, message, constants = over_the_wire(gm)
    expected = as_tuple(fn(*inputs))
    got = as_tuple(decoded(*inputs))
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    return message, constants, decoded


# ---------------------------------------------------------------- round trips

def test_matmul_chain():
    torch.manual_seed(0)
    a, b, c = torch.randn(4, 5), torch.randn(5, 6), torch.randn(6, 3)
    message, _, _ = assert_round_trip(lambda a, b, c: torch.relu(a @ b) @ c + 1.0, a, b, c)
    targets = [n.target for n in message.nodes]
    assert "aten.mm.default" in targets
    assert [n.op for n in message.nodes][:3] == ["placeholder"] * 3
    assert message.nodes[-1].op == "output"


def test_layer_norm_uses_getitem():
    torch.manual_seed(1)
    x, w, b = torch.randn(3, 8), torch.randn(8), torch.randn(8)
    message, _, _ = assert_round_trip(lambda x, w, b: torch.nn.functional.layer_norm(x, (8,), w, b, 1e-5), x, w, b)
    assert any(n.target == "operator.getitem" for n in message.nodes)


def test_softmax():
    torch.manual_seed(2)
    x = torch.randn(4, 7)
    assert_round_trip(lambda x: torch.softmax(x, dim=-1), x)


def test_attention():
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8)

    def attention(q, k, v):
        scores = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
        return torch.softmax(scores, dim=-1) @ v

    assert_round_trip(attention, q, k, v)


def test_indexing_with_tensor_index_and_slice():
    x = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    idx = torch.tensor([3, 0, 2])
    message, _, decoded = assert_round_trip(lambda x, idx: (x[idx], x[:, 1:3]), x, idx)
    first, second = decoded(x, idx)
    assert torch.equal(first, x[[3, 0, 2]])
    assert torch.equal(second, x[:, 1:3])
    # The index list travels as a list arg containing a node ref.
    index_node = next(n for n in message.nodes if n.target == "aten.index.Tensor")
    assert index_node.args[1].WhichOneof("kind") == "list"


def test_reductions():
    torch.manual_seed(4)
    x = torch.randn(3, 4, 5)

    def reduce(x):
        return x.sum(dim=1), x.mean(dim=(0, 2)), x.amax(dim=-1, keepdim=True), x.sum()

    assert_round_trip(reduce, x)


def test_dtype_casts():
    x = torch.tensor([[1.5, -2.25], [3.75, 100.0]])
    message, _, decoded = assert_round_trip(lambda x: (x.to(torch.float64) * 2, x.to(torch.int64)), x)
    as_double, as_long = decoded(x)
    assert as_double.dtype == torch.float64 and as_long.dtype == torch.int64
    assert as_long.tolist() == [[1, -2], [3, 100]]
    dtypes = {a.dtype for n in message.nodes for a in list(n.args) + [k.value for k in n.kwargs]
              if a.WhichOneof("kind") == "dtype"}
    assert {"float64", "int64"} <= dtypes


def test_tensor_constant_created_inside_function():
    x = torch.ones(2, 3)

    def with_constant(x):
        return x * torch.tensor([1.0, 2.0, 3.0]) + torch.arange(3)

    message, constants, decoded = assert_round_trip(with_constant, x)
    assert len(message.constants) == 1 and len(constants) == 1
    assert message.constants[0].dtype == "float32"
    assert list(message.constants[0].shape) == [3]
    assert decoded(x).tolist() == [[1.0, 3.0, 5.0], [1.0, 3.0, 5.0]]


def test_decode_rewrites_device_arguments():
    gm = capture(lambda x: x + torch.arange(3, dtype=torch.float32), torch.zeros(3))
    message, constants = encode_graph(gm)
    assert any(k.value.WhichOneof("kind") == "device" for n in message.nodes for k in n.kwargs)
    # Pretend the graph came from another device: decoding for "cpu" still runs here.
    for n in message.nodes:
        for k in n.kwargs:
            if k.value.WhichOneof("kind") == "device":
                k.value.device = "meta"
    decoded = decode_graph(message, constants, device="cpu")
    assert decoded(torch.ones(3)).tolist() == [1.0, 2.0, 3.0]


def test_encode_refuses_non_aten_targets():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.add, (x, x)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    with pytest.raises(GraphSchemaError, match="not an aten op"):
        encode_graph(gm)


def test_encode_refuses_call_module():
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU()))
    with pytest.raises(GraphSchemaError, match="call_module"):
        encode_graph(gm)


def test_resolve_target_accepts_aten_and_getitem():
    assert resolve_target("aten.mm.default") is torch.ops.aten.mm.default
    assert resolve_target("operator.getitem") is operator.getitem
    assert "os" not in ALLOWED_NAMESPACES


# ---------------------------------------------------------------- corrupted graphs

@pytest.fixture
def good_graph():
    gm = capture(lambda x: torch.relu(x) * torch.tensor([2.0, 3.0]), torch.zeros(2))
    message, constants = encode_graph(gm)
    decode_graph(message, constants)  # it is valid before we corrupt it
    return message, constants


def _call_nodes(message):
    return [n for n in message.nodes if n.op == "call_function"]


def test_unknown_op_name(good_graph):
    message, constants = good_graph
    node = _call_nodes(message)[0]
    node.target = "aten.not_a_real_op.default"
    with pytest.raises(GraphSchemaError) as info:
        decode_graph(message, constants)
    assert "unknown op" in str(info.value)
    assert "aten.not_a_real_op.default" in str(info.value)
    assert node.name in str(info.value)


def test_unknown_overload_name(good_graph):
    message, constants = good_graph
    _call_nodes(message)[0].target = "aten.relu.no_such_overload"
    with pytest.raises(GraphSchemaError, match="aten.relu.no_such_overload"):
        decode_graph(message, constants)


def test_namespace_not_allowed(good_graph):
    message, constants = good_graph
    _call_nodes(message)[0].target = "os.system.default"
    with pytest.raises(GraphSchemaError) as info:
        decode_graph(message, constants)
    assert "namespace 'os'" in str(info.value)
    assert "aten" in str(info.value)


def test_malformed_op_name(good_graph):
    message, constants = good_graph
    _call_nodes(message)[0].target = "aten.relu"
    with pytest.raises(GraphSchemaError, match="namespace.op.overload"):
        decode_graph(message, constants)


def test_node_ref_pointing_forward(good_graph):
    message, constants = good_graph
    first_call = next(i for i, n in enumerate(message.nodes) if n.op == "call_function")
    arg = next(a for a in message.nodes[first_call].args if a.WhichOneof("kind") == "node")
    arg.node = len(message.nodes) - 1
    with pytest.raises(GraphSchemaError) as info:
        decode_graph(message, constants)
    assert f"refers to node {len(message.nodes) - 1}" in str(info.value)
    assert f"only {first_call} come before it" in str(info.value)


def test_missing_output_node(good_graph):
    message, constants = good_graph
    assert message.nodes[-1].op == "output"
    del message.nodes[-1]
    with pytest.raises(GraphSchemaError, match="no output node"):
        decode_graph(message, constants)


def test_nodes_after_output(good_graph):
    message, constants = good_graph
    message.nodes.add(op="placeholder", name="late")
    with pytest.raises(GraphSchemaError, match="after the output node"):
        decode_graph(message, constants)


def test_constant_index_out_of_range(good_graph):
    message, constants = good_graph
    arg = next(a for n in message.nodes for a in n.args if a.WhichOneof("kind") == "constant")
    arg.constant = 7
    with pytest.raises(GraphSchemaError) as info:
        decode_graph(message, constants)
    assert "constant 7 out of range" in str(info.value)
    assert "graph has 1" in str(info.value)


def test_unknown_node_op(good_graph):
    message, constants = good_graph
    _call_nodes(message)[0].op = "call_module"
    with pytest.raises(GraphSchemaError, match="unknown node op 'call_module'"):
        decode_graph(message, constants)


def test_arg_without_kind(good_graph):
    message, constants = good_graph
    _call_nodes(message)[0].args.add()
    with pytest.raises(GraphSchemaError, match="argument has no kind"):
        decode_graph(message, constants)


def test_bad_memory_format_name(good_graph):
    message, constants = good_graph
    _call_nodes(message)[0].kwargs.add(name="memory_format").value.memory_format = "float32"
    with pytest.raises(GraphSchemaError, match="not a torch.memory_format"):
        decode_graph(message, constants)


def test_output_with_two_args(good_graph):
    message, constants = good_graph
    message.nodes[-1].args.add(node=0)
    with pytest.raises(GraphSchemaError, match="exactly one argument"):
        decode_graph(message, constants)


# ---------------------------------------------------------------- generated code

def test_generated_pb2_matches_proto(tmp_path):
    from grpc_tools import protoc

    include = str(importlib.resources.files("grpc_tools") / "_proto")
    rc = protoc.main(["protoc", f"-I{WIRE_DIR}", f"-I{include}", f"--python_out={tmp_path}",
                      str(WIRE_DIR / "pathways.proto")])
    assert rc == 0
    generated = (tmp_path / "pathways_pb2.py").read_text()
    checked_in = (WIRE_DIR / "pathways_pb2.py").read_text()
    assert generated == checked_in, "pathways_pb2.py is stale: regenerate it from pathways.proto with grpc_tools.protoc"


# ---------------------------------------------------------------- the op allow-list

@pytest.mark.parametrize("name", ["aten.from_file.default", "aten.set_.source_Storage",
                                  "aten.set_.source_Storage_storage_offset", "aten._unsafe_index.Tensor",
                                  "aten._unsafe_index_put.default", "aten._index_put_impl_.default"])
def test_ops_that_reach_files_or_storage_are_refused(good_graph, name):
    """``aten.from_file(..., shared=True)`` creates and writes a file on the executor's host; ``set_`` with a
    Storage source makes a tensor over any storage. Both are real aten ops: the allow-list refuses them by name."""
    _, op, overload = name.split(".")
    assert isinstance(getattr(getattr(torch.ops.aten, op), overload), torch._ops.OpOverload)   # not "unknown op"
    message, constants = good_graph
    node = _call_nodes(message)[0]
    node.target = name
    with pytest.raises(GraphSchemaError) as info:
        decode_graph(message, constants)
    assert name in str(info.value) and node.name in str(info.value)
    assert "allow-list" in str(info.value) and "op_allowlist.py" in str(info.value)   # and how to get one added
    with pytest.raises(GraphSchemaError, match="allow-list"):
        resolve_target(name)


def test_encoding_refuses_an_op_off_the_allow_list():
    """The client finds out at capture, before anything is sent."""
    graph = torch.fx.Graph()
    graph.output(graph.call_function(torch.ops.aten.from_file.default, ("/tmp/pathways-x", True, 4)))
    with pytest.raises(GraphSchemaError) as info:
        encode_graph(torch.fx.GraphModule(torch.nn.Module(), graph))
    assert "'aten.from_file.default' is not on the allow-list" in str(info.value)


def test_a_model_and_its_backward_round_trip_on_the_allow_list():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(2, 4, 3, padding=1), torch.nn.Flatten(), torch.nn.LayerNorm(24),
                                torch.nn.GELU(), torch.nn.Dropout(0.0), torch.nn.Linear(24, 3))
    names = [name for name, _ in model.named_parameters()]

    def step(x, y, *weights):
        out = torch.func.functional_call(model, dict(zip(names, weights)), (x,))
        loss = torch.nn.functional.cross_entropy(out.softmax(-1).log(), y) + out.pow(2).mean()
        return (loss, *torch.autograd.grad(loss, weights))

    weights = [p.detach().requires_grad_() for p in model.parameters()]
    message, _, _ = assert_round_trip(step, torch.randn(5, 2, 6), torch.tensor([0, 2, 1, 1, 0]), *weights)
    assert "aten.convolution_backward.default" in [n.target for n in message.nodes]
