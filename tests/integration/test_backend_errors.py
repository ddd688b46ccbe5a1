"""A backend that cannot compile an op (issue 14): the error names the op and the user's line that made it.

XLA's lowering of an op is made to fail (``PATHWAYS_REFUSE_LOWERING``, a test hook the
torchax route reads at start): the call fails before any result with a `RemoteError`
that names the aten op and the line of the user's code, found by re-tracing the
function with stack traces on the client — not only a traceback from inside the backend.
"""

from __future__ import annotations

import os

import pytest
import torch

import pathways_torch as pw

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def ctx():
    os.environ["PATHWAYS_REFUSE_LOWERING"] = "aten.cos.default"     # inherited by the executors
    try:
        with pw.Context(num_executors=2, backend="xla:torchax") as ctx:
            yield ctx
    finally:
        del os.environ["PATHWAYS_REFUSE_LOWERING"]


def _waves(x):
    y = x * 2
    return torch.cos(y) + 1          # the op XLA refuses here


def test_a_function_whose_op_cannot_compile_names_the_op_and_the_line(ctx):
    f = pw.function(_waves, name="waves")
    out = f(ctx.put(torch.arange(4.0), ctx.mesh({"data": 2}), [pw.Shard(0)]))
    with pytest.raises(pw.RemoteError) as caught:
        out.result(120)
    message = str(caught.value)
    assert "could not compile aten.cos.default" in message, message
    assert "test_backend_errors.py" in message and "return torch.cos(y) + 1" in message, message
    assert caught.value.op == "aten.cos.default" and caught.value.user_line


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.cos(self.lin(x))    # refused in the training step too


def test_a_training_step_whose_op_cannot_compile_names_the_model_line(ctx):
    model = torch.nn.Sequential(Block(), torch.nn.Linear(4, 1))
    trainer = ctx.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                       loss_fn=torch.nn.functional.mse_loss, mesh=ctx.mesh({"data": 2}))
    loss = trainer.step((torch.randn(4, 4), torch.randn(4, 1)))
    error = loss.exception(120)
    assert isinstance(error, pw.RemoteError) and error.op == "aten.cos.default", error
    assert "return torch.cos(self.lin(x))" in str(error), str(error)


def test_a_fused_program_given_a_failed_input_fails_as_its_steps_would(ctx):
    """Fusion (executor/fusion.py) never changes results: a fused run whose input is a failure runs its steps one
    by one, and the failure reaches the program's output naming where it began; a good input then runs fused."""
    mesh = ctx.mesh({"data": 2})
    waves = pw.function(_waves, name="waves")
    node = pw.function(lambda x: pw.all_reduce(x * 2, axis="data") + 1, name="node")

    @pw.program
    def chain(x):
        for _ in range(4):
            x = node(x)
        return x

    failed = waves(ctx.put(torch.arange(4.0), mesh, [pw.Shard(0)]))
    with pytest.raises(pw.RemoteError) as caught:
        chain(failed).result(120)
    assert "could not compile aten.cos.default" in str(caught.value), str(caught.value)
    good = chain(ctx.put(torch.arange(4.0), mesh, [pw.Shard(0)]))
    expected = torch.arange(4.0).reshape(2, 2)
    for _ in range(4):
        expected = (expected * 2).sum(0).expand(2, 2) + 1    # each shard all-reduced over the two
    torch.testing.assert_close(good.result(120), expected.reshape(4), rtol=1e-6, atol=1e-6)
    assert "fused n0..n3: 4 steps, one executable" in ctx.lowered(chain, good), ctx.lowered(chain, good)
