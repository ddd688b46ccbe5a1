"""Tensor parallelism on the default backend: the proposed plans train like eager, a sequence-parallel plan too.

The models are the conformance cases (transformers' GPT-2 and Llama with GQA, a nanoGPT-style GPT,
``nn.TransformerEncoderLayer``) on ``{data: 2, model: 2}``, in float64 against single-process eager at
1e-9 (1e-4 for the transformers models, whose loss casts the logits to float32); Llama also in float32
over 20 steps at 1e-4, and a torchtitan-style plan with sequence parallelism under
``ShardedDataParallel`` with clipping. On eager executors (test_tensor_parallel_eager.py): ``{model: 2}``
too, evaluate and predict, checkpoints that reshard, recovery. The pipe x data x model mesh 2 x 1 x 2
(``pw.Pipeline(..., tensor=...)``): the nanoGPT-style GPT here, GPT-2, Llama and it on eager executors. TP inside
islands with data parallelism across them: test_islands.py (eager executors).
"""

from __future__ import annotations

import gc

import pytest
import torch

import pathways_torch as pw
from tests.models.cases import CASES, _loss, _tokens
from tests.unit.test_tensor_parallel import _llama_sequence_parallel_plan

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CASE = {c.name: c for c in CASES}
MESHES = {"1x2": {"model": 2}, "2x2": {"data": 2, "model": 2}, "2x1x2": {"pipe": 2, "data": 1, "model": 2}}
PIPELINE_NAMES = ["hf-gpt2", "hf-llama", "nanogpt"]     # models with a block list to cut into stages
# transformers' causal-LM loss casts the logits to float32 (ForCausalLMLoss): in float64 they agree to its rounding,
# which Adam's steps carry into the parameters (DataParallel alone: 1.6e-5 on Llama's, on the default backend).
HF_FLOAT64 = 1e-4


@pytest.fixture(scope="module")
def ctx():
    with pw.Context(num_executors=4) as ctx:     # the default backend; eager executors: test_tensor_parallel_eager.py
        yield ctx


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, eps=1e-6)


def _oracle(make_model, batches, loss_fn, max_grad_norm=None):
    model = make_model()
    optimizer = _adamw(model)
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = _loss(model, loss_fn, batch)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _relative(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _tensor_parallel(model, mesh: dict, data=None, plan=None):
    """TensorParallel with the proposed plan on ``mesh``; on a mesh with a pipe axis, a pipeline of 2 microbatches
    whose stages it splits."""
    plan = plan if plan is not None else pw.tensor_parallel_plan(model, mesh["model"])
    data = data if data is not None else pw.DataParallel("data") if "data" in mesh else None
    if "pipe" in mesh:
        return pw.Pipeline(microbatches=2, data=data, tensor=pw.TensorParallel(plan))
    return pw.TensorParallel(plan, data=data)


def _train(ctx, make_model, batches, loss_fn, mesh: dict, **options):
    model = make_model()
    plan = options.pop("plan", None) or _tensor_parallel(model, mesh, options.pop("data", None))
    trainer = ctx.wrap(model, optimizer=_adamw(model), loss_fn=loss_fn, mesh=ctx.mesh(mesh), plan=plan, **options)
    losses = [loss.result(240).item() for loss in [trainer.step(b) for b in batches]]
    return losses, trainer.state_dict()["model"], trainer


NAMES = ["hf-gpt2", "hf-llama", "nanogpt", "torch-transformer"]
# On the default backend at 2 x 2: the nanoGPT-style GPT's plan runs there on 2 x 1 x 2 and inside islands (below), and
# every model's on eager executors at 1 x 2 and 2 x 2 (test_tensor_parallel_eager.py).
DEFAULT_BACKEND_NAMES = ["hf-gpt2", "hf-llama", "torch-transformer"]


@pytest.mark.parametrize("name", DEFAULT_BACKEND_NAMES)
def test_the_proposed_plan_trains_like_eager_in_float64_on_2x2(ctx, name):
    check_trains_like_eager_in_float64(ctx, name, "2x2")      # 1 x 2 too on eager executors (each mesh a compile)


def check_trains_like_eager_in_float64(ctx, name: str, mesh: str) -> None:
    case = CASE[name]

    def make_model():
        return case.make_model().double()
    expected_losses, expected = _oracle(make_model, case.batches(), case.loss_fn)
    losses, state, trainer = _train(ctx, make_model, case.batches(), case.loss_fn, MESHES[mesh])
    tolerance = HF_FLOAT64 if name.startswith("hf-") else 1e-9
    assert _relative(losses, expected_losses) < tolerance, (losses, expected_losses)
    for param, value in expected.items():
        assert _relative(state[param], value) < tolerance, param
    assert "Shard(" in str(trainer.runner.placements)
    if "pipe" in MESHES[mesh]:
        assert trainer.runner.stages.startswith("2 chunks") and not any(ctx.backend_counters("fallback_ops").values())
        return
    assert not ctx.backend_counters("fallback_ops").get(trainer.runner.function.name, 0)   # 0 ops outside XLA
    if name == "hf-llama":
        # Megatron's count, explicit in the program: per block 2 all-reduces forward (after o_proj and
        # down_proj) and 2 backward (one for q, k, v's shared input, one for gate and up's); the vocabulary
        # embedding's forward, the head's input backward, and the head's logits gathered.
        assert collectives(trainer, "model") == {"all_reduce": 2 * 4 + 2, "all_gather": 1}


def test_nanogpt_trains_like_eager_in_float64_on_pipe_data_model_2x1x2(ctx):
    # One model here: GPT-2 and Llama on 2 x 1 x 2, and all three on 1 x 2, run on eager executors
    # (test_tensor_parallel_eager.py); GPT-2's and Llama's pipeline stages compile on this backend in
    # tests/models/test_pipeline_models.py, and their tensor-parallel steps on 2 x 2 above.
    check_trains_like_eager_in_float64(ctx, "nanogpt", "2x1x2")


def collectives(trainer, axis: str) -> dict:
    """How many of each collective the trainer's captured step runs over ``axis``."""
    (version,) = trainer.runner.function.traces.values()
    counts: dict = {}
    for node in version.graph_module.graph.nodes:
        name = str(node.target).removeprefix("pathways.").split(".")[0]
        if node.op == "call_function" and str(node.target).startswith("pathways.") and axis in node.args:
            counts[name] = counts.get(name, 0) + 1
    return counts


def test_float32_over_20_steps_stays_within_1e_4_of_eager_without_drift(ctx):
    case = CASE["hf-llama"]
    batches = [{"input_ids": t, "labels": t} for t in (_tokens(s) for s in range(20))]
    expected_losses, expected = _oracle(case.make_model, batches, None)
    losses, state, _ = _train(ctx, case.make_model, batches, None, MESHES["2x2"])
    errors = [abs(a - b) / abs(b) for a, b in zip(losses, expected_losses)]
    assert max(errors) < 1e-4, errors
    assert max(errors[-5:]) < 1e-4 and max(errors[-5:]) <= 10 * max(max(errors[:5]), 1e-7), errors   # no drift
    assert max(_relative(state[n], v) for n, v in expected.items()) < 1e-3


def test_sequence_parallel_plan_under_sharded_data_parallel_with_clipping_matches_eager(ctx):
    case = CASE["hf-llama"]

    def make_model():
        return case.make_model().double()
    expected_losses, expected = _oracle(make_model, case.batches(), None, max_grad_norm=0.05)
    model = make_model()
    plan = pw.TensorParallel(_llama_sequence_parallel_plan(), data=pw.ShardedDataParallel("data"))
    trainer = ctx.wrap(model, optimizer=_adamw(model), mesh=ctx.mesh(MESHES["2x2"]), plan=plan, max_grad_norm=0.05)
    losses = [loss.result(240).item() for loss in [trainer.step(b) for b in case.batches()]]
    assert _relative(losses, expected_losses) < HF_FLOAT64
    state = trainer.state_dict()["model"]
    assert max(_relative(state[n], v) for n, v in expected.items()) < HF_FLOAT64
    placements = str(trainer.runner.placements)
    assert "model.norm.weight" in placements and "gradient summed over the axis" in placements


def test_bad_plans_are_refused_before_anything_is_sent(ctx):
    from torch.distributed.tensor.parallel import ColwiseParallel

    gc.collect()
    before = [e["store_bytes"] for e in ctx.stats()["executors"].values()]
    model = CASE["hf-llama"].make_model()
    fresh = CASE["hf-llama"].make_model()
    for plan, match in (({"model.layers.*.q_proj": ColwiseParallel()}, "matches no module"),
                        ({"model.layers.*.self_attn.q_proj": ColwiseParallel(use_local_output=False)},
                         "use_local_output=False")):
        with pytest.raises(pw.PlacementError, match=match):
            ctx.wrap(model, optimizer=_adamw(model), mesh=ctx.mesh(MESHES["2x2"]),
                     plan=pw.TensorParallel(plan, data=pw.DataParallel("data")))
    with pytest.raises(pw.PlacementError, match=r"num_key_value_heads: the head count is 2, not divisible by the 4"):
        ctx.wrap(model, optimizer=_adamw(model), mesh=ctx.mesh({"model": 4}),
                 plan=pw.TensorParallel(pw.tensor_parallel_plan(model)))
    gc.collect()
    assert [e["store_bytes"] for e in ctx.stats()["executors"].values()] == before    # nothing was put
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def _gpt2_batches(count):
    return [{"input_ids": t, "labels": t} for t in (_tokens(s) for s in range(count))]


def check_islands_trainer(ctx, make_model, case, data, clip, batches=None):
    """Train ``case`` under TP inside 2 islands (1 data shard x 2 model shards each), ``data`` across them."""
    model = make_model()
    plan = pw.TensorParallel(pw.tensor_parallel_plan(model, 2), data=data(("island", "data")))
    trainer = ctx.wrap(model, optimizer=_adamw(model), loss_fn=case.loss_fn, plan=plan, max_grad_norm=clip,
                       mesh=ctx.mesh({"island": 2, "data": 1, "model": 2}))
    losses = [loss.result(240).item() for loss in [trainer.step(b) for b in batches or case.batches()]]
    return losses, trainer.state_dict()["model"], trainer
