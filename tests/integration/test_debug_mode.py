"""Debug mode catches an output declared Replicate() whose shards differ."""

from __future__ import annotations

import pytest
import torch

import pathways_torch as pw

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def ctx():
    with pw.Context(num_executors=2, debug=True, backend="eager") as context:
        yield context


def test_replicate_declared_over_differing_shards_is_caught(ctx):
    mesh = ctx.mesh({"data": 2})
    x = ctx.put(torch.arange(8, dtype=torch.float32), mesh, [pw.Shard(0)])

    @pw.function(out=pw.Replicate())
    def wrong_total(a):
        return a.sum()        # a per-shard sum, not a global one: the shards differ

    with pytest.raises(pw.ReplicationError, match="declared Replicate"):
        wrong_total(x).result(timeout_s=30)


def test_replicate_over_equal_shards_passes(ctx):
    mesh = ctx.mesh({"data": 2})
    w = ctx.put(torch.arange(6, dtype=torch.float32), mesh, [pw.Replicate()])

    @pw.function(out=pw.Replicate())
    def scaled(a):
        return a * 3

    torch.testing.assert_close(scaled(w).result(timeout_s=30), torch.arange(6, dtype=torch.float32) * 3)


def test_a_program_output_declared_replicate_over_differing_shards_is_caught(ctx):
    mesh = ctx.mesh({"data": 2})
    x = ctx.put(torch.arange(8, dtype=torch.float32), mesh, [pw.Shard(0)])
    double = pw.function(lambda a: a * 2, name="double")

    @pw.function(out=pw.Replicate())
    def shard_total(a):
        return a.sum()        # a per-shard sum: the shards differ

    @pw.function(out=pw.Replicate())
    def global_total(a):
        return pw.all_reduce(a.sum(), axis="data")

    @pw.program
    def totals(a):
        doubled = double(a)
        return doubled, shard_total(doubled), global_total(doubled)

    doubled, wrong, right = totals(x)
    torch.testing.assert_close(doubled.result(timeout_s=30), torch.arange(8, dtype=torch.float32) * 2)
    torch.testing.assert_close(right.result(timeout_s=30), torch.tensor(56.0))
    with pytest.raises(pw.ReplicationError, match="declared Replicate"):
        wrong.result(timeout_s=30)
