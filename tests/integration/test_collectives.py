"""Collectives inside functions on real executors (gloo), checked against eager PyTorch."""

from __future__ import annotations

import pytest
import torch

import pathways_torch as pw
from tests.service import open_context

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

HOST = torch.arange(32, dtype=torch.float64).reshape(8, 4) - 7


@pytest.fixture(scope="module")
def ctx(client_kind, service_if_remote):   # the embedded controller, then a remote one
    with open_context(client_kind, service_if_remote, num_executors=4, backend="eager") as context:
        yield context


@pytest.fixture(scope="module")
def x(ctx):
    return ctx.put(HOST, ctx.mesh({"data": 4}), [pw.Shard(0)])


@pytest.mark.parametrize("op, expected", [("sum", HOST.sum()), ("mean", HOST.reshape(4, 8).sum(1).mean()),
                                          ("max", HOST.reshape(4, 8).sum(1).max())])
def test_all_reduce_of_per_shard_sums(x, op, expected):
    @pw.function(out=pw.Replicate())
    def reduced(a):
        return pw.all_reduce(a.sum(), axis="data", op=op)

    torch.testing.assert_close(reduced(x).result(timeout_s=60), expected)


def test_all_gather_rebuilds_the_global_array_on_every_executor(x):
    @pw.function(out=pw.Replicate())
    def gathered(a):
        return pw.all_gather(a * 2, axis="data")

    torch.testing.assert_close(gathered(x).result(timeout_s=60), HOST * 2)


def test_reduce_scatter_keeps_each_executors_slice(x):
    @pw.function
    def scattered(a):
        return pw.reduce_scatter(a.repeat(4, 1), axis="data", op="sum")   # local (8, 4) → (2, 4)

    # Each shard's (8, 4) is its block repeated; executor i keeps rows 2i..2i+1 of the sum over shards,
    # which is the sum of the four (2, 4) blocks whatever i is.
    summed = HOST.reshape(4, 2, 4).sum(0)
    result = scattered(x).result(timeout_s=60)
    assert result.shape == (8, 4)
    torch.testing.assert_close(result, summed.repeat(4, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_reduce_scatter_gives_each_executor_its_own_slice(ctx, dtype, op):
    if dtype == torch.int64 and op == "mean":
        pytest.skip("a mean of integers is not an integer")
    mesh = ctx.mesh({"data": 4})
    whole = ctx.put(HOST.to(dtype), mesh, [pw.Replicate()])
    rank = ctx.put(torch.arange(4, dtype=dtype), mesh, [pw.Shard(0)])

    @pw.function(out=pw.Shard(0))
    def scattered(g, r):
        return pw.reduce_scatter(g * (r + 1), axis="data", op=op)   # executor i contributes g * (i + 1)

    # Sum over executors: g * (1 + 2 + 3 + 4); executor i keeps rows 2i..2i+1 (native gloo for floats,
    # all-reduce + slice for int64).
    factor = 10 if op == "sum" else 2.5
    torch.testing.assert_close(scattered(whole, rank).result(timeout_s=60), (HOST * factor).to(dtype))


def test_two_axis_mesh_reduces_along_one_axis_only(ctx):
    mesh = ctx.mesh({"data": 2, "model": 2})
    y = ctx.put(HOST, mesh, [pw.Shard(0), pw.Shard(1)])

    @pw.function(out={"data": pw.Shard(0)})
    def row_sums(a):
        return pw.all_reduce(a.sum(1), axis="model")

    torch.testing.assert_close(row_sums(y).result(timeout_s=60), HOST.sum(1))


def test_a_collective_over_a_missing_axis_names_the_mesh_axes(x):
    @pw.function
    def wrong(a):
        return pw.all_reduce(a, axis="model")

    with pytest.raises(pw.CaptureError, match=r"the mesh has axes \['data'\], not 'model'"):
        wrong(x)


def test_collectives_and_plain_calls_interleave_in_order(ctx, x):
    @pw.function(out=pw.Replicate())
    def global_sum(a):
        return pw.all_reduce(a.sum(), axis="data")

    @pw.function
    def shift(a):
        return a + 1

    value = x
    sums = []
    for _ in range(10):
        value = shift(value)
        sums.append(global_sum(value))
    for step, s in enumerate(sums, start=1):
        torch.testing.assert_close(s.result(timeout_s=60), (HOST + step).sum())
