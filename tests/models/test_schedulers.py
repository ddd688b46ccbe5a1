"""Schedulers of ``torch.optim.lr_scheduler`` and parameter groups as people write them (issue 14).

Stepped by the user as in eager code: losses and parameters match eager, and nothing
recompiles after the first step — learning rate, momentum and betas are step inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import pathways_torch as pw
from tests.models.cases import NanoGPT, _next_token_batches

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 6


@pytest.fixture(scope="module")
def ctx():
    with pw.Context(num_executors=2) as ctx:      # the default backend
        yield ctx


def _decay_groups(model):
    """The usual split: no weight decay on biases and norm weights, names carried for logging."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]


OPTIMIZERS = {
    "sgd-momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
    "adamw-two-groups": lambda m: torch.optim.AdamW(_decay_groups(m), lr=3e-3, betas=(0.9, 0.95), eps=1e-6),
}
SCHEDULES = {
    "one-cycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.01, total_steps=STEPS),
    "warmup-cosine": lambda o: torch.optim.lr_scheduler.SequentialLR(o, [
        torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=2),
        torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS - 2)], milestones=[2]),
}


def _batches():
    batches = _next_token_batches()
    return [batches[i % len(batches)] for i in range(STEPS)]


def _make():
    torch.manual_seed(0)
    return NanoGPT().double()


def _eager(optimizer_name, schedule_name):
    model = _make()
    optimizer = OPTIMIZERS[optimizer_name](model)
    scheduler = SCHEDULES[schedule_name](optimizer)
    losses = []
    for ids, targets in _batches():
        optimizer.zero_grad()
        _, loss = model(ids, targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses, dict(model.named_parameters())


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_a_scheduler_stepped_by_the_user_never_recompiles(ctx, optimizer_name, schedule):
    expected_losses, expected_params = _eager(optimizer_name, schedule)
    model = _make()
    optimizer = OPTIMIZERS[optimizer_name](model)
    scheduler = SCHEDULES[schedule](optimizer)
    trainer = ctx.wrap(model, optimizer=optimizer, mesh=ctx.mesh({"data": 2}))
    losses, compiles_after_first = [], None
    for index, batch in enumerate(_batches()):
        losses.append(trainer.step(batch))
        scheduler.step()                      # as in eager code: after the optimizer's step
        if index == 0:
            losses[0].result(240)
            compiles_after_first = {e: s["num_compiles"] for e, s in ctx.stats()["executors"].items()}
    losses = [loss.result(240).item() for loss in losses]
    assert trainer.runner.function.num_traces == 1
    assert {e: s["num_compiles"] for e, s in ctx.stats()["executors"].items()} == compiles_after_first
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-9, atol=0)
    state = trainer.state_dict()["model"]
    for name, value in expected_params.items():
        torch.testing.assert_close(state[name], value.detach(), rtol=1e-9, atol=1e-12, msg=name)


def test_an_option_that_changes_the_update_is_still_refused(ctx):
    model = nn.Linear(2, 1)
    with pytest.raises(pw.CaptureError, match="amsgrad=True is not implemented"):
        ctx.wrap(model, optimizer=torch.optim.Adam(model.parameters(), amsgrad=True), mesh=ctx.mesh({"data": 2}),
                 loss_fn=nn.functional.mse_loss)
