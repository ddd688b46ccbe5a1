"""`TensorParallelRunner`: the `StepRunner` of ``pw.TensorParallel``, a data-parallel step whose layers are split.

The state is the data-parallel runner's flat buckets, cut by how their parameters live on the model
axis (`TensorStep.kinds`): a bucket of split parameters holds each model shard's slices (one flat per
model shard, laid side by side on the mesh, `shards.placed_flat`); a bucket of whole ones is the same on
every model shard. The step is `step.make_step` with the plan lowered into its forward (`lowering.Lowered`),
the partial gradients (sequence-parallel norms) summed over the model axis, and the clipping norm counting
each split parameter's slices once. State leaves the executors whole: ``state_dict``, ``save`` and
``save_sharded`` hold unsplit tensors (or how to join them), so a checkpoint loads under any mesh and plan.
"""

from __future__ import annotations

import dataclasses

from ..collectives import all_reduce
from ..placement import Replicate, Shard
from ..training.buckets import Bucket, split_for_exchange
from ..training.data_parallel import DataParallelRunner
from ..training.plans import DataParallel
from ..training.step import make_layout
from .assign import PARTIAL, SPLIT, TensorPlan, assign, refuse_frozen_splits
from .lowering import Lowered
from .shards import by_kind, flat_placement, host_flat, whole_tensors

__all__ = ["TensorParallelRunner", "TensorStep"]

@dataclasses.dataclass(frozen=True)
class TensorStep:
    """What the captured step does for a model axis (`step.make_step`'s ``tensor``)."""

    plan: TensorPlan
    kinds: tuple[str, ...]        # per bucket: SPLIT, WHOLE or PARTIAL (whole, its gradient a partial sum)

    def lowered(self, model, rank):
        return Lowered(model, self.plan, rank)

    def complete(self, grad_flats: list) -> list:
        return [all_reduce(g, self.plan.axis, "sum") if kind == PARTIAL else g
                for g, kind in zip(grad_flats, self.kinds)]

    def sum_squares(self, squares: list):
        """The squared norm over the model axis: split buckets' slices summed over it, whole ones counted once."""
        split = [s for s, kind in zip(squares, self.kinds) if kind == SPLIT]
        whole = sum(s for s, kind in zip(squares, self.kinds) if kind != SPLIT)
        return whole + all_reduce(sum(split), self.plan.axis, "sum") if split else whole


class TensorParallelRunner(DataParallelRunner):
    """``TensorParallel(axis, plan, data)`` on a mesh of a model axis (and a data axis); ``placements`` prints
    where each parameter lives."""

    def __init__(self, basis, plan):
        self.basis, self.tensor = basis, plan
        self.model_size, self.num_shards = plan.check(basis.mesh)
        # The data-parallel side of the step: a plan of one shard when there is no data axis (no collective).
        self.plan = plan.data if plan.data is not None else DataParallel(plan.axis)
        self.tensor_plan = assign(basis.model, plan.styles(), plan.axis, self.model_size)
        refuse_frozen_splits(basis.model, self.tensor_plan)

    def _per_unit(self) -> bool:
        return False        # the sharded data plan gathers every bucket at the step's start here

    def build(self, spec):
        b = self.basis
        self.units = None
        cap = self.plan.local_bucket_bytes(b.context.backend)

        def regroup(buckets):
            cut = [piece for bucket in buckets for piece in by_kind(bucket, self.tensor_plan)]
            return cut if cap is None else split_for_exchange(cut, cap, cap)
        self.layout = make_layout(b.model, b.optimizer, spec, regroup)
        self.kinds = tuple(self.tensor_plan.kind_of(bucket.slots[0].name) for bucket in self.layout.buckets)
        self.forwards, self._output_specs = {}, {}
        self.recapture(spec, b.seed)
        return self.layout

    def _tensor_step(self) -> TensorStep:
        return TensorStep(self.tensor_plan, self.kinds)

    # ------------------------------------------------------------ where things live

    def _bucket_placement(self, kind: str) -> dict:
        data = self.plan.state_placement() if self.tensor.data is not None else Replicate()
        return flat_placement(kind, data, self.tensor.axis)

    def _state_placements(self) -> list:
        flats = [self._bucket_placement(kind) for kind in self.kinds]
        return flats + [p for p in flats for _ in self.layout.state_names]

    def _batch_placement(self) -> dict:
        return {self.plan.axis: Shard(0)} if self.tensor.data is not None else Replicate()

    def _rank_arrays(self) -> list:
        return [self._rank, self._model_rank]

    def batch_pieces(self) -> tuple[int, str]:
        if self.tensor.data is None:
            return 1, "1 (the batch is whole on every model shard)"
        return super().batch_pieces()

    @property
    def placements(self):
        """Each parameter's placement: the plan's styles, then global shape -> local shape, and where it lives."""
        data = self.tensor.data
        side = (f"data axis {data.axis!r} of {self.num_shards}: {type(data).__name__}" if data is not None else "")
        return _Text(self.tensor_plan.describe(side))

    # ------------------------------------------------------------ state

    def _put_rank(self) -> None:
        import torch

        b = self.basis
        if self.tensor.data is not None:
            super()._put_rank()
        else:       # one data shard: rank 0 everywhere
            self._rank = b.context.put(torch.zeros(1, dtype=torch.int64), b.mesh, Replicate())
        self._model_rank = b.context.put(torch.arange(self.model_size, dtype=torch.int64), b.mesh,
                                         {self.tensor.axis: Shard(0)})

    def _padded(self, bucket: Bucket) -> int:
        return bucket.padded_numel(self.num_shards) if self.plan.sharded_state else bucket.numel

    def put_state(self, tensors: dict) -> None:
        layout, b = self.layout, self.basis
        items = layout.state_items(tensors, self._placed)
        self.flats, self.states, self.buffers, self.frozen = layout.split_state(b.context.put_many(items, b.mesh))

    def _placed(self, index: int, bucket: Bucket, named: dict) -> tuple:
        """(host array, placement) of one flat of bucket ``index`` (`StepLayout.state_items`): a split bucket's
        model shards' flats side by side on the mesh."""
        kind = self.kinds[index]
        placement = self._bucket_placement(kind)
        return host_flat(bucket, kind, named, self.tensor_plan, self._padded(bucket), placement,
                         self.basis.mesh), placement

    def named_tensors(self) -> dict:
        return self.layout.named_tensors(self.checkpoint_arrays(), self._joined)

    def _joined(self, index: int, bucket: Bucket, array) -> dict:
        """The named tensors of bucket ``index``, whole, from its array (joined from the model shards' slices)."""
        kind = self.kinds[index]
        return whole_tensors(bucket, kind, array.result(), self.tensor_plan, self._bucket_placement(kind),
                             self.basis.mesh)

    def checkpoint_parts(self) -> list:
        from .checkpoint_parts import tensor_parallel_parts

        return tensor_parallel_parts(self, self.basis.mesh)

    def placed_arrays(self) -> list:
        return [*super().placed_arrays(), self._model_rank]

    def describe(self, step_count: int) -> str:
        data = f" x {type(self.plan).__name__}({self.plan.axis!r})" if self.tensor.data is not None else ""
        return (f"<Trainer {type(self.basis.model).__name__} TensorParallel({self.tensor.axis!r}){data} on "
                f"{self.model_size} x {self.num_shards} shards, {len(self.layout.buckets)} buckets, "
                f"step {step_count}>")


class _Text(str):
    """A string that prints as itself in the REPL too (``trainer.runner.placements``)."""

    def __repr__(self) -> str:
        return str(self)
