"""Tensor parallelism inside islands, data parallelism across them: ``pw.TensorParallel(plan,
data=pw.DataParallel(("island", "data")))`` on a mesh ``{"island": I, "data": D, "model": M}``.

`TensorIslandRunner` is the cross-island runner (`training.cross_island`) with each island a data x model
mesh: the step's joint forward and backward is traced with the plan lowered into it (the model rank one
more input), so each gradient segment holds the model axis's collectives, all inside its island; the
buckets are cut by kind (`shards.by_kind`), a split bucket's slices placed ``Shard(0)`` on the model axis;
each bucket's slice crosses the link between same-position executors, which hold the same model shard;
the update sums partial gradients over the model axis and counts each split parameter once in the
clipping norm (`runner.TensorStep`). The island axis stays data-parallel: no collective crosses it.
"""

from __future__ import annotations

from ..placement import Shard
from ..training.buckets import split_for_exchange
from ..training.cross_island import CrossIslandRunner
from ..training.step import make_layout
from .assign import assign, refuse_frozen_splits
from .checkpoint_parts import tensor_parallel_parts
from .shards import by_kind, flat_placement, host_flat, whole_tensors

__all__ = ["TensorIslandRunner"]


class TensorIslandRunner(CrossIslandRunner):
    """The `StepRunner` of ``TensorParallel(plan, axis, data=DataParallel(("island", data axis)))``; ``placements``
    prints where each parameter lives."""

    def __init__(self, basis, plan):
        super().__init__(basis, plan.data, model_axis=plan.axis)
        self.tensor = plan
        self.model_size = basis.mesh.axes[plan.axis]
        self.tensor_plan = assign(basis.model, plan.styles(), plan.axis, self.model_size)
        refuse_frozen_splits(basis.model, self.tensor_plan)

    def build(self, spec):
        b, mb = self.basis, self.plan.bucket_mb

        def regroup(buckets):
            cut = [piece for bucket in buckets for piece in by_kind(bucket, self.tensor_plan)]
            return split_for_exchange(cut, int(mb * 2**20), int(min(1.0, mb) * 2**20))
        self.layout = make_layout(b.model, b.optimizer, spec, regroup)
        self.kinds = tuple(self.tensor_plan.kind_of(bucket.slots[0].name) for bucket in self.layout.buckets)
        self._islands = self._island_meshes()
        self.recapture(spec, b.seed)
        return self.layout

    def _island_axes(self) -> dict:
        return {**super()._island_axes(), self.tensor.axis: self.model_size}

    def _tensor_step(self):
        from .runner import TensorStep

        return TensorStep(self.tensor_plan, self.kinds)

    def _bucket_placements(self) -> list:
        return [flat_placement(kind, self._state_placement(), self.tensor.axis) for kind in self.kinds]

    def _rank_arrays(self, island: int) -> list:
        return [self._ranks[island], self._model_ranks[island]]

    def _put_rank(self) -> None:
        import torch

        super()._put_rank()
        ctx = self.basis.context
        self._model_ranks = [ctx.put(torch.arange(self.model_size, dtype=torch.int64), mesh,
                                     {self.tensor.axis: Shard(0)}) for mesh in self._islands]

    def placed_arrays(self) -> list:
        return [*super().placed_arrays(), *self._model_ranks]

    # ------------------------------------------------------------ state, split on the model axis

    def put_state(self, tensors: dict) -> None:
        layout, ctx, placements = self.layout, self.basis.context, self._bucket_placements()

        def place_on(mesh):
            def place(index, bucket, named):
                numel = bucket.padded_numel(self.num_shards) if self.inner.sharded_state else bucket.numel
                return host_flat(bucket, self.kinds[index], named, self.tensor_plan, numel, placements[index],
                                 mesh), placements[index]
            return place
        self.island_states = [ctx.put_many(layout.state_items(tensors, place_on(mesh)), mesh)
                              for mesh in self._islands]

    def named_tensors(self) -> dict:
        placements, mesh = self._bucket_placements(), self._islands[0]

        def joined(index, bucket, array):
            return whole_tensors(bucket, self.kinds[index], array.result(), self.tensor_plan, placements[index], mesh)
        return self.layout.named_tensors(self.checkpoint_arrays(), joined)

    def checkpoint_parts(self) -> list:
        return tensor_parallel_parts(self, self._islands[0])

    @property
    def placements(self):
        from .runner import _Text

        side = (f"data axis {self.inner.axis!r} of {self.num_shards} in each of {self.num_islands} islands: "
                f"{type(self.plan).__name__}")
        return _Text(self.tensor_plan.describe(side))

