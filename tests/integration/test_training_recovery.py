"""A week-long run loses an executor: the step futures fail with ExecutorLostError naming it, and
a new context loaded from the last checkpoint goes on with exactly the losses of an unbroken run."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch

import pathways_torch as pw
from tests.conftest import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
from transformer import DecoderOnlyTransformer, ReverseTask, TransformerConfig, loss_fn  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

CFG = TransformerConfig(vocab=12, length=4, width=16, depth=1, heads=2, dropout=0.1)


def _trainer(ctx):
    torch.manual_seed(0)
    model = DecoderOnlyTransformer(CFG)
    return ctx.wrap(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=loss_fn,
                    mesh=ctx.mesh({"data": 2}), seed=3)


def test_lost_executor_fails_the_steps_and_the_checkpoint_resumes_exactly(tmp_path):
    task = ReverseTask(CFG, seed=5)
    batches = [task.batch(i, 8) for i in range(8)]
    with pw.Context(num_executors=2, backend="eager", heartbeat_timeout_s=2.0) as ctx:
        unbroken = _trainer(ctx)
        expected = [f.result(60).item() for f in [unbroken.step(b) for b in batches]]
    with pw.Context(num_executors=2, backend="eager", heartbeat_timeout_s=2.0) as ctx:
        trainer = _trainer(ctx)
        losses = [f.result(60).item() for f in [trainer.step(b) for b in batches[:4]]]
        trainer.save(str(tmp_path / "ckpt"))
        victim = ctx.executor_ids[1]
        os.kill(ctx.executor_pids[1], signal.SIGKILL)
        doomed = [trainer.step(b) for b in batches[4:6]]
        errors = [f.exception(30) for f in doomed]
        assert all(isinstance(e, pw.ExecutorLostError) for e in errors), errors
        assert victim in str(errors[-1])
    with pw.Context(num_executors=2, backend="eager") as ctx:
        resumed = _trainer(ctx)
        meta = resumed.load(str(tmp_path / "ckpt"))
        assert meta["step"] == 4
        losses += [f.result(60).item() for f in [resumed.step(b) for b in batches[meta["step"]:]]]
    assert losses == expected
