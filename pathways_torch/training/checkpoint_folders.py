"""The step folders of a checkpoint directory: fresh ones for each save, and only the newest few kept.

A directory that executors write checkpoints into (`sharded_checkpoint`) holds one ``step-*`` folder per
save and a ``latest`` file naming one of them. Two rules keep it whole and bounded:

- A save writes into a folder no save has used (`claim`): ``step-00000150``, or ``step-00000150-1`` ... when
  that name is taken (a resumed run saving again at the step it loaded). So a crash mid-save never leaves a
  folder mixing two states; ``latest`` moves to the new folder only once it is complete.
- After ``latest`` names the new folder, all but the ``keep`` newest complete checkpoints are removed
  (`remove_old`; ``keep=0`` keeps all). Never removed: the folder ``latest`` names, a folder being
  written, and a folder being read (a recovery restoring it, a ``trainer.load``), and the one a trainer's
  recovery would restore; these are *pinned* (`pin`, `reading`) while they are in use, in this process and in
  every other: a pinned folder is held open with a shared ``flock`` on the folder itself, and a removal takes
  an exclusive one, without waiting, before it renames the folder (a folder another process pins stays).
  Folders a failed or killed save left without an index, older than the new checkpoint, are removed too.

"Newest" is the order in which checkpoints were completed (their index's modification time), not their
step number: after loading an older step, the folders of the abandoned future are the first to go.
A folder is removed by renaming it to ``.removing-<name>`` first, so a crash mid-removal never leaves a
``step-*`` folder with files missing; a later removal finishes the job. Two processes may read and prune
one directory at once (a trainer saving, another process loading its ``latest``), but two writing it at once
fight over ``latest``: that is not supported. A filesystem without ``flock`` (some network mounts) keeps the
protection within each process.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
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
# Each pinned folder held open with a shared flock (real path → fd): other processes' removals see it in use.
_held: dict[str, int] = {}
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EBADF, errno.EINVAL)   # a filesystem without flock


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
    """Keep ``path`` from being removed until as many `unpin` s (by this process or any other)."""
    with _lock:
        _hold(path)


def unpin(path: str) -> None:
    with _lock:
        key = _real(path)
        _pins[key] -= 1
        if _pins[key] <= 0:
            del _pins[key]
            fd = _held.pop(key, None)
            if fd is not None:
                os.close(fd)      # its shared lock goes with it


def _hold(path: str) -> bool:
    """Pin ``path`` (under ``_lock``); its first pin here takes the shared lock that other processes' removals
    respect. False if the folder was removed (renamed away) before the lock was had: then it is not pinned."""
    key = _real(path)
    if not _pins[key]:
        fd = _shared_lock(path)
        if fd == -1:
            del _pins[key]
            return False
        if fd is not None:
            _held[key] = fd
    _pins[key] += 1
    return True


def _shared_lock(path: str) -> int | None:
    """``path`` opened and share-locked: its fd; -1 if another process's removal took it before the lock was had;
    None where no lock can be had (no such folder yet, or a filesystem without flock): the pin holds here only."""
    try:
        fd = os.open(path, _FOLDER)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)    # waits only while a removal renames it (one rename)
        here = os.stat(path)
    except OSError as exc:
        os.close(fd)
        return -1 if isinstance(exc, FileNotFoundError) else None
    opened = os.fstat(fd)
    if (here.st_dev, here.st_ino) != (opened.st_dev, opened.st_ino):   # renamed away while we waited
        os.close(fd)
        return -1
    return fd


@contextlib.contextmanager
def _unless_pinned_elsewhere(path: str):
    """True, with an exclusive lock on ``path`` held until the block ends (the rename happens under it), or False
    if another process pins it (holds a shared lock): not waited for, the folder stays."""
    try:
        fd = os.open(path, _FOLDER | os.O_NOFOLLOW)
    except OSError:       # gone, or a link (never ours): the rename decides, as before
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            free = True
        except BlockingIOError:
            free = False
        except OSError as exc:
            if exc.errno not in _NO_LOCKS:
                raise
            free = True   # no locks on this filesystem: the protection holds within each process only
        yield free
    finally:
        os.close(fd)


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
            _hold(path)
        return path
    raise AssertionError("unreachable")


def resolve(path: str) -> str:
    """The step folder ``path`` stands for: the one its ``latest`` names, or ``path`` itself."""
    pointer = os.path.join(path, LATEST)
    if os.path.exists(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        if not name or "/" in name or name in (".", "..") or "\0" in name:   # `save_sharded` writes a folder's name
            raise ValueError(f"checkpoint {pointer}: expected the name of a step folder beside it (such as "
                             f"step-00000150), got {name!r}; it names no folder of this directory")
        return os.path.join(path, name)
    return path


@contextlib.contextmanager
def reading(path: str):
    """The step folder ``path`` stands for (`resolve`), pinned while the caller reads it. ``latest`` may move
    and the folder it named be removed between reading the pointer and pinning: then the pointer is read again."""
    for _ in range(3):
        step_dir = resolve(path)
        with _lock:
            if os.path.isdir(step_dir) and _hold(step_dir):
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
        with _lock, _unless_pinned_elsewhere(path) as free:
            if not free or _real(path) in _pins or _real(path) in {_real(newest), _real(resolve(directory))}:
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
