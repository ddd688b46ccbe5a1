"""A tensor-parallel trainer's state as checkpoint parts: one per model shard, each written by its own executors.

Model shard m's part holds every bucket: its split buckets' slots are marked as shard m of their
parameter (`sharded_checkpoint.join_split` makes them whole on load), and its whole buckets, the same on
every model shard, are written once (by the first part). Under a sharded data plan each of the part's
executors writes its data slice; otherwise one of them writes the flat.
"""

from __future__ import annotations

from ..training.sharded_checkpoint import CheckpointPart
from .assign import SPLIT

__all__ = ["tensor_parallel_parts"]


def tensor_parallel_parts(runner) -> list[CheckpointPart]:
    layout, mesh, axis = runner.layout, runner.trainer.mesh, runner.tensor.axis
    flats, states, buffers, frozen = layout.split_state(runner.checkpoint_arrays())
    wholes = [(f"model/{n}", a) for n, a in zip(layout.buffer_names + layout.frozen_names, [*buffers, *frozen])]
    where = list(mesh.axes).index(axis)
    parts = []
    for m in range(runner.model_size):
        positions = tuple(p for p in range(mesh.size) if mesh.coords(p)[where] == m)    # in data order
        splits = {}
        for bucket, kind in zip(layout.buckets, runner.kinds):
            if kind == SPLIT:
                for slot in bucket.slots:
                    split = runner.tensor_plan.split_of(slot.name)
                    splits[slot.name] = {"dim": split.dim, "chunks": split.chunks, "rank": m,
                                         "of": runner.model_size}
        parts.append(CheckpointPart(buckets=layout.buckets, state_names=layout.state_names, flats=flats,
                                    states=states, wholes=wholes,
                                    holders=tuple(mesh.executor_ids[p] for p in positions), positions=positions,
                                    sharded=runner.plan.sharded_state, splits=splits))
    return parts
