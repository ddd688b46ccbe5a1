"""Checkpoint folders on disk (issue 26): each save claims a folder no save used, only the ``keep`` newest
checkpoints stay and never the one ``latest`` names, one being written or one being read; ``checkpoint_keep``
must be an int >= 0; every writer flushes the file and its folder to disk."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pathways_torch.training import checkpoint_folders as folders
from pathways_torch.training.sharded_checkpoint import INDEX, LATEST

pytestmark = pytest.mark.timeout(60)


def _checkpoint(directory, name: str, when_s: float, complete: bool = True) -> str:
    """A step folder (``complete``: with its index) last written at ``when_s``."""
    path = os.path.join(directory, name)
    os.makedirs(path)
    with open(os.path.join(path, "executor-0.safetensors"), "w") as f:
        f.write("shards")
    if complete:
        with open(os.path.join(path, INDEX), "w") as f:
            json.dump({}, f)
        os.utime(os.path.join(path, INDEX), (when_s, when_s))
    os.utime(path, (when_s, when_s))
    return path


def _point_latest(directory, name: str) -> None:
    with open(os.path.join(directory, LATEST), "w") as f:
        f.write(name)


def _steps(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n != LATEST)


def test_only_the_newest_checkpoints_stay_and_zero_keeps_all(tmp_path):
    for step in range(1, 6):
        _checkpoint(tmp_path, f"step-0000000{step}", 1000.0 + step)
    _point_latest(tmp_path, "step-00000005")
    assert folders.remove_old(str(tmp_path), 0, str(tmp_path / "step-00000005")) == []
    assert len(_steps(tmp_path)) == 5
    removed = folders.remove_old(str(tmp_path), 2, str(tmp_path / "step-00000005"))
    assert sorted(removed) == ["step-00000001", "step-00000002", "step-00000003"]
    assert _steps(tmp_path) == ["step-00000004", "step-00000005"]     # no `.removing-*` left either


def test_newest_means_last_written_not_the_highest_step(tmp_path):
    """After loading step 2 and saving again, the abandoned future (step 9) goes first."""
    _checkpoint(tmp_path, "step-00000009", 1000.0)
    _checkpoint(tmp_path, "step-00000002", 900.0)
    _checkpoint(tmp_path, "step-00000002-1", 1100.0)
    _checkpoint(tmp_path, "step-00000003", 1200.0)
    _point_latest(tmp_path, "step-00000003")
    folders.remove_old(str(tmp_path), 2, str(tmp_path / "step-00000003"))
    assert _steps(tmp_path) == ["step-00000002-1", "step-00000003"]


def test_folders_the_saves_did_not_name_are_left_alone(tmp_path):
    """A user's own ``step-best`` (a client-written checkpoint: no index) beside the executors' is not theirs."""
    _checkpoint(tmp_path, "step-best", 900.0, complete=False)
    _checkpoint(tmp_path, "step-00000001", 1000.0, complete=False)     # a killed save's leftover: ours, removed
    _checkpoint(tmp_path, "step-00000002", 1100.0)
    _point_latest(tmp_path, "step-00000002")
    folders.remove_old(str(tmp_path), 1, str(tmp_path / "step-00000002"))
    assert _steps(tmp_path) == ["step-00000002", "step-best"]


def test_latest_a_folder_being_written_and_one_being_read_are_never_removed(tmp_path):
    directory = str(tmp_path)
    _checkpoint(directory, "step-00000001", 1000.0)      # what `latest` names (a load went back to it)
    _checkpoint(directory, "step-00000002", 1100.0)      # a recovery reads it meanwhile
    _checkpoint(directory, "step-00000003", 1200.0)
    _checkpoint(directory, "step-00000004", 1300.0)      # the save that just ended
    writing = folders.claim(directory, 5)                # another save, still writing (no index yet)
    os.utime(writing, (900.0, 900.0))
    _checkpoint(directory, "step-00000000", 800.0, complete=False)   # a killed save's debris: no index
    _point_latest(directory, "step-00000001")
    try:
        with folders.reading(os.path.join(directory, "step-00000002")) as reading:
            assert reading.endswith("step-00000002")
            folders.remove_old(directory, 1, os.path.join(directory, "step-00000004"))
            assert _steps(directory) == ["step-00000001", "step-00000002", "step-00000004", "step-00000005"]
        # Read and written: now only `latest`'s and the newest stay.
        folders.unpin(writing)
        _checkpoint(directory, "step-00000006", 1400.0)
        _point_latest(directory, "step-00000006")
        folders.remove_old(directory, 1, os.path.join(directory, "step-00000006"))
        assert _steps(directory) == ["step-00000006"]
    finally:
        if os.path.isdir(writing):
            folders.unpin(writing)


def test_the_folder_a_trainers_recovery_would_restore_stays_until_a_newer_one_is_written(tmp_path):
    """The save's thread notes a new checkpoint before it removes old ones; a recovery that read the previous note
    just before still finds its folder."""
    from pathways_torch.training.recovery import RecoveryLog

    directory = str(tmp_path)
    log = RecoveryLog()
    restored = _checkpoint(directory, "step-00000003", 1000.0)
    log.note_saved(3, restored)
    for step in (4, 5):
        _checkpoint(directory, f"step-0000000{step}", 1000.0 + step)
    _point_latest(directory, "step-00000005")
    folders.remove_old(directory, 1, os.path.join(directory, "step-00000005"))
    assert _steps(directory) == ["step-00000003", "step-00000005"]
    log.note_saved(5, os.path.join(directory, "step-00000005"))
    folders.remove_old(directory, 1, os.path.join(directory, "step-00000005"))
    assert _steps(directory) == ["step-00000005"] and log.saved_step == 5
    log.forget_saved()
    assert log.saved_path is None and not any(p.startswith(os.path.realpath(directory)) for p in folders._pins)


def test_a_save_never_writes_into_a_folder_that_holds_a_checkpoint(tmp_path):
    directory = str(tmp_path)
    old = _checkpoint(directory, "step-00000005", 1000.0)
    before = sorted(os.listdir(old))
    first = folders.claim(directory, 5)
    second = folders.claim(directory, 5)
    try:
        assert [os.path.basename(first), os.path.basename(second)] == ["step-00000005-1", "step-00000005-2"]
        assert os.listdir(first) == [] and sorted(os.listdir(old)) == before
    finally:
        folders.unpin(first)
        folders.unpin(second)


@pytest.mark.parametrize("value,error", [(-1, ValueError), (True, TypeError), (2.5, TypeError), ("3", TypeError),
                                         (None, TypeError)])
def test_a_bad_checkpoint_keep_names_the_value(value, error):
    with pytest.raises(error, match=rf"checkpoint_keep={value!r}: expected"):
        folders.check_keep(value)
    assert folders.check_keep(0) == 0 and folders.check_keep(3) == 3


# ------------------------------------------------------------ durability


@pytest.fixture
def synced(monkeypatch):
    """The paths os.fsync was called on (files and folders), in order."""
    paths = []
    real = os.fsync

    def fsync(fd):
        paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return paths


def _assert_durable(synced: list, path: str) -> None:
    """``path`` was flushed (under its temporary name, before the rename), then its folder."""
    directory = os.path.dirname(os.path.realpath(path))
    assert os.path.realpath(path) + ".partial" in synced, synced
    assert directory in synced[synced.index(os.path.realpath(path) + ".partial"):], synced


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads which file a descriptor is from /proc")
def test_every_checkpoint_writer_flushes_the_file_and_its_folder(tmp_path, synced):
    from executor.shard_writer import _write
    from pathways_torch.training.checkpoint import write_checkpoint
    from pathways_torch.training.sharded_checkpoint import _replace, _write_client_file

    target = write_checkpoint(str(tmp_path / "client"), {"model/w": torch.ones(3)}, {"step": 1})
    _assert_durable(synced, target)
    _write_client_file(str(tmp_path / "client.safetensors"), torch.get_rng_state())
    _assert_durable(synced, str(tmp_path / "client.safetensors"))
    _replace(str(tmp_path / LATEST), "step-00000001")
    _assert_durable(synced, str(tmp_path / LATEST))
    shard = str(tmp_path / "step" / "executor-0.safetensors")
    assert _write(shard, {"bucket0/param": torch.ones(4)}) == 16
    _assert_durable(synced, shard)


def test_a_folder_another_process_reads_is_not_removed_until_it_is_done(tmp_path):
    """Issue 46 ("Also"): a pin holds across processes (a shared flock on the folder), not only in this one."""
    import subprocess
    import sys

    for step in range(1, 4):
        _checkpoint(tmp_path, f"step-0000000{step}", 1000.0 + step)
    _point_latest(tmp_path, "step-00000003")
    reader = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom pathways_torch.training import checkpoint_folders as f\n"
                               f"f.pin({str(tmp_path / 'step-00000001')!r})\nprint('pinned', flush=True)\n"
                               "sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "pinned"
        assert folders.remove_old(str(tmp_path), 1, str(tmp_path / "step-00000003")) == ["step-00000002"]
        assert _steps(tmp_path) == ["step-00000001", "step-00000003"]
    finally:
        reader.communicate("", timeout=30)
    assert folders.remove_old(str(tmp_path), 1, str(tmp_path / "step-00000003")) == ["step-00000001"]


def test_a_latest_that_names_no_folder_beside_it_is_refused(tmp_path):
    _point_latest(tmp_path, "../elsewhere")
    with pytest.raises(ValueError, match="expected the name of a step folder beside it"):
        folders.resolve(str(tmp_path))
