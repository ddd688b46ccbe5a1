"""Where a service client's checkpoints may live: under ``DIR/<client name>/`` of the checkpoint root, nowhere else.

A `pathways-controller` serves strangers, and its executors write checkpoint shards for them (the executors run as
the operator, not as the tenant). So a service client's checkpoint paths — ``checkpoint_dir=``, ``trainer.save``,
``trainer.load`` on the client, every ``SaveShards`` on an executor — resolve under its own folder of the root
(``--checkpoint-root DIR``):

- a relative path lands under ``DIR/<name>/``; an absolute one is taken only if it is already under it;
- a ``..`` component is refused (whatever it would normalise to), and so is a NUL;
- below ``DIR/<name>/`` (that folder included) no component may be a symbolic link: a link could lead out, and a
  link another tenant planted could lead into someone else's folder. The executor makes this hold when it writes
  (`executor.shard_writer`: every folder opened with ``O_NOFOLLOW`` under the root's real path); the client checks
  the same before it writes or reads, so a refusal comes before anything is dispatched.

The embedded single-script context (the role ``client``) has no root: its paths are the user's own, as ever.
Pure path arithmetic plus ``lstat``: the executors import this (they may import nothing else of ``pathways_torch``).
"""

from __future__ import annotations

import os
import stat

__all__ = ["CheckpointPathError", "relative_to_root", "client_root", "resolve_under_root", "SHARD_SUFFIX",
           "DEFAULT_CHECKPOINT_ROOT"]

SHARD_SUFFIX = ".safetensors"
# The root when --checkpoint-root does not say: in the working directory of the controller (and of each executor).
DEFAULT_CHECKPOINT_ROOT = "pathways-checkpoints"


class CheckpointPathError(ValueError):
    """A checkpoint path that is not under the client's checkpoint root (or passes through a symbolic link)."""


def client_root(root: str, name: str) -> str:
    """``root``/``name``: a service client's own folder of the checkpoint root (``root`` absolute)."""
    return os.path.join(os.path.abspath(root), name)


def _refuse(path, root: str, why: str) -> CheckpointPathError:
    return CheckpointPathError(
        f"checkpoint path {path!r}: {why}. A client of this service keeps its checkpoints under its own folder "
        f"of the checkpoint root, {root}/ (pathways-controller --checkpoint-root); pass a path relative to it "
        f"(e.g. 'run1'), or an absolute one under it, without '..' or symbolic links")


def relative_to_root(root: str, path) -> str:
    """``path`` as a path relative to ``root`` (``""``: the root itself), checked by its text alone: a string with
    no NUL, relative or absolute under ``root``, with no ``..`` component. Raises `CheckpointPathError`."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        raise _refuse(path, root, f"expected a str path, got a {type(path).__name__}")
    if "\0" in path:
        raise _refuse(path, root, "it holds a NUL character")
    if os.path.isabs(path):
        rest = _under(root, path)
        if rest is None:
            raise _refuse(path, root, "it is outside this client's folder of the checkpoint root")
    else:
        rest = path
    parts = [p for p in rest.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise _refuse(path, root, "it has a '..' component")
    return "/".join(parts)


def _under(root: str, path: str) -> str | None:
    """What follows ``root`` in the absolute ``path`` (``""``: the root), or None if ``path`` is not under it. The
    root is compared as written and with its parent's real path (a root reached through the operator's own link;
    the client's folder itself is never followed)."""
    root = os.path.abspath(root)
    real = os.path.join(os.path.realpath(os.path.dirname(root)), os.path.basename(root))
    for base in dict.fromkeys((root, real)):
        if path == base or path.rstrip("/") == base:
            return ""
        if path.startswith(base.rstrip("/") + "/"):
            return path[len(base.rstrip("/")) + 1:]
    return None


def resolve_under_root(root: str, path) -> str:
    """The absolute path ``path`` stands for under ``root`` (a service client's folder), checked as
    `relative_to_root` does and, for the part that exists, with no symbolic link from ``root`` down (``root``
    included): the client's own check before it writes or reads (the executors check again when they write)."""
    rest = relative_to_root(root, path)
    resolved = os.path.join(os.path.abspath(root), rest) if rest else os.path.abspath(root)
    current = os.path.abspath(root)
    for part in [""] + (rest.split("/") if rest else []):
        current = os.path.join(current, part) if part else current
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError:
            break       # nothing below a missing folder exists yet: it is made as a plain folder
        if stat.S_ISLNK(mode):
            raise _refuse(path, root, f"{current} is a symbolic link")
    return resolved
