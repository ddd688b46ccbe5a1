"""A tensor-parallel trainer's state as checkpoint parts: one per model shard, each written by its own executors.

Model shard m's part holds every bucket: its split buckets' slots are marked as shard m of their
parameter (`sharded_checkpoint.join_split` makes them whole on load), and its whole buckets, the same on
every model shard, are written once (by the first part). Under a sharded data plan each of the part's
executors writes its data slice; otherwise one of them writes the flat.
"""

from __future__ import annotations

from ..training.sharded_checkpoint import CheckpointPart
from .assign import SPLIT

__all__ = ["tensor_parallel_parts", "model_shard_parts"]


def tensor_parallel_parts(runner, mesh) -> list[CheckpointPart]:
    """The parts of a runner whose state is one `StepLayout` (its ``layout``, ``kinds``, ``tensor_plan``) on ``mesh``:
    the tensor-parallel runner's mesh, or island 0's across islands (every island holds the same state)."""
    layout = runner.layout
    flats, states, buffers, frozen = layout.split_state(runner.checkpoint_arrays())
    wholes = [(f"model/{n}", a) for n, a in zip(layout.buffer_names + layout.frozen_names, [*buffers, *frozen])]
    return model_shard_parts(layout.buckets, runner.kinds, layout.state_names, flats, states, wholes,
                             mesh, runner.tensor_plan, runner.plan.sharded_state)


def model_shard_parts(buckets, kinds, state_names, flats, states, wholes, mesh, plan, sharded: bool) -> list:
    """One `CheckpointPart` per model shard of state laid out as ``buckets`` (of ``kinds``) on ``mesh``: the
    executors at that shard's mesh positions write it, its split slots marked as that shard's slices."""
    where = list(mesh.axes).index(plan.axis)
    parts = []
    for m in range(plan.size):
        positions = tuple(p for p in range(mesh.size) if mesh.coords(p)[where] == m)    # in data order
        splits = {}
        for bucket, kind in zip(buckets, kinds):
            if kind == SPLIT:
                for slot in bucket.slots:
                    split = plan.split_of(slot.name)
                    splits[slot.name] = {"dim": split.dim, "chunks": split.chunks, "rank": m, "of": plan.size}
        parts.append(CheckpointPart(buckets=buckets, state_names=state_names, flats=flats, states=states,
                                    wholes=wholes, holders=tuple(mesh.executor_ids[p] for p in positions),
                                    positions=positions, sharded=sharded, splits=splits))
    return parts
