"""Patterns the capture cannot carry fail on the client, before anything runs, naming the user's code (issue 14).

Each error names the module path, the user's own line, the aten op the capture stopped
at, and a fix that fits the pattern — not a traceback from inside a backend.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import pathways_torch as pw

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


class ReadsAValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        scale = float(x.abs().max())                    # a tensor's value as a Python number
        return self.lin(x) * scale


class BranchesOnData(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        if x.sum() > 0:                                 # control flow that depends on the data
            return self.lin(x)
        return -self.lin(x)


class Outer(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = nn.Sequential(nn.Identity(), inner)

    def forward(self, x):
        return self.inner(x)


@pytest.fixture(scope="module")
def ctx():
    with pw.Context(num_executors=2) as ctx:
        yield ctx


@pytest.mark.parametrize("inner, line", [(ReadsAValue, "scale = float(x.abs().max())"),
                                         (BranchesOnData, "if x.sum() > 0:")])
def test_an_unsupported_pattern_names_the_module_the_line_and_the_op(ctx, inner, line):
    model = Outer(inner())
    trainer = ctx.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                       loss_fn=nn.functional.mse_loss, mesh=ctx.mesh({"data": 2}))
    computed = {e: s["num_computations"] for e, s in ctx.stats()["executors"].items()}
    with pytest.raises(pw.CaptureError) as caught:
        trainer.step((torch.randn(4, 4), torch.randn(4, 1)))
    message = str(caught.value)
    assert f"module 'inner.1' ({inner.__name__})" in message, message
    assert line in message and "test_errors.py" in message, message
    assert "aten._local_scalar_dense" in message, message
    assert "must not depend on tensor values" in message and "torch.where" in message, message
    assert {e: s["num_computations"] for e, s in ctx.stats()["executors"].items()} == computed   # nothing ran
