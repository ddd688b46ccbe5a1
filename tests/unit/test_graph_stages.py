"""Cutting an aten graph into compiled and host stages (executor/backends/graph_stages.py), tested as text."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import pathways_torch.wire.collective_ops  # noqa: F401  (registers the pathways:: ops)
from executor.backends.graph_stages import split_stages

pytestmark = [pytest.mark.compat, pytest.mark.timeout(60)]


def _plan(fn, shapes, lowerable, collective_refusal=None, dtype=torch.float32):
    inputs = [torch.randn(s).to(dtype) for s in shapes]
    graph = make_fx(fn, tracing_mode="fake")(*inputs)
    return split_stages(graph, [torch.empty(s, device="meta", dtype=dtype) for s in shapes], lowerable,
                        collective_refusal=collective_refusal)


def _everything(op) -> bool:
    return True


def test_a_graph_without_host_ops_is_one_stage():
    plan = _plan(lambda x, w: (torch.relu(x @ w), x.sum()), [(4, 3), (3, 2)], _everything)
    assert plan.single_jax_stage()
    assert str(plan) == "\n".join([
        "inputs 0..1, constants 0",
        "stage 0 jax: [0, 1] -> [2, 3] (3 ops)",      # mm, relu, sum
        "outputs [2, 3]"])


def test_collectives_and_ops_without_a_lowering_cut_the_graph():
    def step(x, w):
        y = torch.relu(x @ w)
        total = torch.ops.pathways.all_reduce(y, "data", "sum")
        values, _ = torch.sort(total, dim=0)     # "no lowering" below, and no torch decomposition
        return values * 2, y.sum()

    plan = _plan(step, [(4, 3), (3, 2)], lambda op: op is not torch.ops.aten.sort.default)
    assert not plan.single_jax_stage()
    # y (slot 2) is made once, before the cut, and read again by the last stage (y.sum(), traced there).
    assert str(plan) == "\n".join([
        "inputs 0..1, constants 0",
        "stage 0 jax: [0, 1] -> [2] (2 ops)",
        "stage 1 collective: [2] -> [3] (all_reduce.default: no custom call for collectives here)",
        "stage 2 fallback: [3] -> [4] (sort.default)",
        "stage 3 jax: [4, 2] -> [5, 6] (2 ops)",
        "outputs [5, 6]"])
    assert [s.node_names for s in plan.stages] == [["mm.default", "relu.default"], ["all_reduce.default"],
                                                   ["sort.default"], ["mul.Tensor", "sum.default"]]


def _two_collectives(x):
    total = torch.ops.pathways.all_reduce((x * x).sum(), "data", "mean")
    return torch.ops.pathways.all_gather(x, "data", 2, -1) / total


def test_collectives_a_custom_call_takes_stay_inside_the_compiled_stage():
    from executor.backends.xla_collectives import why_not_compiled

    plan = _plan(_two_collectives, [(4, 3)], _everything, why_not_compiled)
    assert plan.single_jax_stage(), str(plan)
    assert str(plan) == "\n".join([
        "inputs 0..0, constants 0",
        "stage 0 jax: [0] -> [1] (5 ops, 2 collective(s) inside)",   # mul, sum, all_reduce, all_gather, div
        "outputs [1]"])


def test_a_collective_no_custom_call_takes_cuts_the_graph_and_says_why():
    from executor.backends.xla_collectives import why_not_compiled

    # A mean of int64 values is a float: it stays on the host, as torch computes it; the gather goes inside.
    plan = _plan(_two_collectives, [(4, 3)], _everything, why_not_compiled, dtype=torch.int64)
    assert str(plan) == "\n".join([
        "inputs 0..0, constants 0",
        "stage 0 jax: [0] -> [1] (2 ops)",
        "stage 1 collective: [1] -> [2] (all_reduce.default: a mean of integers is a float of another dtype)",
        "stage 2 jax: [0, 2] -> [3] (2 ops, 1 collective(s) inside)",
        "outputs [3]"])


def test_an_op_with_a_torch_decomposition_is_decomposed_not_cut():
    plan = _plan(lambda x: torch.cumsum(x, 0) + 1, [(5,)], lambda op: op is not torch.ops.aten.cumsum.default)
    assert plan.single_jax_stage(), str(plan)
    ops = [str(n.target) for n in plan.stages[0].graph_module.graph.nodes if n.op == "call_function"]
    assert "aten.cumsum.default" not in ops, ops
