"""The step folders of a checkpoint directory: fresh ones for each save, and only the newest few kept.

A directory that executors write checkpoints into (`sharded_checkpoint`) holds one ``step-*`` folder per
save and a ``latest`` file naming one of them. Two rules keep it whole and bounded:

- A save writes into a folder no save has used (`claim`): ``step-00000150``, or ``step-00000150-1`` ... when
  that name is taken (a resumed run saving again at the step it loaded). So a crash mid-save never leaves a
  folder mixing two states; ``latest`` moves to the new folder only once it is complete.
- After ``latest`` names the new folder, all but the ``keep`` newest complete checkpoints are removed
  (`remove_old`; ``keep=0`` keeps all). Never removed: the folder ``latest`` names, a folder being
  written, and a folder being read (a recovery restoring it, a ``trainer.load``), and the one a trainer's
  recovery would restore; these are *pinned* in this process (`pin`, `reading`) while they are in use.
  Folders a failed or killed save left without an index, older than the new checkpoint, are removed too.

"Newest" is the order in which checkpoints were completed (their index's modification time), not their
step number: after loading an older step, the folders of the abandoned future are the first to go.
A folder is removed by renaming it to ``.removing-<name>`` first, so a crash mid-removal never leaves a
``step-*`` folder with files missing; a later removal finishes the job. Pins are per process: two
processes writing one directory at once are not supported (``latest`` would be theirs to fight over).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import numbers
import os
import re
import shutil
import threading

from ..wire.durable import fsync_dir

__all__ = ["check_keep", "claim", "pin", "unpin", "reading", "resolve", "remove_old", "DEFAULT_KEEP", "LATEST",
           "INDEX"]

log = logging.getLogger(__name__)

DEFAULT_KEEP = 3
# The directory's two names every reader and writer agrees on (`sharded_checkpoint` writes them).
LATEST, INDEX = "latest", "index.json"
_STEP, _REMOVING = "step-", ".removing-"
_OURS = re.compile(r"^step-\d{8}(-\d+)?$")   # the names `claim` makes

# Folders in use in this process (real path → how many users); taken with every removal decision, so a
# folder pinned before `remove_old` looks is never removed, and one removed is never handed to a reader.
_lock = threading.Lock()
_pins: collections.Counter = collections.Counter()


def check_keep(value) -> int:
    """``checkpoint_keep`` as an int, or the error naming the value (called before anything is dispatched)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"checkpoint_keep={value!r}: expected an int, the number of newest checkpoints to keep "
                        f"(0 keeps all), got a {type(value).__name__}; pass e.g. checkpoint_keep={DEFAULT_KEEP}")
    if value < 0:
        raise ValueError(f"checkpoint_keep={value!r}: expected the number of newest checkpoints to keep, >= 1, "
                         f"or 0 to keep all; pass e.g. checkpoint_keep={DEFAULT_KEEP}")
    return int(value)


def _real(path: str) -> str:
    return os.path.realpath(path)


def pin(path: str) -> None:
    """Keep ``path`` from being removed until as many `unpin` s."""
    with _lock:
        _pins[_real(path)] += 1


def unpin(path: str) -> None:
    with _lock:
        key = _real(path)
        _pins[key] -= 1
        if _pins[key] <= 0:
            del _pins[key]


def claim(directory: str, step: int) -> str:
    """A new, empty step folder for step ``step`` under ``directory``, pinned (the caller unpins it once the
    save is over): ``step-<step>`` or, when that name is taken, ``step-<step>-<n>``."""
    os.makedirs(directory, exist_ok=True)
    base = os.path.join(os.path.abspath(directory), f"{_STEP}{step:08d}")
    for n in itertools.count():
        path = base if n == 0 else f"{base}-{n}"
        with _lock:
            try:
                os.mkdir(path)        # fails if any save (of any run) used the name: never write into one
            except FileExistsError:
                continue
            _pins[_real(path)] += 1
        return path
    raise AssertionError("unreachable")


def resolve(path: str) -> str:
    """The step folder ``path`` stands for: the one its ``latest`` names, or ``path`` itself."""
    pointer = os.path.join(path, LATEST)
    if os.path.exists(pointer):
        with open(pointer) as f:
            return os.path.join(path, f.read().strip())
    return path


@contextlib.contextmanager
def reading(path: str):
    """The step folder ``path`` stands for (`resolve`), pinned while the caller reads it. ``latest`` may move
    and the folder it named be removed between reading the pointer and pinning: then the pointer is read again."""
    for _ in range(3):
        step_dir = resolve(path)
        with _lock:
            if os.path.isdir(step_dir):
                _pins[_real(step_dir)] += 1
                break
    else:
        yield step_dir          # gone: the read names what is missing
        return
    try:
        yield step_dir
    finally:
        unpin(step_dir)


def _scan(directory: str, keep: int, newest: str) -> tuple[list[str], list[str]]:
    """(removals a crash interrupted, the step folders to remove: all but the ``keep`` newest complete ones, and
    index-less ones older than ``newest``)."""
    newest_ns = _mtime_ns(os.path.join(newest, INDEX))
    removing, complete, abandoned = [], [], []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.startswith(_REMOVING):
            removing.append(path)
            continue
        if not _OURS.match(name) or not os.path.isdir(path):   # a user's own "step-best" is not ours to remove
            continue
        index_ns = _mtime_ns(os.path.join(path, INDEX))
        if index_ns >= 0:
            complete.append((index_ns, name))
        elif _mtime_ns(path) < newest_ns:
            abandoned.append(name)
    complete.sort(reverse=True)
    return removing, [name for _, name in complete[keep:]] + abandoned


def _mtime_ns(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return -1


def remove_old(directory: str, keep: int, newest: str) -> list[str]:
    """Once ``latest`` names ``newest``: remove all but the ``keep`` newest complete checkpoints in ``directory``
    (never a pinned one, ``latest``'s, or ``newest``), and index-less folders older than ``newest``. Returns the
    names removed. A folder that cannot be removed is logged and left: the save it follows has succeeded."""
    if keep == 0:
        return []
    directory = os.path.abspath(directory)
    removing, doomed = _scan(directory, keep, newest)   # no lock: a listing and a stat per folder take a while
    removed = []
    for name in doomed:
        path = os.path.join(directory, name)
        target = os.path.join(directory, f"{_REMOVING}{name}")
        # Each folder is judged under the lock just before its rename: a reader or a save that pinned it since the
        # scan keeps it, and one that pins after the rename finds it gone. The lock is held for one rename only:
        # a step's dispatch (a save's `claim`) must not wait behind a scan of network storage.
        with _lock:
            if _real(path) in _pins or _real(path) in {_real(newest), _real(resolve(directory))}:
                continue
            try:
                os.rename(path, target)       # out of `step-*` at once: never a half-removed checkpoint
            except OSError as exc:
                log.warning("checkpoint: could not remove %s (%s); it stays", path, exc)
                continue
        removing.append(target)
        removed.append(name)
    if removed:
        fsync_dir(directory)   # the renames, before the contents go: a power loss never brings back half a folder
    for path in removing:     # outside the lock: removing a large folder takes a while
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass                      # another save's removal took it
        except OSError as exc:
            log.warning("checkpoint: could not remove %s (%s); the next save tries again", path, exc)
    return removed
