"""Checkpoints written by the executors, and recovery, under pw.Pipeline (docs/faults.md, docs/pipelines.md).

Each stage's executors write their own chunks' state; the checkpoint loads into eager PyTorch and
into another plan with the trainer's own tensors, exactly. One stage's executor SIGKILLed in the
middle of a 1F1B run with a data axis (mesh {"stage": 2, "data": 2}, dropout on) is replaced, the
last checkpoint is put back on every chunk, and the loss futures the loop holds resolve to exactly
the losses of an unbroken run, on the default backend (what users run; eager was the same scenario twice).
"""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch

import pathways_torch as pw
from tests.conftest import REPO_ROOT
from tests.handles import controller_of

sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
from transformer import DecoderOnlyTransformer, ReverseTask, TransformerConfig, loss_fn  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

CFG = TransformerConfig(vocab=12, length=4, width=16, depth=2, heads=2, dropout=0.1)
# A SIGKILL is found by the context's check of its child processes, not by heartbeats: a long timeout costs the
# test nothing and keeps 4 executors compiling on 2 cores from being declared lost.
HEARTBEAT_TIMEOUT_S = 10.0
ONE_F_ONE_B = dict(microbatches=2, schedule="1f1b", data=pw.DataParallel("data"))


def _model(cfg=CFG):
    torch.manual_seed(0)
    return DecoderOnlyTransformer(cfg)


def _trainer(ctx, model=None, plan_options=ONE_F_ONE_B, **options):
    model = model if model is not None else _model()
    return ctx.wrap(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=loss_fn,
                    mesh=ctx.mesh({"stage": 2, "data": 2}), plan=pw.Pipeline(axis="stage", **plan_options),
                    seed=3, **options)


def _batches(count, cfg=CFG):
    task = ReverseTask(cfg, seed=5)
    return [task.batch(i, 8) for i in range(count)]


@pytest.fixture(scope="module")
def eager_ctx():
    with pw.Context(num_executors=4, backend="eager", heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as ctx:
        yield ctx


def test_a_pipeline_checkpoint_holds_every_chunk_and_loads_into_eager_pytorch_and_another_plan(eager_ctx, tmp_path):
    # Interleaved: each executor holds two chunks; sharded stages: each data shard writes its slice.
    cfg = TransformerConfig(vocab=12, length=4, width=16, depth=4, heads=2, dropout=0.1)
    plan = dict(microbatches=4, schedule="interleaved", virtual_stages=2, data=pw.ShardedDataParallel("data"))
    trainer = _trainer(eager_ctx, _model(cfg), plan, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2)
    for batch in _batches(3, cfg):
        trainer.step(batch).result(120)
    written = trainer.save_sharded(str(tmp_path / "now"))
    assert written.result(120) > 0
    state = trainer.state_dict()
    # Step 0's (asked when the trainer was made, written at the first step) and step 2's, every 2 steps.
    assert pw.load_checkpoint(str(tmp_path / "ckpt"), _model(cfg))["step"] == 2
    files = os.listdir(os.path.join(tmp_path, "now", "step-00000003"))
    assert sorted(f for f in files if f.startswith("executor-")) == [f"{e}.safetensors" for e in eager_ctx.executor_ids]

    eager = _model(cfg)
    optimizer = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    meta = pw.load_checkpoint(str(tmp_path / "now"), eager, optimizer)
    assert meta["step"] == 3 and meta["plan"] == "Pipeline"
    for name, value in eager.state_dict().items():
        assert torch.equal(value, state["model"][name]), name
    params = dict(eager.named_parameters())
    for name, states in state["optimizer"].items():
        for key, value in states.items():
            assert torch.equal(optimizer.state[params[name]][key], value), (name, key)

    model = _model(cfg)
    other = eager_ctx.wrap(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=loss_fn,
                           mesh=eager_ctx.mesh({"data": 2}), plan=pw.DataParallel("data"))
    other.load(str(tmp_path / "now"))
    loaded = other.state_dict()
    assert all(torch.equal(loaded["model"][n], v) for n, v in state["model"].items())
    assert all(torch.equal(loaded["optimizer"][n][k], v) for n, s in state["optimizer"].items() for k, v in s.items())


class _WithUnread(torch.nn.Module):
    """Two blocks, and a layer and a buffer the forward never reads: no chunk holds them."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
                                            for _ in range(2)])
        self.unread = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x):
        return self.layers(x)


def test_names_no_chunk_holds_are_in_the_checkpoint_too(eager_ctx, tmp_path):
    torch.manual_seed(0)
    model = _WithUnread()
    trainer = eager_ctx.wrap(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                             loss_fn=torch.nn.MSELoss(), plan=pw.Pipeline(axis="stage", microbatches=2),
                             mesh=eager_ctx.mesh({"stage": 2}, executors=eager_ctx.executor_ids[:2]),
                             checkpoint_dir=str(tmp_path), checkpoint_every=2)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        trainer.step((torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g))).result(60)
    trainer._checkpoint.result(60)
    state = trainer.state_dict()
    eager = _WithUnread()
    assert pw.load_checkpoint(str(tmp_path), eager, torch.optim.AdamW(eager.parameters()))["step"] == 2
    assert all(torch.equal(value, state["model"][name]) for name, value in eager.state_dict().items())
    assert torch.equal(eager.scale, torch.full((4,), 2.0))


def _recovers_exactly(ctx, tmp_path):
    """Kill stage 1's second executor after step 7 of 12 (checkpoints every 3 steps); the losses, the stats."""
    batches = _batches(12)
    unbroken = _trainer(ctx)
    expected = [loss.result(240).item() for loss in [unbroken.step(b) for b in batches]]
    trainer = _trainer(ctx, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=3)
    victim = ctx.executor_ids[3]      # mesh {"stage": 2, "data": 2} row-major: executors 2 and 3 are stage 1
    assert victim in trainer.runner.stage_meshes[1].executor_ids
    losses = [trainer.step(b) for b in batches[:7]]
    losses[-1].result(240)
    trainer._checkpoint.result(120)    # step 6's background save is on disk: the restored step is known
    os.kill(ctx.executor_pids[3], signal.SIGKILL)
    losses += [trainer.step(b) for b in batches[7:]]        # the loop does not change
    got = [loss.result(240).item() for loss in losses]
    return got, expected, trainer.stats()


def test_sigkill_of_one_stage_executor_under_1f1b_with_a_data_axis_recovers_exactly_on_the_default_backend(
        tmp_path):
    with pw.Context(num_executors=4, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as ctx:
        got, expected, stats = _recovers_exactly(ctx, tmp_path)
        epochs = [info.epoch for info in controller_of(ctx).resources.ordered()]
    assert got == expected
    assert epochs == [1, 1, 1, 2]          # only the lost one was replaced
    assert stats["recoveries"] == 1 and 1 <= stats["steps_recomputed"] <= 3, stats
    assert "restored step 6" in stats["events"][0], stats["events"]
