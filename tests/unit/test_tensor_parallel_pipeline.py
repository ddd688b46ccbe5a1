"""Tensor parallelism inside pipeline stages, before any executor: the layout moves survive the cut into chunks.

A pipeline traces the forward to aten, cuts it, and derives each chunk's backward from that graph
(`pipeline.autograd`). The moves are ``pathways_tp::`` ops whose gradient rules are registered on the op, so
each chunk's forward holds Megatron's f (``enter``) and g (``reduce``), and its backward the all-reduce of
each f's gradient: counted here as text, per chunk, for a nanoGPT-style GPT of two blocks on two stages.
A captured step holds none of them: `capture` decomposes each into ``pathways::`` collectives.
"""

from __future__ import annotations

import collections

import pytest
import torch

import pathways_torch as pw
from pathways_torch.pipeline.autograd import partition_chunk
from pathways_torch.pipeline.split import split_model
from pathways_torch.pipeline.tensor import StageTensor
from pathways_torch.tensor_parallel.assign import assign
from pathways_torch.training.batches import split_batch
from tests.models.cases import CASES

pytestmark = pytest.mark.timeout(120)


def _moves(graph_module) -> dict:
    counts = collections.Counter(str(n.target).split(".")[1] for n in graph_module.graph.nodes
                                 if n.op == "call_function" and str(n.target).startswith("pathways_tp."))
    return dict(sorted(counts.items()))


def _split_nanogpt():
    case = next(c for c in CASES if c.name == "nanogpt")
    model = case.make_model().double()
    tensor = StageTensor(assign(model, pw.tensor_parallel_plan(model, 2), "model", 2))
    form, leaves = split_batch(case.batches()[0])
    names = [n for n, _ in model.named_parameters()]
    split = split_model(model, None, form, leaves, trained=names, constants=[], num_chunks=2, tensor=tensor)
    return model, tensor, split, leaves


def test_each_chunk_carries_its_moves_forward_and_their_gradients_backward():
    model, tensor, split, leaves = _split_nanogpt()
    assert split.rank_leaf == len(leaves) + 1 and split.rng_leaf == len(leaves)
    params = dict(model.named_parameters())
    examples = [*leaves, torch.zeros((1, 2), dtype=torch.int64), torch.zeros((1,), dtype=torch.int64)]
    found = []
    for chunk in split.chunks:
        inputs = [torch.empty(tensor.local_shape(n), dtype=params[n].dtype) for n in chunk.params]
        inputs += [examples[i] for i in chunk.batch_leaves]
        inputs += [torch.empty(split.value_layouts[v][0], dtype=split.value_layouts[v][1]) for v in chunk.incoming]
        parts = partition_chunk(chunk, inputs, set(range(len(chunk.params))), 0.5)
        found.append((_moves(parts.forward), _moves(parts.backward)))
    # One block per chunk: f and g around attention and around the MLP; the backward all-reduces each f's
    # gradient (g's passes through). The last chunk's head is whole (the proposal leaves a tied head whole).
    assert found == [({"enter": 2, "reduce": 2}, {"reduce": 2}), ({"enter": 2, "reduce": 2}, {"reduce": 2})]


def test_a_captured_chunk_runs_pathways_collectives_not_the_moves():
    import importlib

    from pathways_torch.capture import DECOMPOSITIONS

    importlib.import_module("pathways_torch.stop_gradient")     # defines its op, and registers how to run it

    assert {str(op) for op in DECOMPOSITIONS} >= {"pathways_tp.enter.default", "pathways_tp.reduce.default",
                                                  "pathways_tp.gather.default", "pathways_tp.slice.default",
                                                  "pathways_tp.reduce_scatter.default",
                                                  "pathways_graph.stop_gradient.default"}


def test_a_pipeline_refuses_a_tensor_plan_with_its_own_data_axis_and_a_mesh_without_the_model_axis():
    plan = {"fc": pw.FusedColwiseParallel(chunks=1)}
    with pytest.raises(pw.PlacementError, match="pass data= to pw.Pipeline instead"):
        pw.Pipeline(tensor=pw.TensorParallel(plan, data=pw.DataParallel("data")))
    with pytest.raises(pw.PlacementError, match="tensor must be None or pw.TensorParallel"):
        pw.Pipeline(tensor=plan)

    class Mesh:
        axes = {"pipe": 2, "data": 2}
    with pytest.raises(pw.PlacementError, match="splits layers over axis 'model'; the mesh has axes"):
        pw.Pipeline(tensor=pw.TensorParallel(plan)).check(Mesh())
