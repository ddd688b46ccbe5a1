"""Checkpoints as one safetensors file plus its JSON metadata: no pickle, written atomically.

The file holds unsharded tensors named ``model/<name>``, ``optimizer/<param>/<state>``
and ``rng/torch``, so a checkpoint saved under one plan or mesh size loads under
any other. It is written to a temporary name and renamed into place, so a run
killed mid-save leaves the previous checkpoint whole.
"""

from __future__ import annotations

import json
import os

__all__ = ["write_checkpoint", "read_checkpoint", "CHECKPOINT_FILE"]

CHECKPOINT_FILE = "trainer.safetensors"
_FORMAT = "pathways_torch.trainer/1"


def write_checkpoint(path: str, tensors: dict, meta: dict) -> str:
    """Write ``tensors`` and ``meta`` under directory ``path``; returns the file's path."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    target = os.path.join(path, CHECKPOINT_FILE)
    partial = target + ".partial"
    contiguous = {name: t.detach().contiguous() for name, t in tensors.items()}
    save_file(contiguous, partial, metadata={"format": _FORMAT, "meta": json.dumps(meta, sort_keys=True)})
    os.replace(partial, target)
    return target


def read_checkpoint(path: str) -> tuple[dict, dict]:
    """(tensors, meta) of a checkpoint directory (or file) written by `write_checkpoint`."""
    from safetensors import safe_open

    target = os.path.join(path, CHECKPOINT_FILE) if os.path.isdir(path) else path
    if not os.path.exists(target):
        raise FileNotFoundError(f"checkpoint: expected {target} (written by trainer.save), found nothing there")
    tensors = {}
    with safe_open(target, framework="pt") as f:
        header = f.metadata() or {}
        if header.get("format") != _FORMAT:
            raise ValueError(f"checkpoint {target}: expected format {_FORMAT!r}, got {header.get('format')!r}")
        for name in f.keys():
            tensors[name] = f.get_tensor(name)
    return tensors, json.loads(header["meta"])
