"""Tensor parallelism inside a pipeline's stages: ``pw.Pipeline(..., tensor=pw.TensorParallel(plan))``, a 3-D mesh.

Each stage is a 2-D mesh, data x model (`build.stage_meshes`). The model is traced once per model shard
with the plan lowered into its forward (`split.split_model`'s ``tensor``): parameters in their local shapes,
the model rank one more batch leaf, and the layout moves ``pathways_tp::`` ops whose gradient rules travel
with them into each chunk's backward (`autograd`). A chunk's buckets are cut by kind as under
``pw.TensorParallel`` alone (`tensor_parallel.shards.by_kind`): a split bucket holds each model shard's
slices, and its flats and optimizer state are placed ``Shard(0)`` on the model axis; the update sums partial
gradients over that axis and counts each split parameter's slices once in the clipping norm
(`tensor_parallel.runner.TensorStep`). State leaves the executors whole, so checkpoints reshard.
"""

from __future__ import annotations

import dataclasses

from ..placement import Shard
from ..tensor_parallel.assign import TensorPlan, assign, refuse_frozen_splits

__all__ = ["StageTensor", "stage_tensor"]


@dataclasses.dataclass(frozen=True)
class StageTensor:
    """The tensor-parallel side of a pipeline: the plan applied to the model, on an axis of ``plan.size``."""

    plan: TensorPlan

    @property
    def axis(self) -> str:
        return self.plan.axis

    @property
    def size(self) -> int:
        return self.plan.size

    def local_shape(self, name: str) -> tuple[int, ...]:
        return self.plan.local_shape(name)

    def lowered(self, model, rank):
        from ..tensor_parallel.lowering import Lowered

        return Lowered(model, self.plan, rank)

    def cut(self, buckets) -> tuple[list, tuple[str, ...]]:
        """``buckets`` cut by kind (local shapes), and each piece's kind."""
        from ..tensor_parallel.shards import by_kind

        pieces = [piece for bucket in buckets for piece in by_kind(bucket, self.plan)]
        return pieces, tuple(self.plan.kind_of(p.slots[0].name) for p in pieces)

    def step(self, kinds: tuple[str, ...]):
        from ..tensor_parallel.runner import TensorStep

        return TensorStep(self.plan, kinds)

    def placement(self, kind: str, data_placement):
        """Where a flat of ``kind`` lives on a stage mesh whose data plan places state as ``data_placement``."""
        from ..tensor_parallel.shards import flat_placement

        return flat_placement(kind, data_placement, self.axis)

    def rank(self):
        """The model rank leaf's host value: one int per model shard, put ``Shard(0)`` on the model axis."""
        import torch

        return torch.arange(self.size, dtype=torch.int64), {self.axis: Shard(0)}

    def describe(self, data: str) -> str:
        return self.plan.describe(data)


def stage_tensor(model, plan, mesh) -> StageTensor | None:
    """The `StageTensor` of ``plan.tensor`` on ``mesh`` (None without one); refuses a bad plan before anything is
    placed."""
    if plan.tensor is None:
        return None
    tensor = plan.tensor
    tensor_plan = assign(model, tensor.styles(), tensor.axis, dict(mesh.axes)[tensor.axis])
    refuse_frozen_splits(model, tensor_plan)
    return StageTensor(tensor_plan)
