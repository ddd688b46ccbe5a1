"""Mixed precision (issue 14): a bfloat16 model, and torch.autocast(bfloat16) regions in forward.

Compared with eager doing the same (same dtype, same autocast), N = 2 data-parallel on the
default backend, at a tolerance fitting bfloat16 (8 bits of mantissa: 2e-2 relative; the
gradients are averaged over shards in bfloat16 here, summed in one process there).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pathways_torch as pw
from tests.models.cases import NanoGPT, _next_token_batches

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BF16_TOLERANCE = 2e-2


class AutocastMLP(nn.Module):
    """float32 parameters; the matmuls of forward run in bfloat16 under autocast, as AMP code writes it."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.body(x).float()


@pytest.fixture(scope="module")
def ctx():
    with pw.Context(num_executors=2) as ctx:      # the default backend
        yield ctx


def _optimizer(model):
    # SGD, not Adam: Adam moves a parameter by about lr whatever its gradient's size, so a bias starting
    # at zero whose bfloat16 gradient is rounding noise ends a whole step apart (measured: 20 % of ln_f.bias
    # after 3 steps), which says nothing about the runtime. SGD's step is proportional to the gradient.
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _eager(model, batches, loss_of):
    optimizer = _optimizer(model)
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = loss_of(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, dict(model.named_parameters())


def _regression_batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(4)]


CASES = {
    "bfloat16 model": (lambda: NanoGPT().to(torch.bfloat16), _next_token_batches, None, lambda m, b: m(*b)[1],
                       torch.bfloat16),
    "autocast region": (AutocastMLP, _regression_batches, F.mse_loss, lambda m, b: F.mse_loss(m(b[0]), b[1]),
                        torch.float32),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_trains_like_eager_in_the_same_precision(ctx, name):
    make, batches, loss_fn, loss_of, param_dtype = CASES[name]
    torch.manual_seed(0)
    model = make()
    expected_losses, expected_params = _eager(copy.deepcopy(model), batches(), loss_of)
    trainer = ctx.wrap(model, optimizer=_optimizer(model), loss_fn=loss_fn,
                       mesh=ctx.mesh({"data": 2}))
    losses = [trainer.step(batch) for batch in batches()]
    torch.testing.assert_close(torch.tensor([loss.result(240).item() for loss in losses]),
                               torch.tensor(expected_losses), rtol=BF16_TOLERANCE, atol=0)
    state = trainer.state_dict()["model"]
    for param_name, value in expected_params.items():
        assert state[param_name].dtype == param_dtype
        difference = (state[param_name].float() - value.detach().float()).norm()
        assert difference <= BF16_TOLERANCE * value.detach().float().norm(), param_name
    assert ctx.backend_counters("fallback_ops").get(trainer.runner.function.name, 0) == 0
