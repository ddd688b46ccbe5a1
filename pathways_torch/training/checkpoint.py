"""Checkpoints as one safetensors file plus its JSON metadata: no pickle, written atomically.

The file holds unsharded tensors named ``model/<name>``, ``optimizer/<param>/<state>``
and ``rng/torch``, so a checkpoint saved under one plan or mesh size loads under
any other. It is written to a temporary name, flushed to disk and renamed into place (the
directory flushed too: `wire.durable`), so a run killed or a power lost mid-save leaves the previous
checkpoint whole.
"""

from __future__ import annotations

import json
import os

from ..wire.durable import replace_durably

__all__ = ["write_checkpoint", "read_checkpoint", "check_matches", "load_checkpoint", "CHECKPOINT_FILE"]

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
    replace_durably(partial, target)
    return target


def read_checkpoint(path: str) -> tuple[dict, dict]:
    """(tensors, meta) of a checkpoint directory (or file) written by `write_checkpoint`, or of one written by
    the executors (`sharded_checkpoint`: its ``latest`` step)."""
    from safetensors import safe_open

    from .sharded_checkpoint import is_sharded, read_sharded

    if is_sharded(path):
        return read_sharded(path)

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


def check_matches(path: str, tensors: dict, expected: dict) -> None:
    """Refuse a checkpoint whose names or shapes differ from ``expected`` (name → tensor), listing each."""
    names = set(expected)
    missing = sorted(names - set(tensors))
    unexpected = sorted(set(tensors) - names - {"rng/torch"})
    shapes = sorted(f"{n}: checkpoint {list(tensors[n].shape)}, here {list(expected[n].shape)}"
                    for n in names & set(tensors) if tuple(tensors[n].shape) != tuple(expected[n].shape))
    if missing or unexpected or shapes:
        parts = [f"missing {_listed(missing)}" if missing else "", f"unexpected {_listed(unexpected)}" if unexpected
                 else "", f"other shapes {_listed(shapes)}" if shapes else ""]
        raise ValueError(f"checkpoint {path}: does not match this model and optimizer: "
                         f"{'; '.join(p for p in parts if p)}; load it into the model (and optimizer kind) it was "
                         f"saved from")


def _listed(items: list, most: int = 8) -> str:
    shown = ", ".join(items[:most])
    return f"[{shown}{f', ... ({len(items)} in all)' if len(items) > most else ''}]"


def load_checkpoint(path: str, model, optimizer=None) -> dict:
    """Load a trainer's checkpoint into a plain eager ``nn.Module`` (and a ``torch.optim`` optimizer built from
    its parameters), whatever plan and mesh saved it; returns the checkpoint's metadata.

    Afterwards eager training continues where the trainer stopped: parameters and buffers, each
    parameter's optimizer state (``exp_avg``/``exp_avg_sq`` and the step count for Adam/AdamW,
    ``momentum_buffer`` for SGD) and the client's torch RNG state are restored. A checkpoint that
    does not match the model (missing or extra names, other shapes) is refused, listing them.
    """
    import torch

    from .optimizers import read_optimizer

    tensors, meta = read_checkpoint(path)
    params = dict(model.named_parameters())
    state = model.state_dict(keep_vars=True)
    # A tied tensor is saved once, under its first name (named_parameters' name); its other names are aliases.
    first_names = {id(t): n for n, t in [*model.named_buffers(), *params.items()]}
    aliases = {k: first_names[id(t)] for k, t in state.items() if first_names.get(id(t), k) != k}
    expected = {f"model/{n}": t for n, t in state.items() if n not in aliases}
    if optimizer is not None:
        spec = read_optimizer(optimizer)
        if meta.get("optimizer") != spec.kind:
            raise ValueError(f"checkpoint {path}: saved with a {meta.get('optimizer')!r} optimizer, this one is "
                             f"{spec.kind!r} ({type(optimizer).__name__})")
        trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for name, p in params.items():
            if id(p) in trained and p.requires_grad:
                expected.update({f"optimizer/{name}/{state}": p for state in spec.state_names})
    else:
        tensors = {n: t for n, t in tensors.items() if not n.startswith("optimizer/")}
    check_matches(path, tensors, expected)
    loaded = {n.removeprefix("model/"): t for n, t in tensors.items() if n.startswith("model/")}
    loaded.update({alias: loaded[name] for alias, name in aliases.items()})
    with torch.no_grad():
        model.load_state_dict(loaded)
    if optimizer is not None:
        _load_optimizer_state(optimizer, params, tensors, int(meta["step"]), spec.kind)
    if "rng/torch" in tensors:
        torch.set_rng_state(tensors["rng/torch"])
    return meta


def _load_optimizer_state(optimizer, params: dict, tensors: dict, step: int, kind: str) -> None:
    import torch

    for key, value in tensors.items():
        if not key.startswith("optimizer/"):
            continue
        name, state = key.removeprefix("optimizer/").rsplit("/", 1)
        param = params[name]
        slot = optimizer.state[param]
        slot[state] = value.to(param.dtype).clone()
        if kind == "adam":      # torch's Adam/AdamW keep the step count per parameter, as a float tensor
            slot["step"] = torch.tensor(float(step))
