"""Conformance: model code written elsewhere trains through ``ctx.wrap`` as it does in eager PyTorch.

Each case (tests/models/cases.py) trains a few steps on eager executors under DataParallel and
ShardedDataParallel, and on the default backend under one of them (`DEFAULT_BACKEND_PLAN`: the plans'
difference is the same for every model and eager checks it for each; the default backend's is the model's
code through XLA), on N = 2; its losses and final parameters are compared with the oracle: single-process
eager, or DDP's semantics for BatchNorm under data parallelism.
"""

from __future__ import annotations

import pytest
import torch

import pathways_torch as pw
from tests.models.cases import CASES, ddp_oracle, eager_oracle

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

N = 2
PLANS = {"dp": pw.DataParallel("data"), "sdp": pw.ShardedDataParallel("data")}
# Each case's plan on the default backend, the two plans alternating over the cases.
DEFAULT_BACKEND_PLAN = {case.name: ("sdp", "dp")[index % 2] for index, case in enumerate(CASES)}


def _adamw(model):
    # eps 1e-6, not 1e-8: with 1e-8 Adam turns a gradient near zero into a +-lr step whose sign float32
    # rounding decides (a GPT-2 bias moved 1e-3 apart, relative, from the oracle in 3 steps).
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, eps=1e-6)


@pytest.fixture(scope="module")
def eager_ctx():
    with pw.Context(num_executors=N, backend="eager") as ctx:
        yield ctx


@pytest.fixture(scope="module")
def default_ctx():
    with pw.Context(num_executors=N) as ctx:
        yield ctx


def _relative(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_trains_like_the_oracle_on_eager(eager_ctx, case, plan):
    _trains_like_the_oracle(eager_ctx, case, plan)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.name}-{DEFAULT_BACKEND_PLAN[c.name]}" for c in CASES])
def test_trains_like_the_oracle_on_the_default_backend(default_ctx, case):
    _trains_like_the_oracle(default_ctx, case, DEFAULT_BACKEND_PLAN[case.name])


def _trains_like_the_oracle(ctx, case, plan):
    expected_losses, expected_params = (ddp_oracle(case, _adamw, N) if case.ddp_buffers else
                                        eager_oracle(case, _adamw))
    model = case.make_model()
    trainer = ctx.wrap(model, optimizer=_adamw(model), loss_fn=case.loss_fn, mesh=ctx.mesh({"data": N}),
                       plan=PLANS[plan])
    losses = [trainer.step(batch) for batch in case.batches()]
    losses = [loss.result(240).item() for loss in losses]
    assert _relative(losses, expected_losses) < case.tolerance, (ctx.backend, losses, expected_losses)
    state = trainer.state_dict()["model"]
    for name, value in expected_params.items():
        assert _relative(state[name], value) < case.tolerance, (ctx.backend, name)
    assert ctx.backend_counters("fallback_ops").get(trainer.runner.function.name, 0) == 0 or ctx.backend == "eager"
