"""Tensor parallelism in one process: plans read and checked, the lowering's gradients against eager, shards.

The lowering runs for real here: each model shard is a thread, and the ``pathways::`` collectives go
through an in-process runtime that meets the threads at a barrier (`ThreadedCollectives`). Every shard's
loss and joined gradients must equal the whole model's in eager PyTorch (float64, 1e-10). The plans are
the ones `pw.tensor_parallel_plan` proposes for the conformance cases, and a torchtitan-style plan with
sequence parallelism.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import pathways_torch as pw
from pathways_torch.collectives import tracing_mesh
from pathways_torch.tensor_parallel.assign import assign
from pathways_torch.tensor_parallel.lowering import Lowered
from pathways_torch.tensor_parallel.shards import join, shard_of
from pathways_torch.wire import collective_ops
from tests.models.cases import CASES, _loss

pytestmark = pytest.mark.timeout(120)

CASE = {c.name: c for c in CASES}


class ThreadedCollectives:
    """The collectives of ``size`` shards that are threads of this process (each knows its rank)."""

    def __init__(self, size: int):
        self.size, self.local = size, threading.local()
        self.barrier, self.slots = threading.Barrier(size), [None] * size

    def run(self, name, x, axis, **kwargs):
        rank = self.local.rank
        self.slots[rank] = x.clone()
        self.barrier.wait()
        xs = list(self.slots)
        self.barrier.wait()
        if name == "all_gather":
            return torch.cat(xs, kwargs["dim"])
        total = sum(xs)
        if name == "all_reduce":
            return total
        return total.chunk(self.size, kwargs["dim"])[rank].contiguous()


def _eager(model, case, batch):
    loss = _loss(model, case.loss_fn, batch)
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(loss, [p for _, p in model.named_parameters()])
    return loss.detach(), dict(zip(names, grads))


def _sharded(model, case, batch, plan, size: int):
    """Every shard's loss and its local gradients, each shard a thread running the lowered forward."""
    tensor_plan = assign(model, plan, "model", size)
    runtime = ThreadedCollectives(size)
    results, errors = [None] * size, []
    full = dict(model.named_parameters())

    def shard(rank: int):
        runtime.local.rank = rank
        try:
            with tracing_mesh({"model": size}):
                params = {n: shard_of(p.detach(), tensor_plan.split_of(n), size, rank).requires_grad_()
                          for n, p in full.items()}
                replica = copy.deepcopy(model)     # the lowering changes a module while it runs: one per thread
                with Lowered(replica, tensor_plan, torch.tensor([rank])):
                    loss = _functional_loss(replica, params, case, batch)
                grads = torch.autograd.grad(loss, list(params.values()))
                results[rank] = (loss.detach(), dict(zip(params, grads)))
        except BaseException as exc:   # noqa: BLE001 - reported by the test
            errors.append(exc)
            runtime.barrier.abort()

    previous = collective_ops._runtime
    collective_ops.set_runtime(runtime)
    try:
        threads = [threading.Thread(target=shard, args=(r,)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        collective_ops.set_runtime(previous)
    if errors:
        raise errors[0]
    return tensor_plan, results


def _functional_loss(model, params, case, batch):
    from torch.func import functional_call

    from pathways_torch.training.batches import loss_from_output

    if isinstance(batch, dict):
        return loss_from_output(functional_call(model, params, (), batch), model)
    *inputs, target = batch
    if case.loss_fn is None:
        return loss_from_output(functional_call(model, params, tuple(batch)), model)
    return case.loss_fn(functional_call(model, params, tuple(inputs)), target)


def _check_gradients(tensor_plan, results, expected, expected_loss) -> None:
    """Each shard's loss is eager's; split gradients join into eager's; a whole parameter's gradient is eager's on
    every shard (summed over the shards when it is a partial sum)."""
    for loss, _ in results:
        assert torch.allclose(loss, expected_loss, rtol=1e-10, atol=0)
    for name, grad in expected.items():
        split = tensor_plan.split_of(name)
        pieces = [grads[name] for _, grads in results]
        if split.dim is not None:
            got = [join(pieces, split)]
        elif split.partial_grad:
            got = [sum(pieces)]
        else:
            got = pieces          # every shard must hold the same, whole gradient
        for value in got:
            assert torch.allclose(value, grad, rtol=1e-9, atol=1e-12), name


def _double(case):
    model = case.make_model().double()
    batch = case.batches()[0]
    return model, batch


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama", "nanogpt", "torch-transformer"])
def test_the_proposed_plan_gives_every_shard_the_eager_loss_and_its_slice_of_the_gradient(name):
    case = CASE[name]
    model, batch = _double(case)
    expected_loss, expected = _eager(model, case, batch)
    plan = pw.tensor_parallel_plan(model, 2)
    tensor_plan, results = _sharded(model, case, batch, plan, 2)
    assert any(s.dim is not None for s in tensor_plan.splits.values())
    _check_gradients(tensor_plan, results, expected, expected_loss)


def _llama_sequence_parallel_plan():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "model.layers.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),)),
        "model.layers.*.input_layernorm": SequenceParallel(),
        "model.layers.*.self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                       desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "model.layers.*.self_attn.[qkv]_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "model.layers.*.post_attention_layernorm": SequenceParallel(),
        "model.layers.*.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def test_a_torchtitan_style_sequence_parallel_plan_sums_the_norms_partial_gradients():
    case = CASE["hf-llama"]
    model, batch = _double(case)
    expected_loss, expected = _eager(model, case, batch)
    tensor_plan, results = _sharded(model, case, batch, _llama_sequence_parallel_plan(), 2)
    norm = "model.layers.0.input_layernorm.weight"
    assert tensor_plan.split_of(norm).partial_grad
    _check_gradients(tensor_plan, results, expected, expected_loss)


def test_prepare_module_output_and_input_output_move_a_module_s_outputs():
    """Row-parallel outputs reduce-scattered on the sequence, then gathered whole by the enclosing module's
    PrepareModuleOutput (the MLP) and PrepareModuleInputOutput (attention, whose output is a tuple)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInputOutput, PrepareModuleOutput,
                                                   RowwiseParallel)

    case = CASE["hf-llama"]
    model, batch = _double(case)
    expected_loss, expected = _eager(model, case, batch)
    plan = {
        "model.layers.*.self_attn.[qkv]_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "model.layers.*.self_attn": PrepareModuleInputOutput(
            input_kwarg_layouts={"hidden_states": Replicate()}, desired_input_kwarg_layouts={"hidden_states":
                                                                                           Replicate()},
            output_layouts=(Shard(1), None), desired_output_layouts=(Replicate(), None)),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(), "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        "model.layers.*.mlp": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()),
    }
    tensor_plan, results = _sharded(model, case, batch, plan, 2)
    _check_gradients(tensor_plan, results, expected, expected_loss)


@pytest.mark.parametrize("dim", [1, -1])
def test_a_row_parallel_bias_under_a_split_output_learns_from_every_shard(dim):
    """nanoGPT's MLP output reduce-scattered on the sequence (1) or the features (-1), then gathered whole: the
    bias is added after the reduction (sliced with the features), its gradient summed over the shards."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleOutput, RowwiseParallel

    case = CASE["nanogpt"]
    model, batch = _double(case)
    expected_loss, expected = _eager(model, case, batch)
    plan = {"blocks.*.mlp.0": ColwiseParallel(), "blocks.*.mlp.2": RowwiseParallel(output_layouts=Shard(dim)),
            "blocks.*.mlp": PrepareModuleOutput(output_layouts=Shard(dim), desired_output_layouts=Replicate())}
    tensor_plan, results = _sharded(model, case, batch, plan, 2)
    assert tensor_plan.split_of("blocks.0.mlp.2.bias").partial_grad
    _check_gradients(tensor_plan, results, expected, expected_loss)


def test_placements_print_each_module_style_and_each_parameter():
    model = CASE["hf-gpt2"].make_model()
    text = str(assign(model, pw.tensor_parallel_plan(model, 2), "model", 2))
    assert "transformer.h.0.attn.c_attn: colwise(in R -> out S(-1), 3 chunks)" in text
    assert "transformer.h.0.attn: sizes(split_size / size)" in text
    lines = {line.split()[0]: line for line in text.splitlines()[1:] if not line.startswith("  transformer.h.0.")
             or "[" in line}
    assert "[32, 96] -> [32, 48]  model: Shard(1) in 3 chunks" in lines["transformer.h.0.attn.c_attn.weight"]
    assert "[32, 32] -> [16, 32]  model: Shard(0)" in lines["transformer.h.0.attn.c_proj.weight"]
    assert "[32] -> [32]  model: Replicate()" in lines["transformer.h.0.attn.c_proj.bias"]


def test_the_proposal_prints_each_pattern_with_its_reason_and_what_it_left_whole():
    text = str(pw.tensor_parallel_plan(CASE["hf-llama"].make_model(), 2))
    assert "model.layers.*.self_attn.k_proj  ColwiseParallel()  # attention: its heads split" in text
    assert "model.layers.*.mlp.down_proj     RowwiseParallel()  # gated MLP output: reduced" in text
    assert "lm_head                          ColwiseParallel(output_layouts=Replicate())" in text
    gpt2 = str(pw.tensor_parallel_plan(CASE["hf-gpt2"].make_model(), 2))
    assert "(whole) transformer.wte: the vocabulary embedding holds 6% of the parameters" in gpt2
    assert "transformer.h.*.attn.c_attn  FusedColwiseParallel(chunks=3)" in gpt2
    odd = str(pw.tensor_parallel_plan(CASE["hf-llama"].make_model(), 5))
    assert "model.embed_tokens: the vocabulary 48 is not divisible by 5" in odd


@pytest.mark.parametrize("split, shape", [(0, (6, 4)), (1, (4, 12)), (-1, (2, 3, 12))])
@pytest.mark.parametrize("chunks", [1, 3])
def test_a_parameter_split_in_chunks_joins_back_whole(split, shape, chunks):
    from pathways_torch.tensor_parallel.assign import ParamSplit

    whole = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
    rule = ParamSplit(split, chunks if shape[split] % (2 * chunks) == 0 else 1)
    pieces = [shard_of(whole, rule, 2, r) for r in range(2)]
    assert torch.equal(join(pieces, rule), whole)
    if rule.chunks == 3:      # shard 0 holds the first half of every chunk
        first = whole.movedim(split, 0)[: shape[split] // 6].movedim(0, split)
        assert torch.equal(pieces[0].movedim(split, 0)[: shape[split] // 6].movedim(0, split), first)


def test_placed_flats_come_back_per_model_shard_on_a_2d_mesh_with_sharded_data():
    from pathways_torch.placement import Shard, normalize_placements
    from pathways_torch.tensor_parallel.shards import flats_of, placed_flat

    class FakeMesh:
        def __init__(self, axes):
            self.axes = dict(axes)
            self.size = 1
            for n in self.axes.values():
                self.size *= n

        def coords(self, position):
            out = []
            for n in reversed(list(self.axes.values())):
                out.append(position % n)
                position //= n
            return tuple(reversed(out))

    from pathways_torch.placement import split_blocks

    for axes in ({"data": 2, "model": 2}, {"model": 2, "data": 3}):
        mesh = FakeMesh(axes)
        names = list(axes)
        for data_placement in (Shard(0), None):       # a sharded data plan, and a replicated one
            placement = normalize_placements({"model": Shard(0), **({"data": data_placement} if data_placement
                                                                     else {})}, mesh)
            flats = [torch.arange(12, dtype=torch.float64) + 100 * m for m in range(2)]
            whole = placed_flat(flats, placement, mesh, "model")
            assert all(torch.equal(a, b) for a, b in zip(flats_of(whole, placement, mesh, "model", 2), flats))
            for position, block in enumerate(split_blocks(whole, placement, mesh)):   # what each executor gets
                coords = dict(zip(names, mesh.coords(position)))
                mine = flats[coords["model"]]
                if data_placement is not None:
                    mine = mine.chunk(axes["data"])[coords["data"]]
                assert torch.equal(block, mine), (axes, position)


def test_bad_plans_are_refused_naming_what_to_change():
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = CASE["hf-llama"].make_model()
    cases = [
        ({"model.layers.*.self_atn.q_proj": ColwiseParallel()}, r"matches no module .* nearest module paths are "
                                                                  r"\[.*self_attn"),
        ({"model.layers.*.self_attn.q_proj": ColwiseParallel(use_local_output=False)}, "use_local_output=False"),
        ({"model.layers.*.self_attn": ColwiseParallel()}, "this module is a LlamaAttention"),
        ({"model.layers.*.mlp.up_proj": RowwiseParallel(input_layouts=Partial())}, "Partial"),
        ({"model.layers.*.self_attn.q_proj": "colwise"}, "expected one of"),
        ({"model.embed_tokens": RowwiseParallel(), "lm_head": RowwiseParallel()}, None),
    ]
    for plan, match in cases:
        if match is None:
            assign(model, plan, "model", 2)      # a legal, if odd, plan
            continue
        with pytest.raises(pw.PlacementError, match=match):
            assign(model, plan, "model", 2)
    with pytest.raises(pw.PlacementError, match=r"model.layers.0.mlp.up_proj.weight: dim 0 of shape \[64, 32\] "
                                                 r"is 64, not divisible by the 3 shards of axis 'model'"):
        assign(model, {"model.layers.*.mlp.up_proj": ColwiseParallel()}, "model", 3)
    with pytest.raises(pw.PlacementError, match=r"config.num_key_value_heads: the head count is 2, not divisible "
                                                 r"by the 4 shards"):
        assign(model, {"model.layers.*.self_attn.q_proj": ColwiseParallel()}, "model", 4)


def test_layouts_for_what_a_module_does_not_take_or_return_are_refused_when_captured():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, PrepareModuleOutput

    case = CASE["nanogpt"]
    model, batch = _double(case)
    two_inputs = {"blocks.*.mlp": PrepareModuleInput(input_layouts=(Replicate(), Replicate()),
                                                     desired_input_layouts=(Shard(1), Shard(1)))}
    with pytest.raises(pw.CaptureError, match=r"input_layouts names 2 positional inputs, the module was called "
                                              r"with 1"):
        _sharded(model, case, batch, two_inputs, 2)
    not_a_tensor = {"blocks.*.attn.c_attn": PrepareModuleOutput(output_layouts=(Shard(1), Shard(1)),
                                                                desired_output_layouts=(Replicate(), Replicate()))}
    with pytest.raises(pw.CaptureError, match=r"output_layouts names 2 outputs, the module returned a Tensor"):
        _sharded(model, case, batch, not_a_tensor, 2)
    with pytest.raises(pw.PlacementError, match=r"with max_norm set is refused: a row is renormalised as a whole"):
        assign(torch.nn.Sequential(torch.nn.Embedding(8, 4, max_norm=1.0)), {"0": ColwiseParallel()}, "model", 2)


def test_a_tied_parameter_split_two_ways_is_refused():
    from torch.distributed.tensor.parallel import ColwiseParallel

    model = CASE["nanogpt"].make_model()      # lm_head.weight is wte.weight
    with pytest.raises(pw.PlacementError, match=r"wte.weight \(tied: another module holds it too\), reached from lm_head: the plan "
                                                 r"splits it "
                                                 r"as Shard\(1\) and as Shard\(0\)"):
        assign(model, {"wte": ColwiseParallel(), "lm_head": ColwiseParallel()}, "model", 2)
