"""Checkpoints written by the executors, in the background: one safetensors file per executor, a JSON index.

``trainer.save_sharded(directory)`` (or ``ctx.wrap(..., checkpoint_dir=, checkpoint_every=K)``) asks each
executor to write the state shards it holds straight to ``directory`` (no tensor bytes through the
client), then writes the index and swaps the ``latest`` pointer:

    directory/
      step-00000150/
        executor-0.safetensors    the flat buckets (or their slices, under a sharded plan) this executor holds
        executor-1.safetensors
        client.safetensors        the client's torch RNG state (a few bytes)
        index.json                how to rebuild every named tensor; written last
      latest                      "step-00000150", replaced by an atomic rename

The save runs in the background: it holds the step's state arrays (a snapshot: the next step makes
new arrays, it does not overwrite these), so step k + 1 is dispatched while step k's shards are
written. Each file is written under a ``.partial`` name and renamed; the index comes after every
file and ``latest`` after the index, so a process killed at any point leaves the previous
checkpoint loadable. ``directory`` must be storage every host sees (a network filesystem, an object
store mount): each executor writes where it runs. No pickle anywhere.

`read_sharded` rebuilds the unsharded named tensors (``model/<name>``, ``optimizer/<param>/<state>``,
``rng/torch``) that `checkpoint.read_checkpoint` returns for a client-written checkpoint, so either
kind loads under any plan and mesh size, and into eager PyTorch (`checkpoint.load_checkpoint`).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import threading

__all__ = ["save_sharded", "read_sharded", "is_sharded", "FORMAT", "LATEST", "INDEX"]

FORMAT = "pathways_torch.sharded/1"
LATEST, INDEX, CLIENT_FILE = "latest", "index.json", "client.safetensors"


def is_sharded(path: str) -> bool:
    return os.path.isdir(path) and (os.path.exists(os.path.join(path, LATEST)) or
                                    os.path.exists(os.path.join(path, INDEX)))


def save_sharded(context, trainer, directory: str, meta: dict, timeout_s: float = 3600.0, *,
                 update_latest: bool = True) -> concurrent.futures.Future:
    """Start writing ``trainer``'s current state under ``directory``; the future resolves to the bytes the
    executors wrote once ``latest`` names this step (``update_latest=False``: ``latest`` is left as it is)."""
    import torch

    directory = os.path.abspath(directory)
    step_dir = os.path.join(directory, f"step-{trainer.step_count:08d}")
    os.makedirs(step_dir, exist_ok=True)
    requests, index = _plan(trainer, step_dir)
    index["meta"] = meta
    rng = torch.get_rng_state()
    snapshot = list(trainer._checkpoint_arrays())   # held until the shards are written: the step's own state
    result: concurrent.futures.Future = concurrent.futures.Future()

    def finish():
        try:
            # An executor learns of a shard when its step runs there; ask for it once the controller knows it
            # was made (the client goes on dispatching meanwhile).
            for array in snapshot:
                error = array.exception(timeout_s=timeout_s)
                if error is not None:
                    raise error
            futures = [context._data.save(executor_id, [ref for ref, _ in items], [name for _, name in items],
                                          os.path.join(step_dir, f"{executor_id}.safetensors"))
                       for executor_id, items in requests.items()]
            written = sum(f.result(timeout_s) for f in futures)
            _write_client_file(os.path.join(step_dir, CLIENT_FILE), rng)
            _replace(os.path.join(step_dir, INDEX), json.dumps(index, indent=1, sort_keys=True))
            if update_latest:
                _replace(os.path.join(directory, LATEST), os.path.basename(step_dir))
            result.set_result(written)
        except BaseException as exc:   # noqa: BLE001 - the caller's future says what failed
            result.set_exception(exc)
        finally:
            snapshot.clear()

    threading.Thread(target=finish, name="pathways-checkpoint", daemon=True).start()
    return result


def _plan(trainer, step_dir: str) -> tuple[dict, dict]:
    """Which executor writes which shard under which name, and the index that rebuilds the named tensors.

    A replicated array is written once, by one of its holders, taken in turn (the executors write in
    parallel); a sharded one by every holder, its own slice."""
    from ..wire import pb

    layout = trainer.layout
    holders = list(trainer._checkpoint_mesh().executor_ids)
    sharded = trainer.plan.sharded_state
    flats, states, buffers, frozen = layout.split_state(trainer._checkpoint_arrays())
    requests: dict[str, list] = {}
    turn = itertools.count()

    def place(array, name: str) -> list[dict]:
        positions = range(len(holders)) if sharded and name.startswith("bucket") else [next(turn) % len(holders)]
        pieces = []
        for position in positions:
            executor_id = holders[position]
            requests.setdefault(executor_id, []).append((pb.ShardRef(array_id=array.array_id, shard=position), name))
            pieces.append({"file": f"{executor_id}.safetensors", "tensor": name})
        return pieces

    buckets = []
    states = iter(states)
    for b, (bucket, flat) in enumerate(zip(layout.buckets, flats)):
        entry = {"group": bucket.group, "dtype": str(bucket.dtype).removeprefix("torch."), "numel": bucket.numel,
                 "slots": [[s.name, list(s.shape), s.offset, s.numel] for s in bucket.slots],
                 "arrays": {"param": place(flat, f"bucket{b}/param")}}
        for state in layout.state_names:
            entry["arrays"][state] = place(next(states), f"bucket{b}/{state}")
        buckets.append(entry)
    whole = {}
    for name, array in zip(layout.buffer_names + layout.frozen_names, [*buffers, *frozen]):
        (piece,) = place(array, f"whole/{name}")
        whole[f"model/{name}"] = piece
    return requests, {"format": FORMAT, "buckets": buckets, "whole": whole, "client": CLIENT_FILE}


def _write_client_file(path: str, rng) -> None:
    from safetensors.torch import save_file

    save_file({"rng/torch": rng}, path + ".partial")
    os.replace(path + ".partial", path)


def _replace(path: str, text: str) -> None:
    with open(path + ".partial", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".partial", path)


def read_sharded(path: str) -> tuple[dict, dict]:
    """(named unsharded tensors, meta) of the checkpoint ``latest`` names in ``path`` (or of the step folder)."""
    import torch
    from safetensors import safe_open

    step_dir = path
    if os.path.exists(os.path.join(path, LATEST)):
        with open(os.path.join(path, LATEST)) as f:
            step_dir = os.path.join(path, f.read().strip())
    with open(os.path.join(step_dir, INDEX)) as f:
        index = json.load(f)
    if index.get("format") != FORMAT:
        raise ValueError(f"checkpoint {step_dir}: expected format {FORMAT!r}, got {index.get('format')!r}")
    files: dict = {}

    def tensor(piece: dict):
        handle = files.get(piece["file"])
        if handle is None:
            handle = files[piece["file"]] = safe_open(os.path.join(step_dir, piece["file"]), framework="pt")
        return handle.get_tensor(piece["tensor"])

    tensors = {}
    for bucket in index["buckets"]:
        for state, pieces in bucket["arrays"].items():
            flat = torch.cat([tensor(p).reshape(-1) for p in pieces])[:bucket["numel"]]
            for name, shape, offset, numel in bucket["slots"]:
                key = f"model/{name}" if state == "param" else f"optimizer/{name}/{state}"
                tensors[key] = flat[offset:offset + numel].reshape(shape).clone()
    for key, piece in index["whole"].items():
        tensors[key] = tensor(piece)
    with safe_open(os.path.join(step_dir, index["client"]), framework="pt") as f:
        tensors["rng/torch"] = f.get_tensor("rng/torch")
    return tensors, index["meta"]
