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
written. Each file is written under a ``.partial`` name, flushed to disk and renamed, its folder
flushed too (`wire.durable`); the index comes after every file and ``latest`` after the index, so a
process killed or a power lost at any point leaves the previous checkpoint loadable. Each save
writes a folder no save used before, and only the ``keep`` newest are kept (`checkpoint_folders`).
``directory`` must be storage every host sees (a network filesystem, an object store mount): each
executor writes where it runs. No pickle anywhere.

A client of a `pathways-controller` keeps its checkpoints under its own folder of the service's checkpoint root,
``DIR/<name>/`` (`Context.checkpoint_path`, `pathways_torch.wire.checkpoint_paths`): the client writes the step
folder, ``client.safetensors``, the index and ``latest`` there and prunes there; the executors write the shard
files and refuse any path outside it (`executor.shard_writer`). The client and the executors must see ``DIR`` at
the same path.

`read_sharded` rebuilds the unsharded named tensors (``model/<name>``, ``optimizer/<param>/<state>``,
``rng/torch``) that `checkpoint.read_checkpoint` returns for a client-written checkpoint, so either
kind loads under any plan and mesh size, and into eager PyTorch (`checkpoint.load_checkpoint`). A
folder whose pieces do not add up to a bucket's padded length is refused, naming the files.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import math
import os
import threading

from ..wire.durable import fsync_dir, replace_durably
from ..wire.threads import leave_signals_to_the_main_thread
from .checkpoint_folders import INDEX, LATEST

__all__ = ["save_sharded", "read_sharded", "is_sharded", "CheckpointPart", "FORMAT", "LATEST", "INDEX"]

FORMAT = "pathways_torch.sharded/1"
CLIENT_FILE = "client.safetensors"


def is_sharded(path: str) -> bool:
    return os.path.isdir(path) and (os.path.exists(os.path.join(path, LATEST)) or
                                    os.path.exists(os.path.join(path, INDEX)))


def save_sharded(runner, directory: str, meta: dict, timeout_s: float = 3600.0, *,
                 update_latest: bool = True, keep: int = 0, on_written=None) -> concurrent.futures.Future:
    """Start writing the current state of ``runner`` (a trainer's `runner.StepRunner`: its ``checkpoint_arrays``
    and ``checkpoint_parts``) under ``directory``, as of step ``meta["step"]``; the future resolves to the bytes
    the executors wrote once ``latest`` names this step (``update_latest=False``: ``latest`` is left as it is).

    The step folder is a fresh one (`checkpoint_folders.claim`; the future's ``step_dir``); once it is
    complete, ``on_written(step_dir)`` runs, then all but the ``keep`` newest checkpoints are removed
    (``keep=0``, or ``update_latest=False``: none)."""
    import torch

    from .checkpoint_folders import claim, remove_old, unpin

    directory = os.path.abspath(directory)
    step_dir = claim(directory, meta["step"])      # pinned until no executor writes into it
    try:
        requests, index = _plan(runner.checkpoint_parts(), step_dir)
    except BaseException:
        unpin(step_dir)           # empty: the next save's clean-up removes it
        raise
    index["meta"] = meta
    rng = torch.get_rng_state()
    snapshot = list(runner.checkpoint_arrays())   # held until the shards are written: the step's own state
    dispatcher = snapshot[0].dispatcher if snapshot else None   # no state: no shard to write
    for array in snapshot:
        array.hold()     # the next step must not free them (donate_argnums) while they are written
    result: concurrent.futures.Future = concurrent.futures.Future()
    result.step_dir = step_dir
    futures: list = []

    def finish():
        leave_signals_to_the_main_thread()
        try:
            # An executor learns of a shard when its step runs there; ask for it once the controller knows it
            # was made (the client goes on dispatching meanwhile).
            for array in snapshot:
                error = array.exception(timeout_s=timeout_s)
                if error is not None:
                    raise error
            futures.extend(dispatcher.save_shards(executor_id, [ref for ref, _ in items], [name for _, name in items],
                                                  os.path.join(step_dir, f"{executor_id}.safetensors"))
                           for executor_id, items in requests.items())
            written = sum(f.result(timeout_s) for f in futures)
            _write_client_file(os.path.join(step_dir, CLIENT_FILE), rng)
            _replace(os.path.join(step_dir, INDEX), json.dumps(index, indent=1, sort_keys=True))
            fsync_dir(directory)      # the step folder's own entry reaches the disk before `latest` names it
            if update_latest:
                _replace(os.path.join(directory, LATEST), os.path.basename(step_dir))
            if on_written is not None:
                on_written(step_dir)
            if update_latest and keep:
                remove_old(directory, keep, step_dir)
            result.set_result(written)
        except BaseException as exc:   # noqa: BLE001 - the caller's future says what failed
            result.set_exception(exc)
        finally:
            for array in snapshot:
                array.release_hold()
            snapshot.clear()
            # Unpinned once no executor writes into the folder: a failed save's others may still be writing. Waited
            # for here, on this background thread, not in the futures' callbacks on the data client's I/O thread.
            concurrent.futures.wait(futures)
            unpin(step_dir)

    threading.Thread(target=finish, name="pathways-checkpoint", daemon=True).start()
    return result


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointPart:
    """A piece of a trainer's state with one layout and one set of holders (`StepRunner.checkpoint_parts`): the whole
    state under a data-parallel plan, one chunk's under a pipeline (each stage's executors write their chunks)."""

    buckets: tuple            # `buckets.Bucket` s: how each flat rebuilds its named parameters
    state_names: tuple        # the optimizer's state names (``exp_avg`` ...), one flat per bucket each
    flats: list               # per bucket, its parameters' flat array
    states: list              # the optimizer state flats, bucket-major
    wholes: list              # (checkpoint name, replicated array): buffers, frozen parameters
    holders: tuple            # the executors holding the arrays, in shard order
    sharded: bool             # flats and states sliced over ``holders`` (each writes its own slice)
    # The holders' shard positions in the arrays (None: 0, 1, ...; a tensor-parallel part is one model shard's).
    positions: tuple | None = None
    # Slot name → {"dim", "chunks", "rank", "of"}: the slot is shard ``rank`` of ``of`` of a split parameter,
    # joined on load (`join_split`); the other slots hold whole tensors.
    splits: dict | None = None

    @classmethod
    def of_layout(cls, layout, arrays: list, mesh, sharded: bool) -> "CheckpointPart":
        """The whole state of a `step.StepLayout` (``arrays`` as `StepLayout.split_state` takes them) on ``mesh``."""
        flats, states, buffers, frozen = layout.split_state(arrays)
        names = layout.buffer_names + layout.frozen_names
        return cls(buckets=layout.buckets, state_names=layout.state_names, flats=flats, states=states,
                   wholes=[(f"model/{n}", a) for n, a in zip(names, [*buffers, *frozen])],
                   holders=tuple(mesh.executor_ids), sharded=sharded)


def _plan(parts: list, step_dir: str) -> tuple[dict, dict]:
    """Which executor writes which shard of the state's ``parts`` (`CheckpointPart` s) under which name, and the
    index that rebuilds the named tensors.

    A replicated array is written once, by one of its holders, taken in turn (the executors write in
    parallel); a sharded one by every holder, its own slice. Buckets are numbered across the parts
    (one executor may hold several pipeline chunks); a name two parts hold (a tied parameter, a buffer two
    chunks read) is rebuilt from the first part that holds it, as `Trainer.state_dict` does."""
    from ..wire import pb

    requests: dict[str, list] = {}
    turn = itertools.count()
    numbers = itertools.count()

    def place(part: CheckpointPart, array, name: str, sharded: bool) -> list[dict]:
        holders = part.holders
        positions = range(len(holders)) if sharded else [next(turn) % len(holders)]
        pieces = []
        for position in positions:
            executor_id = holders[position]
            shard = part.positions[position] if part.positions is not None else position
            requests.setdefault(executor_id, []).append((pb.ShardRef(array_id=array.array_id, shard=shard), name))
            pieces.append({"file": f"{executor_id}.safetensors", "tensor": name})
        return pieces

    buckets, whole, named = [], {}, set()
    for part in parts:
        states = iter(part.states)
        for bucket, flat in zip(part.buckets, part.flats):
            bucket_states = [next(states) for _ in part.state_names]
            splits = part.splits or {}
            slots = [s for s in bucket.slots if _written_as(s.name, splits) not in named]
            if not slots:
                continue     # every parameter in it is written already (another chunk's copy)
            named.update(_written_as(s.name, splits) for s in slots)
            b = next(numbers)
            entry = {"group": bucket.group, "dtype": str(bucket.dtype).removeprefix("torch."), "numel": bucket.numel,
                     "slots": [[s.name, list(s.shape), s.offset, s.numel, *([splits[s.name]] if s.name in splits
                                                                              else [])] for s in slots],
                     "arrays": {"param": place(part, flat, f"bucket{b}/param", part.sharded)}}
            for state, array in zip(part.state_names, bucket_states):
                entry["arrays"][state] = place(part, array, f"bucket{b}/{state}", part.sharded)
            buckets.append(entry)
        for key, array in part.wholes:
            if key not in whole:
                (whole[key],) = place(part, array, f"whole/{key.removeprefix('model/')}", False)
    return requests, {"format": FORMAT, "buckets": buckets, "whole": whole, "client": CLIENT_FILE}


def _written_as(name: str, splits: dict):
    """What a slot's tensor is in the folder: the name, or (name, rank) for one shard of a split parameter."""
    return (name, splits[name]["rank"]) if name in splits else name


def join_split(pieces: list, dim: int, chunks: int):
    """A split parameter whole again from its shards in rank order: each shard holds its slice of ``dim``
    in every one of ``chunks`` side-by-side parts."""
    import torch

    dim = dim % pieces[0].dim()
    width = pieces[0].shape[dim] // chunks
    return torch.stack([p.unflatten(dim, (chunks, width)) for p in pieces], dim + 1).flatten(dim, dim + 2)


def _write_client_file(path: str, rng) -> None:
    from safetensors.torch import save_file

    save_file({"rng/torch": rng}, path + ".partial")
    replace_durably(path + ".partial", path)


def _replace(path: str, text: str) -> None:
    with open(path + ".partial", "w") as f:
        f.write(text)
    replace_durably(path + ".partial", path)


def read_sharded(path: str) -> tuple[dict, dict]:
    """(named unsharded tensors, meta) of the checkpoint ``latest`` names in ``path`` (or of the step folder).
    The folder is pinned while it is read (no save's clean-up removes it); a bucket whose pieces do not add up
    to its padded length is refused before any tensor is read."""
    from .checkpoint_folders import reading

    with reading(path) as step_dir:
        return _read_step_dir(step_dir)


def _read_step_dir(step_dir: str) -> tuple[dict, dict]:
    import torch
    from safetensors import safe_open

    with open(os.path.join(step_dir, INDEX)) as f:
        index = json.load(f)
    if index.get("format") != FORMAT:
        raise ValueError(f"checkpoint {step_dir}: expected format {FORMAT!r}, got {index.get('format')!r}")
    files: dict = {}

    def handle(piece: dict):
        opened = files.get(piece["file"])
        if opened is None:
            opened = files[piece["file"]] = safe_open(os.path.join(step_dir, piece["file"]), framework="pt")
        return opened

    def tensor(piece: dict):
        return handle(piece).get_tensor(piece["tensor"])

    for b, bucket in enumerate(index["buckets"]):      # every size first (headers only): nothing half loaded
        for state, pieces in bucket["arrays"].items():
            sizes = [math.prod(handle(p).get_slice(p["tensor"]).get_shape()) for p in pieces]
            _check_pieces(step_dir, b, state, bucket["numel"], pieces, sizes)
    tensors, shards = {}, {}
    for bucket in index["buckets"]:
        for state, pieces in bucket["arrays"].items():
            flat = torch.cat([tensor(p).reshape(-1) for p in pieces])[:bucket["numel"]]
            for name, shape, offset, numel, *split in bucket["slots"]:
                key = f"model/{name}" if state == "param" else f"optimizer/{name}/{state}"
                value = flat[offset:offset + numel].reshape(shape).clone()
                if split:
                    shards.setdefault(key, (split[0], {}))[1][split[0]["rank"]] = value
                else:
                    tensors[key] = value
    for key, (split, by_rank) in shards.items():
        if sorted(by_rank) != list(range(split["of"])):
            raise ValueError(f"checkpoint {step_dir}: {key} is split in {split['of']} shards but the folder holds "
                             f"shards {sorted(by_rank)}; it is incomplete: load another step-* folder")
        tensors[key] = join_split([by_rank[r] for r in range(split["of"])], split["dim"], split["chunks"])
    for key, piece in index["whole"].items():
        tensors[key] = tensor(piece)
    with safe_open(os.path.join(step_dir, index["client"]), framework="pt") as f:
        tensors["rng/torch"] = f.get_tensor("rng/torch")
    return tensors, index["meta"]


def _check_pieces(step_dir: str, b: int, state: str, numel: int, pieces: list, sizes: list) -> None:
    """A bucket's pieces are its flat padded to a multiple of their count (`buckets.Bucket.padded_numel`: one
    piece per holder under a sharded plan, one under a replicated one) and split evenly: refuse any other."""
    count = len(pieces)
    padded = -(-numel // count) * count
    each = padded // count
    wrong = [f"{p['file']} holds {size} ({p['tensor']})" for p, size in zip(pieces, sizes) if size != each]
    if sum(sizes) != padded or wrong:
        raise ValueError(
            f"checkpoint {step_dir}: bucket {b} {state!r} has {numel} elements, padded to {padded} over {count} "
            f"piece(s) of {each}, but its pieces hold {sum(sizes)} in all: {'; '.join(wrong)}. The folder is "
            f"incomplete or mixes two saves; nothing was loaded: load another step-* folder of that directory")
