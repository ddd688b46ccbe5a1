"""A service client's checkpoint paths stay under its own folder of the checkpoint root (issue 46, point 1, C1).

The executor is the boundary (`executor.shard_writer`): it resolves every save of a ``client-<name>`` key under
``DIR/<name>/`` and writes through folders opened without following links. The client checks the same first
(`pathways_torch.wire.checkpoint_paths.resolve_under_root`, `Context.checkpoint_path`). The embedded client keeps
its own absolute paths.
"""

from __future__ import annotations

import concurrent.futures
import os

import pytest
import torch

from executor.shard_writer import ShardWriter, save_target
from pathways_torch.wire.checkpoint_paths import CheckpointPathError, relative_to_root, resolve_under_root

pytestmark = pytest.mark.timeout(60)

ALICE = "client-alice"


@pytest.fixture
def root(tmp_path):
    path = tmp_path / "root"
    (path / "alice").mkdir(parents=True)
    (path / "bob").mkdir()
    return str(path)


def _write(writer: ShardWriter, role: str, path: str, tensors=None) -> int:
    """Check and write as the executor does (`DataPlane._on_save`); the bytes written, or the error raised."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    target = writer.target(role, path)
    writer.write(target, tensors or {"w": torch.arange(4.0)},
                 lambda nbytes, error: done.set_exception(error) if error else done.set_result(nbytes))
    return done.result(30)


def _tree(path: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), path) for d, ds, fs in os.walk(path) for n in ds + fs)


def test_a_relative_path_lands_under_the_clients_folder(root):
    assert _write(ShardWriter(root), ALICE, "run1/step-00000001/executor-0.safetensors") == 16
    written = os.path.join(root, "alice", "run1", "step-00000001", "executor-0.safetensors")
    from safetensors.torch import load_file

    assert torch.equal(load_file(written)["w"], torch.arange(4.0))
    assert _tree(os.path.join(root, "alice")) == ["run1", "run1/step-00000001",
                                                  "run1/step-00000001/executor-0.safetensors"]


def test_an_absolute_path_under_the_clients_folder_is_taken(root):
    path = os.path.join(root, "alice", "run1", "x.safetensors")
    _write(ShardWriter(root), ALICE, path)
    assert os.path.isfile(path)


@pytest.mark.parametrize("path", ["/tmp/pathways-test-outside.safetensors", "{root}/bob/victim.safetensors",
                                  "{root}/alice-evil/x.safetensors", "{root}/x.safetensors"])
def test_an_absolute_path_outside_the_clients_folder_is_refused_naming_the_root(root, path):
    path = path.format(root=root)
    with pytest.raises(CheckpointPathError, match=f"outside this client's folder.*{root}/alice/"):
        ShardWriter(root).target(ALICE, path)
    assert not os.path.exists(path)


@pytest.mark.parametrize("path", ["../bob/victim.safetensors", "run/../../bob/victim.safetensors",
                                  "run/../x.safetensors", "{root}/alice/../bob/victim.safetensors"])
def test_a_dot_dot_component_is_refused_whatever_it_normalises_to(root, path):
    with pytest.raises(CheckpointPathError, match=r"'\.\.' component.*" + root):
        ShardWriter(root).target(ALICE, path.format(root=root))


@pytest.mark.parametrize("path,match", [("run/x.safetensors\0.txt", "NUL"), ("run/x.pt", "ending in .safetensors"),
                                        ("run/.safetensors", "ending in .safetensors"), ("", "ending in .safetensors"),
                                        ("run/", "ending in .safetensors")])
def test_a_nul_or_a_file_that_is_no_safetensors_is_refused(root, path, match):
    with pytest.raises(CheckpointPathError, match=match):
        ShardWriter(root).target(ALICE, path)


def test_a_symlink_that_leaves_the_root_is_refused_before_a_byte_is_written(root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, os.path.join(root, "alice", "escape"))
    with pytest.raises(CheckpointPathError, match="symbolic link.*" + root):
        _write(ShardWriter(root), ALICE, "escape/x.safetensors")
    assert os.listdir(outside) == []
    # The client's own check refuses it before anything is dispatched.
    with pytest.raises(CheckpointPathError, match="symbolic link"):
        resolve_under_root(os.path.join(root, "alice"), "escape/x.safetensors")


def test_a_symlinked_component_inside_the_root_is_refused_too(root):
    """A link inside the root may lead into another client's folder: no component may be a link."""
    os.symlink(os.path.join(root, "bob"), os.path.join(root, "alice", "to-bob"))
    os.makedirs(os.path.join(root, "alice", "real"))
    os.symlink(os.path.join(root, "alice", "real"), os.path.join(root, "alice", "inner"))
    for path in ("to-bob/victim.safetensors", "inner/x.safetensors"):
        with pytest.raises(CheckpointPathError, match="symbolic link"):
            _write(ShardWriter(root), ALICE, path)
    assert os.listdir(os.path.join(root, "bob")) == [] and os.listdir(os.path.join(root, "alice", "real")) == []


def test_the_clients_folder_itself_as_a_symlink_is_refused(tmp_path):
    root = tmp_path / "root"
    (root / "bob").mkdir(parents=True)
    os.symlink(root / "bob", root / "alice")
    with pytest.raises(CheckpointPathError, match="symbolic link"):
        _write(ShardWriter(str(root)), ALICE, "x.safetensors")
    with pytest.raises(CheckpointPathError, match="symbolic link"):
        resolve_under_root(str(root / "alice"), "x.safetensors")
    assert os.listdir(root / "bob") == []


def test_a_symlink_at_the_files_name_is_replaced_not_written_through(root, tmp_path):
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"alice's bytes")
    link = os.path.join(root, "alice", "x.safetensors")
    os.symlink(victim, link)
    _write(ShardWriter(root), ALICE, "x.safetensors")
    assert victim.read_bytes() == b"alice's bytes"
    assert os.path.isfile(link) and not os.path.islink(link)


def test_a_failed_write_leaves_no_partial(root, tmp_path, monkeypatch):
    """A save that fails once its ``.partial`` exists removes it (both kinds of client)."""
    import executor.shard_writer as shard_writer

    def fail(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shard_writer, "_move_out", fail)
    monkeypatch.setattr(shard_writer, "replace_durably", fail)
    with pytest.raises(OSError, match="No space"):
        _write(ShardWriter(root), ALICE, "run/x.safetensors")
    assert _tree(os.path.join(root, "alice")) == ["run"]
    embedded = str(tmp_path / "embedded" / "x.safetensors")
    with pytest.raises(OSError, match="No space"):
        _write(ShardWriter(root), "client", embedded)
    assert os.listdir(tmp_path / "embedded") == []


def test_the_embedded_client_keeps_its_own_absolute_paths(tmp_path):
    path = str(tmp_path / "anywhere" / "x.safetensors")
    target = save_target("client", path, "/nonexistent-root")
    assert target.root is None and target.shown == path
    _write(ShardWriter("/nonexistent-root"), "client", path)
    assert os.path.isfile(path)
    with pytest.raises(ValueError, match="absolute"):
        save_target("client", "relative.safetensors", "/r")


def test_the_trace_shows_no_service_clients_path(root):
    assert ShardWriter(root).target(ALICE, "secret-run/x.safetensors").shown == ""


def test_the_clients_own_resolution_matches_the_executors(root):
    mine = os.path.join(root, "alice")
    assert resolve_under_root(mine, "run1") == os.path.join(mine, "run1")
    assert resolve_under_root(mine, os.path.join(mine, "run1", ".")) == os.path.join(mine, "run1")
    assert resolve_under_root(mine, mine) == mine
    assert relative_to_root(mine, "./run1//step/") == "run1/step"
    for path in ("/elsewhere", os.path.join(root, "bob"), "a/../../bob"):
        with pytest.raises(CheckpointPathError, match=mine):
            resolve_under_root(mine, path)


def test_the_root_reaches_the_executors_absolute(tmp_path, monkeypatch):
    """``pathways-executor --checkpoint-root DIR`` (relative: to the working directory at start), and the flag the
    controller gives the executors it starts."""
    from executor.__main__ import parse_args
    from pathways_torch.launch.controller_main import _parser

    monkeypatch.chdir(tmp_path)
    common = ["--controller", "tcp://127.0.0.1:1", "--keys-dir", str(tmp_path)]
    assert parse_args(common).checkpoint_root == str(tmp_path / "pathways-checkpoints")
    assert parse_args([*common, "--checkpoint-root", "ckpt"]).checkpoint_root == str(tmp_path / "ckpt")
    assert _parser().parse_args(["--checkpoint-root", "/srv/ckpt"]).checkpoint_root == "/srv/ckpt"
    assert _parser().parse_args([]).checkpoint_root == "pathways-checkpoints"   # made absolute when serving
