"""The round-trip set through each XLA route in this process: results match eager PyTorch.

Both routes run where installed: ``xla:torchax`` everywhere (the default), ``xla:torch_xla``
in the torch 2.9 environment (tests/compat).

Tolerance for float32: rtol = atol = 1e-5. XLA fuses ops and orders reductions
differently and uses its own vectorised exp/tanh, so results differ from eager by
a few ulps (float32 eps is 1.2e-7) times the reduction length (≤ 64 here);
1e-5 covers that with room and still catches any real error (wrong op, wrong
axis, wrong dtype). float64 must agree to 1e-12, except through erf (exact GELU):
XLA's CPU erf is accurate to only about 3.5e-7 relative in float64 (measured here),
so that case gets 1e-6.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from pathways_torch.wire import pb
from pathways_torch.wire.graph_schema import encode_graph
from pathways_torch.wire.tensors import frame_to_tensor, tensor_to_frame

pytestmark = [pytest.mark.compat, pytest.mark.timeout(120)]


@pytest.fixture(scope="module", params=["xla:torchax", "xla:torch_xla"])
def xla(request):
    from executor.backends import make_backend
    from pathways_torch.wire.backend_names import route_installed

    if not route_installed(request.param):
        pytest.skip(f"{request.param} is not installed here")
    return make_backend(request.param)


def _attention(q, k, v):
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


CASES = {
    "matmul_chain": (lambda a, b, c: torch.relu(a @ b) @ c + 1.0, [(8, 16), (16, 32), (32, 4)]),
    "layer_norm": (lambda x, w, b: torch.nn.functional.layer_norm(x, (32,), w, b), [(8, 32), (32,), (32,)]),
    "softmax": (lambda x: torch.softmax(x, dim=-1) * torch.log_softmax(x, dim=0), [(8, 64)]),
    "attention": (_attention, [(2, 8, 16), (2, 8, 16), (2, 8, 16)]),
    "indexing": (lambda x: x[torch.tensor([3, 0, 2])][:, 1:5] + x[::2].sum(0)[1:5], [(6, 8)]),
    "reductions": (lambda x: (x.sum(0), x.mean(1), x.amax(1), x.var(0), x.norm()), [(16, 12)]),
    "dtype_casts": (lambda x: (x.to(torch.float64) * 3, (x * 10).to(torch.int64), x.half().float()), [(5, 7)]),
    "gelu_mlp": (lambda x, w1, w2: torch.nn.functional.gelu(x @ w1) @ w2, [(8, 16), (16, 64), (64, 16)]),
    # torch_xla has no lowering for LayerNorm's backward: the backend decomposes it (a re-trace).
    "layer_norm_backward": (lambda x, w, b: torch.func.grad(
        lambda x, w, b: torch.nn.functional.layer_norm(x, (32,), w, b).pow(2).sum(), argnums=(0, 1, 2))(x, w, b),
        [(8, 32), (32,), (32,)]),
    # What F.scaled_dot_product_attention traces to on CPU, forward and backward (a lowering of ours on torchax).
    "sdpa_backward": (lambda q, k, v: torch.func.grad(
        lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).pow(2).sum(),
        argnums=(0, 1, 2))(q, k, v), [(2, 3, 8, 16), (2, 3, 8, 16), (2, 3, 8, 16)]),
    # aten.convolution_backward: a lowering of ours on torchax (the vjp of its forward), in several forms.
    "conv2d_backward": (lambda x, w, b: _conv_grad(x, w, b, lambda x, w, b: torch.nn.functional.conv2d(
        x, w, b, stride=2, padding=1, groups=2)), [(2, 4, 9, 9), (6, 2, 3, 3), (6,)]),
    "conv1d_dilated_backward": (lambda x, w, b: _conv_grad(x, w, b, lambda x, w, b: torch.nn.functional.conv1d(
        x, w, b, padding=2, dilation=2)), [(2, 3, 11), (5, 3, 3), (5,)]),
    "conv_transpose2d_backward": (lambda x, w, b: _conv_grad(x, w, b, lambda x, w, b: (
        torch.nn.functional.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1))),
        [(2, 4, 5, 5), (4, 3, 3, 3), (3,)]),
}


def _conv_grad(x, w, b, conv):
    return torch.func.grad(lambda x, w, b: conv(x, w, b).pow(2).sum(), argnums=(0, 1, 2))(x, w, b)


# float64 tolerances above 1e-12: XLA's erf (see the module docstring); LayerNorm's decomposed
# backward sums over rows in another order and goes through XLA's rsqrt (measured: 5e-12).
_LOW_PRECISION_F64 = {"gelu_mlp": 1e-6, "layer_norm_backward": 1e-10}


def _run_on_xla(xla, fn, inputs):
    """Through the executor's own path: the graph and the tensors as they arrive from the wire."""
    graph, constants = encode_graph(make_fx(fn, tracing_mode="fake")(*inputs))
    load = pb.LoadFunction(name="case")
    load.graph.CopyFrom(pb.Graph.FromString(graph.SerializeToString()))
    prepared, examples = xla.prepare(load, [bytes(memoryview(c)) for c in constants])
    compiled = xla.compile(prepared, examples)
    outputs = xla.run(compiled, [_through_wire(xla.from_frame, t) for t in inputs])
    # Computed by XLA, not a silent host fallback:
    if xla.name == "xla:torch_xla":
        assert all(o.device.type == "xla" for o in outputs)
    else:
        assert xla.counters()["fallback_ops:case"] == 0
        assert all(type(o).__module__.startswith("jax") for o in outputs)
    return [_through_wire(lambda meta, frames: frame_to_tensor(meta, frames), o, xla.to_frame) for o in outputs]


def _through_wire(receive, value, send=tensor_to_frame):
    meta = pb.TensorMeta()
    frame = send(value, meta, 1)
    return receive(meta, [bytes(frame)])


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_xla_matches_eager(xla, name, dtype):
    fn, shapes = CASES[name]
    torch.manual_seed(0)
    inputs = [torch.randn(shape, dtype=dtype) for shape in shapes]
    expected = fn(*inputs)
    expected = list(expected) if isinstance(expected, tuple) else [expected]
    got = _run_on_xla(xla, fn, inputs)
    tolerance = 1e-5 if dtype == torch.float32 else _LOW_PRECISION_F64.get(name, 1e-12)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        if e.dtype == torch.float16:
            tolerance = 1e-3
        torch.testing.assert_close(g, e, rtol=tolerance, atol=tolerance)


def test_an_op_without_a_lowering_runs_on_the_host_counted(xla):
    """``aten.searchsorted.Scalar`` has no torchax lowering and no torch decomposition: that one op runs in
    torch between two XLA stages, the result is still eager's, and the function's fallback count says so."""
    if xla.name != "xla:torchax":
        pytest.skip("fallback stages are xla:torchax's")

    def fn(x):
        ordered = torch.sort(x * 2).values
        return torch.searchsorted(ordered, 0.5) + ordered.sum().to(torch.int64)

    x = torch.randn(16)
    graph, constants = encode_graph(make_fx(fn, tracing_mode="fake")(x))
    load = pb.LoadFunction(name="with_fallback")
    load.graph.CopyFrom(graph)
    prepared, examples = xla.prepare(load, [bytes(memoryview(c)) for c in constants])
    compiled = xla.compile(prepared, examples)
    got = xla.run(compiled, [_through_wire(xla.from_frame, x)])
    assert xla.counters()["fallback_ops:with_fallback"] == 1
    assert "1 op(s) outside XLA" in compiled.summary
    out = _through_wire(lambda meta, frames: frame_to_tensor(meta, frames), got[0], xla.to_frame)
    assert torch.equal(out, fn(x))


@pytest.mark.parametrize("value", [torch.randn(8, 32, 64), torch.arange(10), torch.tensor([True, False]),
                                   torch.randn(3, dtype=torch.bfloat16), torch.randn(300, 300), torch.zeros(0, 3),
                                   torch.tensor(2.5, dtype=torch.float64)],
                         ids=["48KB", "int64", "bool", "bfloat16", "360KB", "empty", "0-d"])
def test_a_received_frame_becomes_the_same_value_on_either_path_and_a_short_frame_is_refused(xla, value):
    # Small frames of a dtype numpy has go straight to a jax array; bfloat16 and frames over 64 KB through torch.
    from pathways_torch.wire.tensors import WireTensorError

    out = _through_wire(lambda meta, frames: frame_to_tensor(meta, frames), _through_wire(xla.from_frame, value),
                        xla.to_frame)
    assert out.dtype == value.dtype and out.shape == value.shape and torch.equal(out, value)
    meta = pb.TensorMeta()
    frame = bytes(tensor_to_frame(value, meta, 1))
    if value.numel():
        meta.shape.append(2)    # a header that asks for more bytes than the frame has
    else:
        meta.frame = 2          # one that names a frame the message does not have
    with pytest.raises(WireTensorError, match="needs|names frame"):
        xla.from_frame(meta, [frame])
