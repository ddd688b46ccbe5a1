"""A service client's checkpoints live under its own folder of the checkpoint root, and nowhere else (issue 46,
point 1, threat C1): bob, with his own valid key, cannot make an executor write over alice's checkpoint shard (by
its absolute path, by ``..``, through a symbolic link), and the executors' trace shows him none of her paths;
alice's relative ``checkpoint_dir`` saves and loads under ``DIR/alice/``."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from torch import nn

import pathways_torch as pw
from pathways_torch.errors import RemoteError
from pathways_torch.wire import pb
from pathways_torch.wire.checkpoint_paths import CheckpointPathError
from tests.service import ControllerProcess, client_fixture
from tests.handles import data_client_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def tenant_service(tmp_path_factory):
    """Two executors; the clients' checkpoints under a root of this module's own."""
    base = tmp_path_factory.mktemp("tenant-paths")
    service = ControllerProcess(str(base / "keys"), clients=("alice", "bob"), num_executors=2,
                                args=("--checkpoint-root", str(base / "root")))
    yield service
    service.stop()


alice = client_fixture("alice", "tenant_service", num_executors=2, backend="eager")
bob = client_fixture("bob", "tenant_service", num_executors=2, backend="eager")


@pytest.fixture(scope="module")
def alices_checkpoint(alice):
    """Alice trains a step and the executors save it under ``checkpoint_dir="run1"``: (trainer, its step folder)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    trainer = alice.wrap(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=nn.MSELoss(),
                         mesh=alice.mesh({"data": 2}), checkpoint_dir="run1")
    trainer.step((torch.randn(4, 4), torch.randn(4, 2))).result(60)
    saving = trainer.save_sharded("run1")
    saving.result(60)
    return trainer, saving.step_dir


def _digests(folder: str) -> dict:
    return {n: hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest() for n in os.listdir(folder)}


def _save_straight(ctx, path: str) -> BaseException:
    """Bob asks an executor, on its data socket, to write one of his own arrays to ``path``: what it answered."""
    x = ctx.put(torch.full((4,), 6.66), ctx.mesh({"data": 1}, executors=[ctx.executor_ids[0]]), [pw.Replicate()])
    x.result(timeout_s=30)
    saving = data_client_of(ctx).save(ctx.executor_ids[0], [pb.ShardRef(array_id=x.array_id, shard=0)], ["w"], path)
    try:
        saving.result(timeout=30)
    except RemoteError as exc:
        return exc
    raise AssertionError(f"the executor wrote {path!r} for bob")


def test_alices_relative_checkpoint_dir_lands_under_her_folder_and_loads(tenant_service, alice, alices_checkpoint):
    trainer, step_dir = alices_checkpoint
    mine = os.path.join(tenant_service.checkpoint_root, "alice")
    assert alice.checkpoint_root == mine
    assert trainer.checkpoint_dir == os.path.join(mine, "run1")
    assert os.path.dirname(step_dir) == os.path.join(mine, "run1")
    assert sorted(os.listdir(step_dir)) == sorted(["client.safetensors", "index.json",
                                                   *[f"{e}.safetensors" for e in trainer.mesh.executor_ids]])
    with open(os.path.join(mine, "run1", "latest")) as f:
        assert f.read() == os.path.basename(step_dir)
    state = {k: v.clone() for k, v in trainer.state_dict()["model"].items()}
    assert trainer.load("run1")["step"] == 1
    after = trainer.state_dict()["model"]
    assert all(torch.equal(state[k], after[k]) for k in state)
    written = trainer.save("whole")         # written by the client itself: under the root as well
    assert written == os.path.join(mine, "whole", "trainer.safetensors")
    assert trainer.load(os.path.join(mine, "whole"))["step"] == 1


def test_bob_cannot_make_an_executor_write_over_alices_shard(tenant_service, bob, alices_checkpoint):
    _, step_dir = alices_checkpoint
    root = tenant_service.checkpoint_root
    before = _digests(step_dir)
    refused_before = bob.stats()["executors"][bob.executor_ids[0]]["refused_checkpoint_paths"]
    victim = os.path.join(step_dir, "executor-0.safetensors")
    relative = os.path.relpath(victim, os.path.join(root, "bob"))    # ../alice/run1/step-.../executor-0...
    assert relative.startswith("../alice/")
    refusals = {"absolute": _save_straight(bob, victim), "dot-dot": _save_straight(bob, relative)}
    # A link bob plants in his own folder (he can write there) that leads into alice's.
    os.makedirs(os.path.join(root, "bob"), exist_ok=True)
    os.symlink(os.path.dirname(step_dir), os.path.join(root, "bob", "into-alice"))
    refusals["symlink"] = _save_straight(bob, "into-alice/executor-0.safetensors")
    for how, error in refusals.items():
        assert os.path.join(root, "bob") in str(error), (how, error)    # the error names his root
        assert "checkpoint root" in str(error) and error.remote_type == "CheckpointPathError", (how, error)
    assert "outside this client's folder" in str(refusals["absolute"])
    assert "'..'" in str(refusals["dot-dot"]) and "symbolic link" in str(refusals["symlink"])
    # Counted where status shows it.
    assert bob.stats()["executors"][bob.executor_ids[0]]["refused_checkpoint_paths"] == refused_before + 3
    # A link at the file's own name is replaced by his file, never written through.
    os.symlink(victim, os.path.join(root, "bob", "mine.safetensors"))
    x = bob.put(torch.ones(2), bob.mesh({"data": 1}, executors=[bob.executor_ids[0]]), [pw.Replicate()])
    x.result(timeout_s=30)
    data_client_of(bob).save(bob.executor_ids[0], [pb.ShardRef(array_id=x.array_id, shard=0)], ["w"],
                   "mine.safetensors").result(timeout=30)
    assert not os.path.islink(os.path.join(root, "bob", "mine.safetensors"))
    assert _digests(step_dir) == before, "alice's checkpoint changed"


def test_bobs_own_client_refuses_a_path_outside_his_folder_before_dispatch(tenant_service, bob, alices_checkpoint):
    _, step_dir = alices_checkpoint
    model = nn.Linear(4, 2)
    trainer = bob.wrap(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=nn.MSELoss(),
                       mesh=bob.mesh({"data": 2}))
    for path in (os.path.dirname(step_dir), "../alice/run1", "/tmp"):
        for attempt in (trainer.save, trainer.load, trainer.save_sharded):
            with pytest.raises(CheckpointPathError, match=os.path.join(tenant_service.checkpoint_root, "bob")):
                attempt(path)
    with pytest.raises(CheckpointPathError):
        bob.wrap(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=nn.MSELoss(),
                 mesh=bob.mesh({"data": 2}), checkpoint_dir="../alice/run1", checkpoint_every=1)


def test_the_executors_trace_shows_bob_none_of_alices_paths(tenant_service, bob, alices_checkpoint, tmp_path):
    trace = bob.trace(str(tmp_path / "trace.json"))["traceEvents"]
    saves = [e for e in trace if e.get("cat") == "save"]
    assert saves, "no save in the executors' trace"
    text = json.dumps(trace)
    assert tenant_service.checkpoint_root not in text and "run1" not in text
