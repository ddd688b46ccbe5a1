"""The example trainer as a user runs it (shortened): the loss falls and a checkpoint is written;
and the same training step on the XLA backend agrees with eager."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys

import pytest
import torch

import pathways_torch as pw
from tests.conftest import REPO_ROOT, train_eagerly

sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
from transformer import DecoderOnlyTransformer, ReverseTask, TransformerConfig, loss_fn  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.mark.compat
def test_example_trainer_loss_falls_and_checkpoint_is_written(tmp_path):
    """On the default backend, as the README's first command runs it: XLA, nothing outside it."""
    checkpoint = tmp_path / "ckpt"
    result = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "examples", "train_transformer.py"),
         "--steps", "80", "--checkpoint", str(checkpoint)],
        capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]   # it exits 1 below 90 % held out
    first, last = map(float, re.search(r"loss: ([\d.]+) -> ([\d.]+)", result.stdout).groups())
    assert last < first / 3, result.stdout
    accuracy = float(re.search(r"held-out accuracy \(1024 sequences\): ([\d.]+)% of answer tokens", result.stdout)[1])
    assert accuracy >= 90.0, result.stdout       # 100.0 % measured in 80 steps on the 2-core machine
    assert (checkpoint / "trainer.safetensors").exists()
    assert f"checkpoint: {checkpoint / 'trainer.safetensors'}" in result.stdout
    assert "tok_s=" in result.stderr          # the progress bar shows throughput
    assert re.search(r"^backend: xla:(torchax|torch_xla)$", result.stdout, re.M), result.stdout
    assert "ops run outside XLA: 0\n" in result.stdout, result.stdout


def _held_out_accuracy(tmp_path, *flags) -> float:
    result = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "examples", "train_transformer.py"), "--steps", "80",
         "--checkpoint", str(tmp_path / "_".join(flags or ("dp",))), *flags],
        capture_output=True, text=True, timeout=280, cwd=str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return float(re.search(r"held-out accuracy \(1024 sequences\): ([\d.]+)% of answer tokens", result.stdout)[1])


# The data-parallel run of the example reaches 100.0 % of answer tokens in 80 steps (the first test here; 100 % in 300,
# README): the pipelined run must come within a point of it in as many steps (100.0 % measured on the 2-core machine,
# loss 3.374 -> 0.3145 on either backend).
DATA_PARALLEL_ACCURACY = 100.0


def test_example_pipeline_run_reaches_the_data_parallel_accuracy(tmp_path):
    """As docs/pipelines.md runs it: 2 stages x 8 microbatches, 1F1B, dropout and clipping on; 80 steps. On eager
    executors (16 s against 41 on the default backend): what is checked is the schedule's training, and the
    default backend's pipelines equal eager's (tests/models/test_pipeline_models.py, test_dropout_awaiting.py)."""
    pipelined = _held_out_accuracy(tmp_path, "--plan", "pipeline", "--stages", "2", "--microbatches", "8",
                                   "--backend", "eager")
    assert pipelined >= DATA_PARALLEL_ACCURACY - 1.0, pipelined


@pytest.fixture(scope="module")
def xla_ctx():
    with pw.Context(num_executors=2, backend="xla") as ctx:
        yield ctx


@pytest.mark.parametrize("plan", [pw.DataParallel("data"), pw.ShardedDataParallel("data")], ids=["dp", "sdp"])
def test_xla_training_step_matches_eager_in_float32(xla_ctx, plan):
    cfg = TransformerConfig(vocab=12, length=4, width=16, depth=1, heads=2)
    torch.manual_seed(0)
    model = DecoderOnlyTransformer(cfg)
    reference = copy.deepcopy(model)
    batches = [ReverseTask(cfg, 1).batch(i, 8) for i in range(10)]
    expected = train_eagerly(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batches, loss_fn)
    ctx = xla_ctx
    compiled_before = [e["num_compiles"] for e in ctx.stats()["executors"].values()]
    trainer = ctx.wrap(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=loss_fn,
                       mesh=ctx.mesh({"data": 2}), plan=plan)
    losses = [f.result(120).item() for f in [trainer.step(b) for b in batches]]
    params = trainer.state_dict()["model"]
    compiles = [e["num_compiles"] - before
                for e, before in zip(ctx.stats()["executors"].values(), compiled_before)]
    outside = ctx.backend_counters("fallback_ops")   # both plans' steps: every op inside XLA
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=0)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert all(c > 0 for c in compiles)       # XLA compiled the step (it did not run eagerly)
    if ctx.backend == "xla:torchax":
        assert outside and not any(outside.values()), outside   # every op of the step inside XLA


@pytest.mark.compat
def test_dropout_masks_are_the_same_on_xla_as_on_eager():
    """Counter-based dropout is integer arithmetic (int64 hashing): the default backend draws exactly eager's
    masks, so losses agree to float rounding, not just in distribution."""
    cfg = TransformerConfig(vocab=12, length=4, width=16, depth=1, heads=2, dropout=0.3)
    batches = [ReverseTask(cfg, 2).batch(i, 8) for i in range(5)]
    losses = {}
    for backend in ("xla", "eager"):
        torch.manual_seed(0)
        model = DecoderOnlyTransformer(cfg)
        with pw.Context(num_executors=2, backend=backend) as ctx:
            trainer = ctx.wrap(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=loss_fn,
                               mesh=ctx.mesh({"data": 2}), plan=pw.DataParallel("data"), seed=7)
            losses[backend] = torch.tensor([f.result(120).item() for f in [trainer.step(b) for b in batches]])
    torch.testing.assert_close(losses["xla"], losses["eager"], rtol=1e-4, atol=0)
    # A different seed draws other masks: the agreement above is not an accident of dropout being off.
    assert not torch.allclose(losses["xla"][1:], _losses_with_seed(cfg, batches, seed=8)[1:], rtol=1e-3, atol=0)


def _losses_with_seed(cfg, batches, seed: int) -> torch.Tensor:
    torch.manual_seed(0)
    model = DecoderOnlyTransformer(cfg)
    with pw.Context(num_executors=2, backend="eager") as ctx:
        trainer = ctx.wrap(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=loss_fn,
                           mesh=ctx.mesh({"data": 2}), plan=pw.DataParallel("data"), seed=seed)
        return torch.tensor([f.result(120).item() for f in [trainer.step(b) for b in batches]])


def test_gpt_example_on_real_text_trains_evaluates_and_samples(tmp_path):
    """examples/train_gpt.py, shortened, with its layers split over a model axis beside data parallelism
    (--mesh data=2,model=2 --plan tp): the validation loss (trainer.evaluate) falls below a uniform byte's
    ln 256 = 5.55 nats, a checkpoint is written and text is sampled through trainer.predict."""
    checkpoint = tmp_path / "gpt"
    result = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "examples", "train_gpt.py"), "--steps", "20", "--eval-every", "10",
         "--width", "64", "--depth", "2", "--sample-bytes", "16", "--max-bytes", "300000",
         "--mesh", "data=2,model=2", "--plan", "tp", "--checkpoint", str(checkpoint)],
        capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    val = float(re.search(r"validation loss: ([\d.]+) nats/byte", result.stdout).group(1))
    assert val < 5.0, result.stdout     # 4.58 measured after 20 steps (3.53 after 40; a step costs 0.9 s here)
    assert (checkpoint / "trainer.safetensors").exists()
    assert re.search(r"sample:\ndef .{16}", result.stdout, re.S), result.stdout
    assert "val=" in result.stderr            # the bar shows the validation loss
    assert "blocks.*.attn.c_attn  FusedColwiseParallel(chunks=3)" in result.stdout    # the plan it proposed
