"""Files that survive a power loss: write under a temporary name, fsync it, rename, fsync the directory.

A rename alone is atomic against a killed process but not against a power loss: until the file's
blocks and the directory's new entry reach the disk, a crash can leave the old name, the new name
with no data, or neither. Every checkpoint writer (the client's trainer file, index and ``latest``
pointer; the executors' shard files) goes through `replace_durably`. It lives in ``wire`` because
the executors may import nothing else of ``pathways_torch``; it imports nothing but ``os``.
"""

from __future__ import annotations

import errno
import os

__all__ = ["replace_durably", "fsync_file", "fsync_dir"]

# What a filesystem that cannot sync a directory answers (some network and FUSE mounts): there is nothing more
# to do there, the rename is as durable as that filesystem makes it.
_NO_DIRECTORY_SYNC = (errno.EINVAL, errno.ENOTSUP, errno.EBADF)


def fsync_file(path: str) -> None:
    """Flush ``path``'s data and metadata to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Flush directory ``path``'s entries (a rename or a new file in it) to the disk."""
    fd = os.open(path or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_DIRECTORY_SYNC:
            raise
    finally:
        os.close(fd)


def replace_durably(partial: str, target: str) -> None:
    """Rename the finished file ``partial`` to ``target``, durably: its data reaches the disk before the name
    does, and the name before this returns."""
    fsync_file(partial)
    os.replace(partial, target)
    fsync_dir(os.path.dirname(os.path.abspath(target)))
