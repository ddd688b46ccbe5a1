"""Host-side splitting and joining of tensor-parallel state: a parameter's shard, and the flats that hold them.

A split parameter's shard ``rank`` of ``size`` is its ``rank``-th slice on the split dim, of every chunk
(`ParamSplit`); `join` is the inverse. A bucket of split parameters is one flat per model shard (the
same slots, each shard's slices); on the mesh it is one array whose blocks are those flats (sliced
again over the data axis under a sharded data plan), laid out in the mesh's block order (`placed_flat`,
`flats_of`).
"""

from __future__ import annotations

from ..placement import _block_index, local_shape

__all__ = ["shard_of", "join", "placed_flat", "flats_of", "placed_bucket", "joined_bucket", "by_kind", "flat_placement", "host_flat",
           "whole_tensors"]


def shard_of(tensor, split, size: int, rank: int):
    """Shard ``rank`` of ``size`` of ``tensor`` under ``split`` (a copy; the whole tensor when not split)."""
    import torch

    from .layouts import local_slice      # the slice a shard takes of a whole tensor inside the step, too

    if split.dim is None:
        return tensor.clone()
    return local_slice(tensor, split.dim, size, split.chunks, torch.tensor([rank]))      # index_select: a copy


def join(pieces: list, split):
    """The whole tensor from its shards in rank order (the first piece when not split)."""
    from ..training.sharded_checkpoint import join_split

    return pieces[0] if split.dim is None else join_split(pieces, split.dim, split.chunks)


def flat_placement(kind: str, data_placement, axis: str):
    """Where a flat of ``kind`` lives: as the data plan places state (a dict, or Replicate), and ``Shard(0)`` on
    the model ``axis`` when its parameters are split."""
    from ..placement import Replicate, Shard
    from .assign import SPLIT

    placement = dict(data_placement) if isinstance(data_placement, dict) else {}
    if kind == SPLIT:
        placement[axis] = Shard(0)
    return placement or Replicate()


def by_kind(bucket, plan) -> list:
    """``bucket`` cut by how its parameters live on the model axis (split / whole / partial), each slot in its
    local shape: a flat holds one kind, placed and reduced one way."""
    import math

    from ..training.buckets import Slot, rebased

    groups: dict[str, list] = {}
    for slot in bucket.slots:
        shape = plan.local_shape(slot.name)
        groups.setdefault(plan.kind_of(slot.name), []).append(Slot(slot.name, shape, 0, math.prod(shape)))
    return [rebased(bucket, slots) for slots in groups.values()]


def placed_bucket(bucket, named: dict, plan, numel: int, placements: tuple, mesh):
    """The host array of a split ``bucket`` (its ``named`` whole tensors) on ``mesh``: each model shard's flat of
    ``numel`` elements (its slices of every slot) where that shard lives (`placed_flat`)."""
    from ..training.buckets import flatten

    flats = [flatten(bucket, {n: shard_of(t, plan.split_of(n), plan.size, m) for n, t in named.items()}, numel)
             for m in range(plan.size)]
    return placed_flat(flats, placements, mesh, plan.axis)


def joined_bucket(bucket, whole, plan, placements: tuple, mesh) -> dict:
    """The inverse of `placed_bucket`: a split bucket's named tensors, whole, from its global array ``whole``."""
    from ..training.buckets import unflatten

    per_shard = [unflatten(bucket, f) for f in flats_of(whole, placements, mesh, plan.axis, plan.size)]
    return {s.name: join([p[s.name] for p in per_shard], plan.split_of(s.name)).clone() for s in bucket.slots}


def host_flat(bucket, kind: str, named: dict, plan, numel: int, placement, mesh):
    """The host array of one flat of ``bucket`` of ``kind`` (from its ``named`` whole tensors, padded to ``numel``)
    as it is put on ``mesh`` under ``placement``: flattened, or each model shard's slices where it lives."""
    from ..placement import normalize_placements
    from ..training.buckets import flatten
    from .assign import SPLIT

    if kind != SPLIT:
        return flatten(bucket, named, numel)
    return placed_bucket(bucket, named, plan, numel, normalize_placements(placement, mesh), mesh)


def whole_tensors(bucket, kind: str, whole, plan, placement, mesh) -> dict:
    """The inverse of `host_flat`: the named whole tensors (copies) of one flat from its global array ``whole``."""
    from ..placement import normalize_placements
    from ..training.buckets import unflatten
    from .assign import SPLIT

    if kind != SPLIT:
        return {n: t.clone() for n, t in unflatten(bucket, whole).items()}
    return joined_bucket(bucket, whole, plan, normalize_placements(placement, mesh), mesh)


def _model_coord(position: int, mesh, axis: str) -> int:
    return mesh.coords(position)[list(mesh.axes).index(axis)]


def placed_flat(flats: list, placements: tuple, mesh, axis: str):
    """The global 1-d array whose block at each mesh position is that position's model shard's flat (its
    data slice under a sharded data plan): ``flats[m]`` is model shard m's flat, padded to split evenly."""
    import torch

    numel = flats[0].numel()
    block = local_shape((numel * len(flats),), placements, mesh)[0]
    per_flat = numel // block
    blocks: dict[int, object] = {}
    for position in range(mesh.size):
        (index,) = _block_index(position, 1, placements, mesh)
        flat = flats[_model_coord(position, mesh, axis)]
        piece = _data_piece(position, mesh, placements, axis, per_flat)
        blocks.setdefault(index, flat.narrow(0, piece * block, block))
    return torch.cat([blocks[i] for i in range(len(blocks))])


def flats_of(whole, placements: tuple, mesh, axis: str, size: int) -> list:
    """The inverse of `placed_flat`: model shard m's flat from the global array ``whole``."""
    import torch

    block = local_shape(tuple(whole.shape), placements, mesh)[0]
    per_flat = whole.numel() // (block * size)
    pieces: dict[tuple[int, int], object] = {}
    for position in range(mesh.size):
        (index,) = _block_index(position, 1, placements, mesh)
        key = (_model_coord(position, mesh, axis), _data_piece(position, mesh, placements, axis, per_flat))
        pieces.setdefault(key, whole.narrow(0, index * block, block))
    return [torch.cat([pieces[(m, d)] for d in range(per_flat)]) for m in range(size)]


def _data_piece(position: int, mesh, placements: tuple, axis: str, per_flat: int) -> int:
    """Which of its model shard's ``per_flat`` data slices ``position`` holds (0 when the flat is whole there)."""
    if per_flat == 1:
        return 0
    from ..placement import Shard

    coords = mesh.coords(position)
    piece = 0
    for coord, (name, n), p in zip(coords, mesh.axes.items(), placements):
        if name != axis and isinstance(p, Shard):
            piece = piece * n + coord
    return piece
