"""Model code written elsewhere trains under pw.Pipeline as in eager PyTorch: Hugging Face GPT-2 (its
``self.h`` blocks, its tied head) and Llama, nanoGPT, the example Transformer; on the default backend and
on eager executors, 2 stages x 2 microbatches; and a 50-step float32 drift check of the interleaved
schedule on the default backend."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import pathways_torch as pw
from tests.conftest import REPO_ROOT, train_eagerly
from tests.models.cases import CASES, eager_oracle
from tests.models.test_conformance import _adamw, _relative

sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
from transformer import DecoderOnlyTransformer, ReverseTask, TransformerConfig, loss_fn  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PIPELINE_CASES = [c for c in CASES if c.name in ("hf-gpt2", "hf-llama", "nanogpt")]


@pytest.fixture(scope="module", params=["default", "eager"])
def ctx(request):
    backend = None if request.param == "default" else "eager"
    with pw.Context(num_executors=2, backend=backend) as ctx:
        yield ctx


@pytest.mark.parametrize("case", PIPELINE_CASES, ids=[c.name for c in PIPELINE_CASES])
def test_trains_like_the_oracle_in_two_stages(ctx, case):
    expected_losses, expected_params = eager_oracle(case, _adamw)
    model = case.make_model()
    trainer = ctx.wrap(model, optimizer=_adamw(model), loss_fn=case.loss_fn, mesh=ctx.mesh({"pipe": 2}),
                       plan=pw.Pipeline(microbatches=2, schedule="1f1b"))
    losses = [loss.result(240).item() for loss in [trainer.step(b) for b in case.batches()]]
    assert _relative(losses, expected_losses) < case.tolerance, (ctx.backend, losses, expected_losses)
    state = trainer.state_dict()["model"]
    for name, value in expected_params.items():
        assert _relative(state[name], value) < case.tolerance, (ctx.backend, name)


def test_tied_head_stays_equal_to_the_embedding(ctx):
    case = next(c for c in CASES if c.name == "hf-gpt2")
    model = case.make_model()
    trainer = ctx.wrap(model, optimizer=_adamw(model), loss_fn=None, mesh=ctx.mesh({"pipe": 2}),
                       plan=pw.Pipeline(microbatches=2))
    for batch in case.batches():
        trainer.step(batch)
    assert "shared with another chunk: transformer.wte.weight" in trainer.runner.stages
    chunks = trainer.runner.chunk_state
    first, last = chunks[0][0], chunks[-1][0]   # the flat buckets of the first and the last chunk
    plans = trainer.runner.train_plans()
    copies = []
    for plan, flats in ((plans[0], first), (plans[-1], last)):
        from pathways_torch.training.buckets import unflatten

        for bucket, flat in zip(plan.buckets, flats):
            named = unflatten(bucket, flat.result())
            if "transformer.wte.weight" in named:
                copies.append(named["transformer.wte.weight"].clone())
    assert len(copies) == 2
    assert torch.equal(copies[0], copies[1])


CFG = TransformerConfig(vocab=12, length=6, width=16, depth=4, heads=2)


# The float64 matrix (tests/integration/test_pipeline.py) checks every schedule against eager; the float32 drift
# check runs the interleaved schedule alone: its virtual stages cut the model into twice the chunks of 1F1B's
# (GPipe's and 1F1B's), each a computation that 1F1B also runs in the float64 matrix.
@pytest.mark.parametrize("schedule", ["interleaved"])
def test_example_transformer_fifty_steps_no_drift(ctx, schedule):
    if ctx.backend == "eager":
        pytest.skip("the drift check is for the default backend; eager runs the float64 matrix")
    task = ReverseTask(CFG, seed=3)
    batches = [task.batch(i, 8) for i in range(50)]
    torch.manual_seed(0)
    reference = DecoderOnlyTransformer(CFG)
    torch.manual_seed(0)
    model = DecoderOnlyTransformer(CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    expected = train_eagerly(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3, eps=1e-6), batches,
                             loss_fn)
    virtual = 2 if schedule == "interleaved" else 1
    trainer = ctx.wrap(model, optimizer=optimizer, loss_fn=loss_fn, mesh=ctx.mesh({"pipe": 2}),
                       plan=pw.Pipeline(microbatches=4, schedule=schedule, virtual_stages=virtual))
    losses = [loss.result(240).item() for loss in [trainer.step(b) for b in batches]]
    differences = [abs(a - b) / abs(b) for a, b in zip(losses, expected)]
    assert max(differences) < 1e-4, (max(differences), losses[-3:], expected[-3:])
    # No drift: the last ten steps are no further apart than the run's tolerance, and the loss went down.
    assert max(differences[-10:]) < 1e-4 and losses[-1] < losses[0] * 0.9
