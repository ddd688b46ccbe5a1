"""Checkpoint shards written by the executor itself, off its compute and I/O threads.

A `SaveShards` request names shards of this executor's store and a file: once every shard is
ready, the worker copies them to host tensors (so the store may free them at once) and hands
them here; one background thread writes them as one safetensors file (no pickle), under a
``.partial`` name, flushed to disk, then renamed into place and the folder flushed too
(`pathways_torch.wire.durable`) — a process killed or a power lost mid-write leaves no file under the
final name, and a write that fails removes its ``.partial``.

Where (`save_target`): the embedded run's client (role ``client``) names any absolute ``.safetensors`` path, as
ever. A service client (``client-<name>``, a stranger to the others) writes under its own folder of the checkpoint
root alone, ``--checkpoint-root DIR`` → ``DIR/<name>/`` (`pathways_torch.wire.checkpoint_paths`): the path is checked
before anything is written, and the file is written through folders opened one by one from the root's real path
with ``O_NOFOLLOW``, so no symbolic link (a tenant may plant one in its folder) leads the write anywhere else.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import os
import shutil
import stat

from pathways_torch.wire.checkpoint_paths import (DEFAULT_CHECKPOINT_ROOT, SHARD_SUFFIX, CheckpointPathError,
                                                  client_root, relative_to_root)
from pathways_torch.wire.durable import replace_durably
from pathways_torch.wire.security import CLIENT, client_name

__all__ = ["ShardWriter", "SaveTarget", "check_save_path", "save_target", "DEFAULT_CHECKPOINT_ROOT"]

_PARTIAL = ".partial"
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def check_save_path(path: str) -> None:
    """The embedded run's shard file: an absolute ``.safetensors`` path (the client names it; nothing else is
    written)."""
    if not os.path.isabs(path) or not path.endswith(SHARD_SUFFIX) or "\0" in path:
        raise ValueError(f"save: expected an absolute path ending in .safetensors, got {path!r}")


@dataclasses.dataclass(frozen=True)
class SaveTarget:
    """Where one shard file goes: ``path`` (the embedded client's own, absolute), or ``parts`` under ``root``."""

    path: str                  # as the client named it
    root: str | None = None    # a service client's folder of the checkpoint root (None: the embedded client)
    parts: tuple = ()          # the folders below ``root``, then the file's name

    @property
    def shown(self) -> str:
        """What the executor's trace (which every client of the service may read) says of it: no service client's
        path."""
        return self.path if self.root is None else ""


def save_target(role: str | None, path: str, checkpoint_root: str) -> SaveTarget:
    """Where a save of ``path`` asked by a client key of ``role`` writes, or the error saying why it may not: before
    a byte is written. ``checkpoint_root``: this executor's ``--checkpoint-root`` (absolute)."""
    if role == CLIENT:
        check_save_path(path)
        return SaveTarget(path)
    name = client_name(role)
    if name is None:   # the data gate lets clients alone save: an internal error if this comes
        raise PermissionError(f"save from {role!r}: expected a client's key (refused)")
    root = client_root(checkpoint_root, name)
    rest = relative_to_root(root, path)
    if not rest.endswith(SHARD_SUFFIX) or rest.rsplit("/", 1)[-1] == SHARD_SUFFIX:
        raise CheckpointPathError(f"checkpoint path {path!r}: expected a file name ending in {SHARD_SUFFIX} under "
                                  f"this client's folder of the checkpoint root, {root}/ (refused)")
    return SaveTarget(path, root, tuple(rest.split("/")))


class ShardWriter:
    """Writes shard files on a thread of its own. ``checkpoint_root``: where service clients' checkpoints live
    (``DIR``; each client under ``DIR/<name>/``), absolute."""

    def __init__(self, checkpoint_root: str = DEFAULT_CHECKPOINT_ROOT):
        self.checkpoint_root = os.path.abspath(checkpoint_root)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pathways-save")

    def target(self, role: str | None, path: str) -> SaveTarget:
        """`save_target` under this executor's root."""
        return save_target(role, path, self.checkpoint_root)

    def write(self, target: SaveTarget, tensors: dict, on_done) -> None:
        """Write ``tensors`` (name → host tensor) to ``target`` in the background; ``on_done(bytes, error)``."""
        def run():
            try:
                if target.root is None:
                    on_done(_write(target.path, tensors), None)
                else:
                    on_done(_write_under_root(self.checkpoint_root, target, tensors), None)
            except Exception as exc:   # noqa: BLE001 - reported to the client, who decides
                on_done(0, exc)

        self._pool.submit(run)


def _nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _write(path: str, tensors: dict) -> int:
    """The embedded client's file: its own path, folders made as needed."""
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = path + _PARTIAL
    try:
        save_file({n: t.contiguous() for n, t in tensors.items()}, partial)
        replace_durably(partial, path)
    except BaseException:
        _remove_quietly(partial)
        raise
    return _nbytes(tensors)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# ---------------------------------------------------------------- a service client's file, under the root


def _write_under_root(checkpoint_root: str, target: SaveTarget, tensors: dict) -> int:
    """Write ``target``'s file through folders opened from the root's real path without following links; the
    safetensors file is made in a private ``<file>.partial`` folder (its writer renames a temporary file into
    place), flushed, then renamed into the client's folder, and the private folder removed even on failure."""
    real_root = os.path.realpath(checkpoint_root)   # the operator's own path: links in it are the operator's
    os.makedirs(real_root, exist_ok=True)
    name = os.path.basename(target.root)
    folder = _open_folders(real_root, (name, *target.parts[:-1]), target)
    try:
        _check_inside(folder, real_root, target)
        file_name = target.parts[-1]
        private = file_name + _PARTIAL
        _clear(folder, private)
        os.mkdir(private, 0o700, dir_fd=folder)
        try:
            _write_in_private_folder(folder, private, file_name, tensors)
            _move_out(folder, private, file_name, target)
        finally:
            _clear(folder, private)
        _fsync_fd(folder)
    finally:
        os.close(folder)
    return _nbytes(tensors)


def _open_at(folder: int, name: str, target: SaveTarget) -> int:
    try:
        return os.open(name, _FOLDER, dir_fd=folder)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CheckpointPathError(
                f"checkpoint path {target.path!r}: {name!r} is a symbolic link or not a folder; under this "
                f"client's folder of the checkpoint root, {target.root}/, no component may be a link (refused)"
            ) from None
        raise


def _open_folders(real_root: str, names: tuple, target: SaveTarget) -> int:
    """The folder ``real_root``/names..., made where missing, each opened without following a link: its fd."""
    fd = os.open(real_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in names:
            try:
                os.mkdir(name, dir_fd=fd)      # never follows a link: one planted here makes it fail (EEXIST)
            except FileExistsError:
                pass
            inner = _open_at(fd, name, target)
            os.close(fd)
            fd = inner
        return fd
    except BaseException:
        os.close(fd)
        raise


def _check_inside(folder: int, real_root: str, target: SaveTarget) -> None:
    """Belt and braces: the folder opened is under the root's real path (what the kernel says it is)."""
    proc = f"/proc/self/fd/{folder}"
    if not os.path.exists(proc):
        return
    where = os.readlink(proc)
    if where != real_root and not where.startswith(real_root.rstrip("/") + "/"):
        raise CheckpointPathError(f"checkpoint path {target.path!r}: it leads to {where}, outside the checkpoint "
                                  f"root {real_root} (refused)")


def _clear(folder: int, name: str) -> None:
    """Remove ``name`` in ``folder`` if it is there (a link or a file: the entry itself; a folder: its contents,
    without following links)."""
    try:
        mode = os.lstat(name, dir_fd=folder).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(name, dir_fd=folder)
    else:
        os.unlink(name, dir_fd=folder)


def _write_in_private_folder(folder: int, private: str, file_name: str, tensors: dict) -> None:
    from safetensors.torch import save, save_file

    contiguous = {n: t.contiguous() for n, t in tensors.items()}
    inner = os.open(private, _FOLDER, dir_fd=folder)
    try:
        if os.path.isdir(f"/proc/self/fd/{inner}"):   # the folder itself, by the kernel's handle: no path to race
            save_file(contiguous, f"/proc/self/fd/{inner}/{file_name}")
        else:   # no /proc: the bytes in memory, written to a file made here (never through a link)
            data = save(contiguous)
            out = os.open(file_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                          dir_fd=inner)
            try:
                os.write(out, data)
            finally:
                os.close(out)
        done = os.open(file_name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=inner)
        try:
            if not stat.S_ISREG(os.fstat(done).st_mode):
                raise CheckpointPathError(f"checkpoint file {file_name!r}: expected a plain file (refused)")
            os.fsync(done)
        finally:
            os.close(done)
    finally:
        os.close(inner)


def _move_out(folder: int, private: str, file_name: str, target: SaveTarget) -> None:
    """Rename the finished file from the private folder into ``folder`` (a link at its name is replaced, never
    followed)."""
    inner = _open_at(folder, private, target)
    try:
        os.rename(file_name, file_name, src_dir_fd=inner, dst_dir_fd=folder)
    finally:
        os.close(inner)


def _fsync_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):   # a mount that cannot sync a folder
            raise
