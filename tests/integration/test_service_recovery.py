"""An executor of a standalone controller is lost while two clients train on it: each client's steps that needed it
fail with `ExecutorLostError` inside its trainer, the controller replaces the executor once for both, and both
trainers restore their last checkpoints and end with exactly the losses of an unbroken run (dropout on)."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch

from tests.conftest import REPO_ROOT
from tests.service import ControllerProcess, open_context

sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
from transformer import DecoderOnlyTransformer, ReverseTask, TransformerConfig, loss_fn  # noqa: E402
from pathways_torch.wire.seam import Executors
from tests.handles import client_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CFG = TransformerConfig(vocab=12, length=4, width=16, depth=1, heads=2, dropout=0.1)
LIVENESS = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0}


def _trainer(ctx, seed, **options):
    torch.manual_seed(seed)
    model = DecoderOnlyTransformer(CFG)
    return ctx.wrap(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=loss_fn,
                    mesh=ctx.mesh({"data": 2}), seed=seed, **options)


def test_two_clients_recover_from_one_lost_executor_with_the_losses_of_unbroken_runs(tmp_path):
    task = ReverseTask(CFG, seed=5)
    batches = [task.batch(i, 8) for i in range(10)]
    service = ControllerProcess(str(tmp_path / "keys"), num_executors=2,
                                args=["--heartbeat-interval-s", "0.2", "--heartbeat-timeout-s", "2"])
    try:
        with open_context("remote", service, "alice", backend="eager", **LIVENESS) as alice, \
                open_context("remote", service, "bob", backend="eager", **LIVENESS) as bob:
            unbroken = {"alice": _trainer(alice, 1), "bob": _trainer(bob, 2)}
            expected = {name: [f.result(120).item() for f in [t.step(b) for b in batches]]
                        for name, t in unbroken.items()}
            # Each under its own folder of the service's checkpoint root (a relative checkpoint_dir lands there).
            trainers = {name: _trainer(ctx, seed, checkpoint_dir="recovery", checkpoint_every=2)
                        for name, ctx, seed in (("alice", alice, 1), ("bob", bob, 2))}
            losses = {name: [t.step(b) for b in batches[:5]] for name, t in trainers.items()}
            for name, trainer in trainers.items():
                losses[name][-1].result(120)
                trainer._checkpoint.result(120)   # step 4's save is on disk
            victim = alice.executor_ids[1]
            old_pid = alice.executor_pids[1]
            os.kill(old_pid, signal.SIGKILL)
            for name, trainer in trainers.items():   # the loops do not change
                losses[name] += [trainer.step(b) for b in batches[5:]]
            got = {name: [f.result(120).item() for f in fs] for name, fs in losses.items()}
            stats = {name: t.stats() for name, t in trainers.items()}
            views = {info.executor_id: info for info in client_of(bob).request(Executors())}
        assert got == expected
        for name in ("alice", "bob"):
            assert stats[name]["recoveries"] == 1, stats[name]
            assert "recovered from the loss" in stats[name]["events"][0], stats[name]
            assert "restored step 4" in stats[name]["events"][0], stats[name]
        assert views[victim].epoch == 2 and views[victim].pid != old_pid   # replaced once, for both
    finally:
        service.stop()
