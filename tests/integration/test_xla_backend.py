"""Executors on each installed XLA route: XLA devices, compile once per shape, cuts at collectives, no fallbacks."""

from __future__ import annotations

import pytest
import torch

import pathways_torch as pw
from tests.handles import controller_of

pytestmark = [pytest.mark.integration, pytest.mark.compat, pytest.mark.timeout(180)]


@pytest.fixture(scope="module", params=["xla:torchax", "xla:torch_xla"])
def ctx(request):
    from pathways_torch.wire.backend_names import route_installed

    if not route_installed(request.param):
        pytest.skip(f"{request.param} is not installed here")
    with pw.Context(num_executors=2, backend=request.param) as context:
        yield context


def _compiles(ctx) -> dict:
    return {e: s["num_compiles"] for e, s in ctx.stats()["executors"].items()}


def test_executors_run_on_an_xla_device(ctx):
    devices = {info.device for info in controller_of(ctx).resources.ordered()}
    # torch_xla's device, or the JAX CPU client's: no silent fallback to torch's CPU.
    assert devices == ({"xla:0"} if ctx.backend == "xla:torch_xla" else {"cpu:0"}), devices
    assert {s["backend"] for s in ctx.stats()["executors"].values()} == {ctx.backend}


def test_results_match_eager_and_compile_once_per_shape(ctx):
    mesh = ctx.mesh({"data": 2})
    w_host = torch.randn(32, 16)
    w = ctx.put(w_host, mesh, [pw.Replicate()])

    @pw.function
    def block(x, w):
        h = torch.nn.functional.layer_norm(torch.relu(x @ w), (16,))
        return torch.softmax(h, dim=-1)

    before = _compiles(ctx)
    hosts = [torch.randn(8, 32) for _ in range(10)]
    outs = [block(ctx.put(h, mesh, [pw.Shard(0)]), w) for h in hosts]
    for host, out in zip(hosts, outs):
        # float32 through a different compiler: tolerance of a few ulps times the reduction length.
        torch.testing.assert_close(out.result(timeout_s=120), block.fn(host, w_host), rtol=1e-5, atol=1e-5)
    after_ten = _compiles(ctx)
    assert all(after_ten[e] - before[e] == 1 for e in before), (before, after_ten)
    block(ctx.put(torch.randn(4, 32), mesh, [pw.Shard(0)]), w).result(timeout_s=120)
    after_new_shape = _compiles(ctx)
    assert all(after_new_shape[e] - before[e] == 2 for e in before), (before, after_new_shape)


def test_float64_runs_on_xla(ctx):
    mesh = ctx.mesh({"data": 2})
    host = torch.randn(4, 4, dtype=torch.float64)

    @pw.function
    def gram(a):
        return a @ a.T

    out = gram(ctx.put(host, mesh, [pw.Shard(0)]))
    assert out.dtype == torch.float64
    expected = torch.cat([b @ b.T for b in host.chunk(2)])
    torch.testing.assert_close(out.result(timeout_s=120), expected, rtol=1e-12, atol=1e-12)


def _collectives_inside(ctx) -> bool:
    """Whether this route runs collectives inside its executables here (xla:torchax with the extension built)."""
    from executor.backends import xla_collectives

    return ctx.backend == "xla:torchax" and xla_collectives.available()


def _normalized(ctx, tmp_path):
    """Two all-reduces between XLA ops on {data: 2}, checked against eager; the counters and the trace's detail."""
    mesh = ctx.mesh({"data": 2})
    host = torch.randn(8, 4)

    @pw.function(out=pw.Replicate())
    def normalized(a):
        total = pw.all_reduce((a * a).sum(), axis="data")
        return pw.all_reduce(a.sum(0), axis="data") / total.sqrt()

    out = normalized(ctx.put(host, mesh, [pw.Shard(0)]))
    expected = host.sum(0) / (host * host).sum().sqrt()
    torch.testing.assert_close(out.result(timeout_s=120), expected, rtol=1e-5, atol=1e-5)
    counters = [stats["backend_counters"] for stats in ctx.stats()["executors"].values()]
    events = ctx.trace(str(tmp_path / "trace.json"))["traceEvents"]
    return counters, events


def test_collectives_run_inside_or_cut_the_xla_graph_and_match_eager(ctx, tmp_path):
    counters, events = _normalized(ctx, tmp_path)
    inside = _collectives_inside(ctx)
    for counter in counters:     # both routes count per function
        assert counter["fallback_ops:normalized"] == 0
        assert counter["collective_cuts:normalized"] == (0 if inside else 2), counter
        assert counter.get("collectives_in_xla:normalized", 0) == (2 if inside else 0), counter
    # The trace names the route on each executor's row (and, on xla:torchax, says where the collectives ran).
    rows = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert rows == {f"executor-0 ({ctx.backend})", f"executor-1 ({ctx.backend})"}, rows
    if ctx.backend == "xla:torchax":
        compile_span = next(e for e in events if e.get("cat") == "compile" and e["name"] == "normalized")
        detail = ("1 XLA stage(s), cut at 0 collective(s), 0 op(s) outside XLA, 2 collective(s) inside XLA" if inside
                  else "3 XLA stage(s), cut at 2 collective(s), 0 op(s) outside XLA")
        assert detail in compile_span["args"]["detail"], compile_span


def test_with_the_extension_turned_off_collectives_cut_the_graph_and_match_eager(tmp_path, monkeypatch):
    """The pure-Python path, which platforms without the extension take: same results, host stages."""
    monkeypatch.setenv("PATHWAYS_COLLECTIVES_IN_XLA", "0")     # inherited by the executors
    with pw.Context(num_executors=2, backend="xla:torchax") as ctx:
        counters, events = _normalized(ctx, tmp_path)
    for counter in counters:
        assert counter["collective_cuts:normalized"] == 2, counter
        assert counter.get("collectives_in_xla:normalized", 0) == 0, counter
    compile_span = next(e for e in events if e.get("cat") == "compile" and e["name"] == "normalized")
    assert "3 XLA stage(s), cut at 2 collective(s)" in compile_span["args"]["detail"], compile_span


def test_a_program_s_consecutive_steps_run_as_one_executable(ctx, tmp_path):
    """Fusion (executor/fusion.py): a chain of 16 nodes on one mesh is one executable on each executor, its
    collectives inside it in program order; results as eager's. A node with a host stage stays alone."""
    if ctx.backend != "xla:torchax":
        pytest.skip("xla:torchax fuses; torch_xla runs node by node")
    mesh = ctx.mesh({"data": 2})
    scale = torch.tensor([1.0, 2.0, 3.0])

    def node_fn(x):
        # A tensor made from a literal is a constant of the graph: an argument of the fused executable.
        return pw.all_reduce(x * torch.tensor([1.0, 2.0, 3.0]), axis="data", op="max") + 1

    node = pw.function(node_fn, name="node", out=pw.Replicate())

    @pw.program
    def chain(x):
        for _ in range(16):
            x = node(x)
        return x

    host = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -3.0]])
    expected = torch.maximum(host[0] * scale, host[1] * scale) + 1    # the first node: the max over the shards
    for _ in range(15):
        expected = expected * scale + 1                                 # then each node's input is replicated
    x = ctx.put(host, mesh, [pw.Shard(0)])
    outs = [chain(x) for _ in range(3)]
    for out in outs:
        torch.testing.assert_close(out.result(timeout_s=120).reshape(3), expected, rtol=1e-6, atol=1e-6)
    events = ctx.trace(str(tmp_path / "trace.json"))["traceEvents"]
    lowered = ctx.lowered(chain, x)
    fused = [e for e in events if e.get("name") == "fused n0..n15" and e.get("cat") != "compile"]
    if not _collectives_inside(ctx):
        # Without the extension each node is two executables around a host stage: nothing fuses, and the
        # lowered program says why (the pure-Python path the compat ends take).
        assert not fused, fused
        assert "  n0: not fused: not one executable (2 XLA stage(s), cut at 1 collective(s)" in lowered, lowered
        return
    assert len(fused) == 3 * 2, [e.get("name") for e in events][:50]        # 3 runs on 2 executors
    compiles = [e for e in events if e.get("cat") == "compile" and e["name"] == "fused n0..n15"]
    assert len(compiles) == 2 and "16 steps, one executable" in compiles[0]["args"]["detail"], compiles
    for stats in ctx.stats()["executors"].values():
        assert stats["backend_counters"]["fused_steps"] == 16, stats["backend_counters"]
    for executor_id in ctx.executor_ids:   # what each executor fused, under the controller's lowering
        assert (f"{executor_id}: segment n0..n15 (16 steps, 1 in, 1 out, collective)\n"
                f"  fused n0..n15: 16 steps, one executable (64 ops, 1 in, 1 out)") in lowered, lowered


def test_values_stay_jax_arrays_between_calls(ctx):
    """Between two functions and inside a program the store keeps XLA's own values: no conversion at all;
    a collective converts its input and its output once each."""
    if ctx.backend != "xla:torchax":
        pytest.skip("conversions are counted on the xla:torchax route")
    mesh = ctx.mesh({"data": 2})
    double = pw.function(lambda a: a * 2, name="double")
    total = pw.function(lambda a: pw.all_reduce(a, axis="data"), name="total", out=pw.Replicate())

    @pw.program
    def step(a):
        return total(double(double(a)))

    x = ctx.put(torch.ones(4, 3), mesh, [pw.Shard(0)])
    step(x).result(timeout_s=120)            # compiled and registered

    def conversions():
        return {e: {k: v for k, v in s["backend_counters"].items() if k.startswith("conversions:")}
                for e, s in ctx.stats()["executors"].items()}

    before = conversions()
    runs = 5
    for _ in range(runs):
        out = step(x)
    torch.testing.assert_close(out.result(timeout_s=120), torch.full((2, 3), 8.0))
    after = conversions()
    assert before.keys() == after.keys() == set(ctx.executor_ids)
    for executor_id in before:
        b, a = before[executor_id], after[executor_id]
        delta = {k: a.get(k, 0) - b.get(k, 0) for k in a}
        # Per step on each executor: nothing, or (cut) the all-reduce's input to torch and its result back
        # (the result goes to the client once, on the wire).
        per_cut = 0 if _collectives_inside(ctx) else runs
        assert delta["conversions:jax->torch"] == per_cut and delta["conversions:torch->jax"] == per_cut, delta
        assert delta.get("conversions:wire->jax", 0) == 0, delta
        assert delta.get("conversions:jax->wire", 0) <= 1, delta


def test_data_dependent_output_sizes_run_and_are_counted_outside_xla(ctx):
    """XLA needs static shapes: on xla:torchax a function like ``x[x > 0]`` runs in torch, op by op, and its
    fallback count says so; the sizes still reach the client before its readers are dispatched."""
    mesh = ctx.mesh({"data": 2})
    positive = pw.function(lambda x: x[x > 0], name="positive")
    doubled = pw.function(lambda y: y * 2, name="doubled")
    host = torch.tensor([1.0, -2.0, 3.0, 4.0, -5.0, 6.0])
    y = positive(ctx.put(host, mesh, [pw.Shard(0)]))
    assert not y.shape_known
    torch.testing.assert_close(doubled(y).result(timeout_s=120), torch.tensor([2.0, 6.0, 8.0, 12.0]))
    if ctx.backend == "xla:torchax":
        assert ctx.backend_counters("fallback_ops")["positive"] > 0
        assert ctx.backend_counters("fallback_ops")["doubled"] == 0     # its shape is known when it is compiled
