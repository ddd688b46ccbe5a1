"""Executors with the XLA backend (torch_xla on PJRT CPU): real XLA devices, compile once per shape."""

from __future__ import annotations

import pytest
import torch

import pathways_torch as pw

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def ctx():
    pytest.importorskip("torch_xla")
    with pw.Context(num_executors=2, backend="xla") as context:
        yield context


def _compiles(ctx) -> dict:
    return {e: s["num_compiles"] for e, s in ctx.stats()["executors"].items()}


def test_executors_run_on_an_xla_device(ctx):
    devices = {info.device for info in ctx.controller.resources.ordered()}
    assert devices == {"xla:0"}, devices  # no silent fallback to the CPU


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


def test_collective_cuts_the_xla_graph_and_matches_eager(ctx):
    mesh = ctx.mesh({"data": 2})
    host = torch.randn(8, 4)

    @pw.function(out=pw.Replicate())
    def normalized(a):
        total = pw.all_reduce((a * a).sum(), axis="data")     # XLA segment, gloo on the host, XLA segment
        return pw.all_reduce(a.sum(0), axis="data") / total.sqrt()

    out = normalized(ctx.put(host, mesh, [pw.Shard(0)]))
    expected = host.sum(0) / (host * host).sum().sqrt()
    torch.testing.assert_close(out.result(timeout_s=120), expected, rtol=1e-5, atol=1e-5)
