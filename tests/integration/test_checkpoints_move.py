"""Checkpoints move: saved under one plan and mesh size, loaded under another (DataParallel at N = 2 ->
ShardedDataParallel at N = 4 -> DataParallel at N = 2; Pipeline <-> DataParallel) or into plain eager PyTorch
(pw.load_checkpoint), training goes on with the losses of one uninterrupted eager run; a checkpoint of another
model is refused listing what differs. Executors' checkpoints keep the disk: only ``checkpoint_keep`` step folders
stay, a resumed run saves into a fresh folder, a bad ``checkpoint_keep`` is refused before anything is sent."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch
import torch.nn as nn

import pathways_torch as pw
from tests.service import open_context
from tests.conftest import train_eagerly
from tests.handles import data_client_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ctx(client_kind, service_if_remote):   # the embedded controller, then a remote one
    with open_context(client_kind, service_if_remote, num_executors=4, backend="eager") as context:
        yield context


@pytest.fixture
def base(ctx, tmp_path) -> pathlib.Path:
    """Where this test's checkpoints go: ``tmp_path`` embedded; for a client of the service, a folder under its own
    folder of the checkpoint root (an absolute path there is taken as it is; `Context.checkpoint_path`)."""
    return tmp_path if ctx.checkpoint_root is None else pathlib.Path(ctx.checkpoint_root) / tmp_path.name


def _model(width: int = 16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 1)).double()


def _batches(count: int):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(16, 4, generator=g, dtype=torch.float64), torch.randn(16, 1, generator=g, dtype=torch.float64))
            for _ in range(count)]


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _leg(ctx, mesh_axes, plan, batches, load_from=None, save_to=None, executors=None):
    """Train ``batches`` under ``plan`` on a fresh trainer (restored from ``load_from``); save to ``save_to``."""
    model = _model()
    trainer = ctx.wrap(model, optimizer=_adamw(model), loss_fn=nn.MSELoss(),
                       mesh=ctx.mesh(mesh_axes, executors=executors), plan=plan)
    if load_from is not None:
        trainer.load(load_from)
    losses = [loss.result(120).item() for loss in [trainer.step(b) for b in batches]]
    if save_to is not None:
        trainer.save(save_to)
    return losses


def _expected(batches):
    reference = _model()
    return train_eagerly(reference, _adamw(reference), batches, nn.MSELoss())


def test_data_parallel_at_2_to_sharded_at_4_and_back(ctx, base):
    batches = _batches(8)
    two = ctx.executor_ids[:2]
    losses = _leg(ctx, {"data": 2}, pw.DataParallel("data"), batches[:3], save_to=str(base / "a"), executors=two)
    losses += _leg(ctx, {"data": 4}, pw.ShardedDataParallel("data"), batches[3:6], load_from=str(base / "a"),
                   save_to=str(base / "b"))
    losses += _leg(ctx, {"data": 2}, pw.DataParallel("data"), batches[6:], load_from=str(base / "b"),
                   executors=two)
    expected = _expected(batches)
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-9, (losses, expected)


def test_pipeline_to_data_parallel_and_back(ctx, base):
    batches = _batches(6)
    pipeline = pw.Pipeline(microbatches=2, schedule="1f1b")
    losses = _leg(ctx, {"pipe": 2}, pipeline, batches[:2], save_to=str(base / "a"), executors=ctx.executor_ids[:2])
    losses += _leg(ctx, {"data": 4}, pw.DataParallel("data"), batches[2:4], load_from=str(base / "a"),
                   save_to=str(base / "b"))
    losses += _leg(ctx, {"pipe": 2, "data": 2}, pw.Pipeline(microbatches=2, data=pw.DataParallel("data")),
                   batches[4:], load_from=str(base / "b"))
    expected = _expected(batches)
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-9, (losses, expected)


def test_a_trainers_checkpoint_goes_on_in_plain_eager_pytorch(ctx, base):
    batches = _batches(6)
    losses = _leg(ctx, {"data": 4}, pw.ShardedDataParallel("data"), batches[:3], save_to=str(base / "a"))
    model = _model()
    optimizer = _adamw(model)
    meta = pw.load_checkpoint(str(base / "a"), model, optimizer)
    assert meta["step"] == 3 and meta["plan"] == "ShardedDataParallel"
    losses += train_eagerly(model, optimizer, batches[3:], nn.MSELoss())
    expected = _expected(batches)
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-9, (losses, expected)


def test_a_checkpoint_of_another_model_is_refused_listing_the_differences(ctx, base):
    _leg(ctx, {"data": 2}, pw.DataParallel("data"), _batches(1), save_to=str(base / "a"),
         executors=ctx.executor_ids[:2])
    wider = _model(width=32)
    trainer = ctx.wrap(wider, optimizer=_adamw(wider), loss_fn=nn.MSELoss(), mesh=ctx.mesh({"data": 2},
                       executors=ctx.executor_ids[:2]))
    with pytest.raises(ValueError, match=r"does not match this model and optimizer: other shapes \[model/0.bias: "
                                         r"checkpoint \[16\], here \[32\]"):
        trainer.load(str(base / "a"))


# ------------------------------------------------------------ checkpoints written by the executors

def _big_model():
    torch.manual_seed(0)
    return nn.Sequential(*[layer for _ in range(3) for layer in (nn.Linear(768, 768), nn.Tanh())],
                         nn.Linear(768, 1)).double()


def test_executors_write_the_checkpoint_in_the_background_and_it_moves(ctx, tmp_path, base):
    """checkpoint_every=4 under DataParallel at N = 2: each executor writes its own file, the client receives no
    tensor bytes, the next step runs while the shards are written (the trace shows it), and the checkpoint
    loads under ShardedDataParallel at N = 4 with the losses of one uninterrupted eager run."""
    import json
    import os

    g = torch.Generator().manual_seed(9)
    batches = [(torch.randn(64, 768, generator=g, dtype=torch.float64), torch.randn(64, 1, generator=g,
                                                                                   dtype=torch.float64))
               for _ in range(6)]
    reference = _big_model()
    expected = train_eagerly(reference, _adamw(reference), batches, nn.MSELoss())
    model = _big_model()
    directory = str(base / "ckpt")
    trainer = ctx.wrap(model, optimizer=_adamw(model), loss_fn=nn.MSELoss(),
                       mesh=ctx.mesh({"data": 2}, executors=ctx.executor_ids[:2]), checkpoint_dir=directory,
                       checkpoint_every=4)
    losses = [trainer.step(b) for b in batches[:3]]
    before = ctx.stats()["hops"]["executor->client"]
    trainer.step(batches[3])                     # step 4: a save starts in the background ...
    saving = trainer._checkpoint
    for _ in range(3):                           # ... while steps go on (throwaway steps: not compared)
        trainer.step(batches[3])
    written = saving.result(120)
    received = ctx.stats()["hops"]["executor->client"] - before
    state_bytes = sum(p.numel() for p in model.parameters()) * 8 * 3      # parameters and two Adam states
    assert written >= state_bytes and received < 1000, (written, received)
    # Step 0 too: with checkpoint_every the trainer recovers from a lost executor, and a loss before step 4
    # restores the state it started from.
    assert sorted(os.listdir(directory)) == ["latest", "step-00000000", "step-00000004"]
    step_dir = os.path.join(directory, "step-00000004")
    assert sorted(os.listdir(step_dir)) == sorted(["client.safetensors", "index.json",
                                                   *[f"{e}.safetensors" for e in trainer.mesh.executor_ids]])
    with open(os.path.join(step_dir, "index.json")) as f:
        assert json.load(f)["meta"]["step"] == 4
    trace = ctx.trace(str(tmp_path / "trace.json"))["traceEvents"]
    saves = [e for e in trace if e.get("cat") == "save"]
    computes = [e for e in trace if e.get("cat") == "compute" and e["name"].startswith("train_step")]
    assert saves and any(c["ts"] < s["ts"] + s["dur"] and c["ts"] + c["dur"] > s["ts"] for s in saves
                         for c in computes if c["pid"] == s["pid"]), "no step ran while a save was being written"
    losses = [loss.result(120).item() for loss in losses[:3]]
    moved = _big_model()
    resumed = ctx.wrap(moved, optimizer=_adamw(moved), loss_fn=nn.MSELoss(), mesh=ctx.mesh({"data": 4}),
                       plan=pw.ShardedDataParallel("data"))
    assert resumed.load(directory)["step"] == 4
    losses += [float("nan")] + [loss.result(120).item() for loss in [resumed.step(b) for b in batches[4:]]]
    assert max(abs(a - b) for a, b in zip(losses[:3] + losses[4:], expected[:3] + expected[4:])) < 1e-9, (
        losses, expected)


@pytest.mark.parametrize("delay_s", [0.0, 0.3])
def test_a_process_killed_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path, delay_s):
    import os
    import signal
    import subprocess
    import sys
    import time

    from pathways_torch.training.checkpoint import read_checkpoint
    from tests.conftest import REPO_ROOT

    directory = str(tmp_path / "ckpt")
    script = os.path.join(os.path.dirname(__file__), "checkpointing_script.py")
    process = subprocess.Popen([sys.executable, script, directory], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, cwd=REPO_ROOT)
    try:
        for line in process.stdout:           # saves are running, one after the other
            if line.startswith("saving 3"):
                break
        time.sleep(delay_s)
        process.send_signal(signal.SIGKILL)   # the client, at some point of a save
        process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
    tensors, meta = read_checkpoint(directory)
    assert meta["step"] >= 1 and "model/0.weight" in tensors and "optimizer/0.weight/exp_avg" in tensors
    assert tuple(tensors["model/0.weight"].shape) == (512, 512)


# ------------------------------------------------------------ checkpoints that keep the disk (issue 26)

def _executor_steps(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n != "latest")


def test_only_the_newest_checkpoints_stay_and_the_latest_loads(ctx, base):
    """checkpoint_every=1, checkpoint_keep=2: after 5 steps (6 saves, step 0's too) two step folders remain, and
    the latest loads under ShardedDataParallel at N = 4 (its buckets padded: 369 elements over 4) and goes on
    with the losses of one uninterrupted eager run."""
    batches = _batches(7)
    directory = str(base / "ckpt")
    model = _model()
    trainer = ctx.wrap(model, optimizer=_adamw(model), loss_fn=nn.MSELoss(), checkpoint_dir=directory,
                       mesh=ctx.mesh({"data": 2}, executors=ctx.executor_ids[:2]), checkpoint_every=1,
                       checkpoint_keep=2)
    losses = [loss.result(120).item() for loss in [trainer.step(b) for b in batches[:5]]]
    trainer._checkpoint.result(120)
    assert _executor_steps(directory) == ["step-00000004", "step-00000005"]
    assert trainer.stats()["checkpoints_written"] == 6
    losses += _leg(ctx, {"data": 4}, pw.ShardedDataParallel("data"), batches[5:], load_from=directory)
    expected = _expected(batches)
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-9, (losses, expected)


def _written(folder: str) -> dict:
    """What a rewrite would change of each file in ``folder``: its inode, size, and modification and change
    times (not its access time: loading the checkpoint reads the files, and that moves it)."""
    return {n: (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            for n in os.listdir(folder) for st in [os.stat(os.path.join(folder, n))]}


def test_a_resumed_run_saves_into_a_fresh_folder_and_never_rewrites_the_one_it_loaded(ctx, base):
    batches = _batches(4)
    directory = str(base / "ckpt")
    mesh = ctx.mesh({"data": 2}, executors=ctx.executor_ids[:2])
    model = _model()
    first = ctx.wrap(model, optimizer=_adamw(model), loss_fn=nn.MSELoss(), mesh=mesh, checkpoint_dir=directory,
                     checkpoint_every=2)
    losses = [loss.result(120).item() for loss in [first.step(b) for b in batches[:2]]]
    first._checkpoint.result(120)
    loaded = os.path.join(directory, "step-00000002")
    with open(os.path.join(directory, "latest")) as f:
        assert f.read() == "step-00000002"
    files = _written(loaded)
    model = _model()
    resumed = ctx.wrap(model, optimizer=_adamw(model), loss_fn=nn.MSELoss(), mesh=mesh, checkpoint_dir=directory,
                       checkpoint_every=2)
    assert resumed.load(directory)["step"] == 2
    resumed._checkpoint.result(120)          # the loaded state, written again for recovery: elsewhere
    with open(os.path.join(directory, "latest")) as f:
        assert f.read() == "step-00000002-1"
    assert _written(loaded) == files
    losses += [loss.result(120).item() for loss in [resumed.step(b) for b in batches[2:]]]
    expected = _expected(batches)
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-9, (losses, expected)


def test_a_bad_checkpoint_keep_is_refused_under_every_plan_before_anything_is_sent(ctx, base):
    def sent_now() -> dict:   # what the controller sent, the stats requests reading it aside
        return {k: n for k, n in ctx.stats()["controller_messages"].items() if k not in ("stats_request", "heartbeat")}

    sent, put = sent_now(), data_client_of(ctx).bytes_sent
    plans = [(pw.DataParallel("data"), {"data": 2}), (pw.ShardedDataParallel("data"), {"data": 2}),
             (pw.Pipeline(microbatches=2), {"pipe": 2})]
    for plan, axes in plans:
        for value, error in [(-1, ValueError), (True, TypeError), ("2", TypeError)]:
            model = _model()
            with pytest.raises(error, match=rf"checkpoint_keep={value!r}: expected"):
                ctx.wrap(model, optimizer=_adamw(model), loss_fn=nn.MSELoss(), plan=plan,
                         mesh=ctx.mesh(axes, executors=ctx.executor_ids[:2]), checkpoint_dir=str(base),
                         checkpoint_every=1, checkpoint_keep=value)
    assert sent_now() == sent and data_client_of(ctx).bytes_sent == put
    assert not base.exists() or os.listdir(base) == []
