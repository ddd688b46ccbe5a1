"""Host-side splitting and joining of tensor-parallel state: a parameter's shard, and the flats that hold them.

A split parameter's shard ``rank`` of ``size`` is its ``rank``-th slice on the split dim, of every chunk
(`ParamSplit`); `join` is the inverse. A bucket of split parameters is one flat per model shard (the
same slots, each shard's slices); on the mesh it is one array whose blocks are those flats (sliced
again over the data axis under a sharded data plan), laid out in the mesh's block order (`placed_flat`,
`flats_of`).
"""

from __future__ import annotations

from ..placement import _block_index, local_shape

__all__ = ["shard_of", "join", "placed_flat", "flats_of"]


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
