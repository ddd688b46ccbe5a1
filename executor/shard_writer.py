"""Checkpoint shards written by the executor itself, off its compute and I/O threads.

A `SaveShards` request names shards of this executor's store and a file: once every shard is
ready, the worker copies them to host tensors (so the store may free them at once) and hands
them here; one background thread writes them as one safetensors file (no pickle), to
``path + ".partial"``, flushed to disk, then renamed into place and the folder flushed too
(`pathways_torch.wire.durable`) — a process killed or a power lost mid-write leaves no file under the
final name. The reply says how many bytes were written.
"""

from __future__ import annotations

import concurrent.futures
import os

from pathways_torch.wire.durable import replace_durably

__all__ = ["ShardWriter", "check_save_path"]


def check_save_path(path: str) -> None:
    """A shard file must be an absolute ``.safetensors`` path (the client names it; nothing else is written)."""
    if not os.path.isabs(path) or not path.endswith(".safetensors") or "\0" in path:
        raise ValueError(f"save: expected an absolute path ending in .safetensors, got {path!r}")


class ShardWriter:
    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pathways-save")

    def write(self, path: str, tensors: dict, on_done) -> None:
        """Write ``tensors`` (name → host tensor) to ``path`` in the background; ``on_done(bytes, error)``."""
        def run():
            try:
                on_done(_write(path, tensors), None)
            except Exception as exc:   # noqa: BLE001 - reported to the client, who decides
                on_done(0, exc)

        self._pool.submit(run)


def _write(path: str, tensors: dict) -> int:
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = path + ".partial"
    save_file({n: t.contiguous() for n, t in tensors.items()}, partial)
    replace_durably(partial, path)
    return sum(t.numel() * t.element_size() for t in tensors.values())
