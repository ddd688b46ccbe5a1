"""Meshes, placements and the block arithmetic of sharded arrays.

A mesh lays executors out on named axes, row-major. An array's *sharding* gives
one placement per mesh axis: ``Shard(d)`` splits tensor dim ``d`` across that axis,
``Replicate()`` keeps a full copy along it. Several axes may shard the same dim
(earlier axes are the major index). Each executor holds one *local block*.

A 0-d local block under ``Shard(0)`` counts as a block of shape ``(1,)``: the
per-shard sums of a ``Shard(0)`` array assemble to a vector of one sum per shard.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .errors import PlacementError

__all__ = ["Shard", "Replicate", "Placement", "Mesh", "Sharding", "local_shape", "global_shape",
           "data_dependent_global_shape",
           "split_blocks", "assemble_blocks", "normalize_placements"]


@dataclasses.dataclass(frozen=True)
class Shard:
    """Split tensor dimension ``dim`` across a mesh axis."""

    dim: int = 0

    def __post_init__(self):
        if not isinstance(self.dim, int) or self.dim < 0:
            raise PlacementError(f"Shard(dim): expected a non-negative int, got {self.dim!r}")

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclasses.dataclass(frozen=True)
class Replicate:
    """Keep a full copy of the tensor along a mesh axis."""

    def __repr__(self) -> str:
        return "Replicate()"


Placement = Shard | Replicate


class Mesh:
    """Executors on named axes; made by ``ctx.mesh({"data": 4})``."""

    def __init__(self, context, allocation):
        self._context = context
        self.allocation = allocation
        self.axes: dict[str, int] = dict(allocation.axes)
        self.executor_ids: tuple[str, ...] = allocation.executor_ids

    @property
    def size(self) -> int:
        return len(self.executor_ids)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.axes.values())

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self.axes)

    def coords(self, position: int) -> tuple[int, ...]:
        coords = []
        for size in reversed(self.shape):
            coords.append(position % size)
            position //= size
        return tuple(reversed(coords))

    def same_shape(self, other: "Mesh") -> bool:
        return list(self.axes.items()) == list(other.axes.items())

    def __repr__(self) -> str:
        axes = ", ".join(f"{k!r}: {v}" for k, v in self.axes.items())
        return f"Mesh({{{axes}}}, executors={list(self.executor_ids)})"


@dataclasses.dataclass(frozen=True)
class Sharding:
    """Where an array's blocks live: a mesh and one placement per mesh axis."""

    mesh: Mesh
    placements: tuple

    def __repr__(self) -> str:
        spec = ", ".join(f"{axis}: {p!r}" for axis, p in zip(self.mesh.axis_names, self.placements))
        return f"Sharding({{{spec}}}, mesh={self.mesh.allocation.mesh_id})"

    @property
    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)


def normalize_placements(placements, mesh: Mesh) -> tuple:
    """Accept a list with one placement per mesh axis, a single placement, or {axis: placement}."""
    if isinstance(placements, (Shard, Replicate)):
        placements = [placements] * len(mesh.axes)
    elif isinstance(placements, dict):
        unknown = set(placements) - set(mesh.axes)
        if unknown:
            raise PlacementError(f"placements name axes {sorted(unknown)}; the mesh has axes {list(mesh.axes)}")
        placements = [placements.get(axis, Replicate()) for axis in mesh.axes]
    placements = tuple(placements)
    if len(placements) != len(mesh.axes):
        raise PlacementError(f"expected one placement per mesh axis {list(mesh.axes)}, got {list(placements)}")
    for p in placements:
        if not isinstance(p, (Shard, Replicate)):
            raise PlacementError(f"expected pw.Shard(dim) or pw.Replicate(), got {p!r}")
    return placements


def _split_factors(ndim: int, placements: Sequence, mesh: Mesh) -> list[int]:
    factors = [1] * max(ndim, 1)
    for (axis, size), p in zip(mesh.axes.items(), placements):
        if isinstance(p, Shard):
            if p.dim >= max(ndim, 1):
                raise PlacementError(f"axis {axis!r}: Shard({p.dim}) on a tensor with {ndim} dims")
            factors[p.dim] *= size
    return factors


def local_shape(shape: Sequence[int], placements: Sequence, mesh: Mesh) -> tuple[int, ...]:
    """The shape of each local block of a global ``shape``; the sizes must divide evenly."""
    if len(shape) == 0 and any(isinstance(p, Shard) for p in placements):
        raise PlacementError("a 0-d tensor cannot be Shard()ed; use Replicate()")
    factors = _split_factors(len(shape), placements, mesh)
    out = []
    for dim, (size, factor) in enumerate(zip(shape, factors)):
        if size % factor:
            raise PlacementError(
                f"dim {dim} of shape {tuple(shape)} has size {size}, not divisible by the {factor} shards of "
                f"{placements} on mesh {mesh.axes}; pad it to a multiple of {factor} or change the placement")
        out.append(size // factor)
    return tuple(out)


def _assembled_block_shape(block_shape: Sequence[int], placements: Sequence) -> tuple[int, ...]:
    """A block's shape as it is joined into the global array: a 0-d block under a Shard counts as ``(1,)``."""
    block = tuple(block_shape)
    if not block and any(isinstance(p, Shard) for p in placements):
        return (1,)
    return block


def global_shape(block_shape: Sequence[int], placements: Sequence, mesh: Mesh) -> tuple[int, ...]:
    """The global shape whose local blocks have ``block_shape`` (0-d blocks count as ``(1,)``)."""
    block = _assembled_block_shape(block_shape, placements)
    factors = _split_factors(len(block), placements, mesh)
    return tuple(size * factor for size, factor in zip(block, factors)) if block else ()


def data_dependent_global_shape(block_shape: Sequence[int | None], placements: Sequence, mesh: Mesh) -> tuple:
    """`global_shape`, where a block size of None (decided by the data at run time) stays None."""
    if None not in block_shape:
        return global_shape(block_shape, placements, mesh)
    known = global_shape([1 if d is None else d for d in block_shape], placements, mesh)
    return tuple(None if d is None else g for d, g in zip(block_shape, known))


def _block_index(position: int, ndim: int, placements: Sequence, mesh: Mesh) -> tuple[int, ...]:
    coords = mesh.coords(position)
    index = [0] * ndim
    for coord, (axis, size), p in zip(coords, mesh.axes.items(), placements):
        if isinstance(p, Shard):
            index[p.dim] = index[p.dim] * size + coord
    return tuple(index)


def split_blocks(tensor, placements: Sequence, mesh: Mesh) -> list:
    """The local block for each mesh position, in position order (views of ``tensor``)."""
    block = local_shape(tuple(tensor.shape), placements, mesh)
    blocks = []
    for position in range(mesh.size):
        index = _block_index(position, tensor.dim(), placements, mesh)
        view = tensor
        for dim, (i, length) in enumerate(zip(index, block)):
            if length != tensor.shape[dim]:
                view = view.narrow(dim, i * length, length)
        blocks.append(view)
    return blocks


def _block_owners(ndim: int, placements: Sequence, mesh: Mesh) -> dict[tuple[int, ...], int]:
    """For each distinct block index, the first mesh position that holds it."""
    owners: dict[tuple[int, ...], int] = {}
    for position in range(mesh.size):
        owners.setdefault(_block_index(position, ndim, placements, mesh), position)
    return owners


def assemble_blocks(blocks: dict, block_shape: Sequence[int], placements: Sequence, mesh: Mesh):
    """Join one block per distinct block index (``blocks[position]``) into the global tensor."""
    import torch

    shape = _assembled_block_shape(block_shape, placements)
    ndim = len(shape)
    by_index = {index: blocks[position].reshape(shape)
                for index, position in _block_owners(ndim, placements, mesh).items()}
    grid = _split_factors(ndim, placements, mesh)[:ndim]

    def join(prefix: tuple):
        dim = len(prefix)
        if dim == ndim:
            return by_index[prefix]
        parts = [join(prefix + (i,)) for i in range(grid[dim])]
        return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]

    return join(())


def positions_needed(block_shape: Sequence[int], placements: Sequence, mesh: Mesh) -> list[int]:
    """One mesh position per distinct block: the positions to fetch for ``assemble_blocks``."""
    ndim = len(_assembled_block_shape(block_shape, placements))
    return list(_block_owners(ndim, placements, mesh).values())
