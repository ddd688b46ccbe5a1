"""Parallelism plans for `ctx.wrap`: where parameters and optimizer state live, how gradients meet.

- `DataParallel(axis)`: every executor on ``axis`` holds the whole flat parameter
  buffers and optimizer state; the batch is split on ``axis``; each bucket's
  gradient is averaged with one all-reduce (DDP's bucketing, in-island: buckets of
  ``local_bucket_mb``, by default 4 MB on eager executors and one per group on XLA).
- `ShardedDataParallel(axis)` (ZeRO-3/FSDP-like): each executor stores 1/N of every
  flat buffer — parameters, gradients and optimizer state — and updates only its slice.
  A step gathers one *unit*'s parameters (a repeated block, `units.py`) just before
  its forward and drops them after, gathers them again for its backward, and
  reduce-scatters its gradient as soon as the backward has made it (`unit_schedule.py`),
  so that the peak inside a step is divided too. ``per_unit=False`` is the older step:
  every bucket gathered at its start and kept to its end.

Both average gradients over the data shards, as DDP does: with a mean-reduced
loss and equal shards this is the gradient of the global batch.
"""

from __future__ import annotations

import dataclasses

from ..errors import PlacementError

__all__ = ["DataParallel", "ShardedDataParallel", "Plan", "LOCAL_BUCKET_MB"]

# Measured (bench/sharding.py, 64 MiB of parameters, AdamW, eager): peaks of 5.2-5.5 P at 8 MB and 5.0-5.7 at 2-4,
# against 7.0-7.7 at 25 MB and 7.4 with one buffer; steps of about 0.6 s against 1.0 s with one buffer.
LOCAL_BUCKET_MB = 4.0


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """Replicated parameters and optimizer state, batch sharded on ``axis``, gradients all-reduced."""

    axis: str = "data"
    # Across islands (axis ("island", <data axis>)): the size of the gradient buckets exchanged between
    # islands, each sent as soon as the backward has made it (DDP's bucket_cap_mb; the first is at most
    # 1 MB so that the exchange starts early). Inside one island a group's gradient is one bucket.
    bucket_mb: float = 25.0
    # Inside one island: the most megabytes of one flat state buffer, whose gradient is flattened, reduced and
    # applied on its own. None: the backend's choice, `LOCAL_BUCKET_MB` where ops run one by one (eager: an op's
    # temporaries are a buffer's size, and a buffer's gradient leaves before the next is flattened), one buffer
    # per optimizer group on the XLA routes (one collective, and XLA fuses the update).
    local_bucket_mb: float | None = None
    sharded_state = False

    def __post_init__(self):
        for name in ("bucket_mb", "local_bucket_mb"):
            value = getattr(self, name)
            if value is None and name == "local_bucket_mb":
                continue
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{type(self).__name__}: {name} must be a positive number of megabytes, got "
                                 f"{value!r}")

    def local_bucket_bytes(self, backend: str) -> int | None:
        """The cap on one flat state buffer's bytes inside an island on ``backend`` (None: no cap)."""
        if self.local_bucket_mb is not None:
            return int(self.local_bucket_mb * 2**20)
        return None if backend.startswith("xla") else int(LOCAL_BUCKET_MB * 2**20)

    def make_runner(self, basis):
        """The `runner.StepRunner` that runs a trainer's steps under this plan, built from ``basis`` (a
        `runner.RunnerBasis`): one mesh, or across islands when the axis is ``("island", <data axis>)``."""
        # Imported here: the runners import the plans (no circle at import time), and a plan stays light.
        if isinstance(self.axis, (tuple, list)):
            from .cross_island import CrossIslandRunner

            return CrossIslandRunner(basis, self)
        from .data_parallel import DataParallelRunner

        return DataParallelRunner(basis, self)

    def check(self, mesh) -> int:
        """The number of data shards; refuses a mesh without the axis."""
        if isinstance(self.axis, (tuple, list)):
            raise PlacementError(f"{type(self).__name__}({tuple(self.axis)!r}): several axes are for data "
                                 f"parallelism across islands, ({'island'!r}, <data axis>), which ctx.wrap trains "
                                 f"with its own trainer; here one axis is expected")
        if self.axis not in mesh.axes:
            raise PlacementError(f"{type(self).__name__}({self.axis!r}): the mesh has axes {list(mesh.axes)}; "
                                 f"name one of them, e.g. {type(self).__name__}({next(iter(mesh.axes))!r})")
        return mesh.axes[self.axis]

    def state_placement(self) -> dict:
        from ..placement import Replicate

        return {self.axis: Replicate()}

    def gather(self, flat, numel: int, num_shards: int):
        return flat

    def reduce_gradient(self, grad, num_shards: int):
        from ..collectives import all_reduce

        return all_reduce(grad, self.axis, "mean") if num_shards > 1 else grad

    def reduce(self, grads: list, loss, num_shards: int) -> tuple[list, object]:
        """Average the gradient buckets and the loss over the axis.

        The loss rides in the first bucket's all-reduce when their dtypes agree: one
        collective fewer per step (a round trip between every pair of executors).
        """
        import torch

        from ..collectives import all_reduce

        if num_shards == 1:
            return grads, loss
        if grads[0].dtype != loss.dtype:
            return [self.reduce_gradient(g, num_shards) for g in grads], all_reduce(loss, self.axis, "mean")
        packed = self.reduce_gradient(torch.cat([grads[0], loss.reshape(1)]), num_shards)
        rest = [self.reduce_gradient(g, num_shards) for g in grads[1:]]
        # The loss leaves the step as its own tensor: a view would keep the whole packed gradient alive as long
        # as anyone holds the loss (every executor, one bucket per loss kept).
        return [packed[:-1], *rest], packed[-1].clone()

    def global_sum(self, x, num_shards: int):
        """Sum of a per-shard quantity over the whole (unsharded) state: local here."""
        return x

    def from_first_shard(self, x, rank, num_shards: int):
        """Shard 0's value of ``x`` on every shard (DDP's buffer broadcast): a sum in which only shard 0 counts."""
        from ..collectives import all_reduce

        import torch

        if num_shards == 1:
            return x
        if x.dtype == torch.bool:   # a sum of flags: as bytes
            return self.from_first_shard(x.to(torch.uint8), rank, num_shards).to(torch.bool)
        first = (rank.reshape(()) == 0).to(x.dtype)
        return all_reduce(x * first, self.axis, "sum")


@dataclasses.dataclass(frozen=True)
class ShardedDataParallel(DataParallel):
    """Parameters, gradients and optimizer state sharded on ``axis`` (ZeRO-3-like storage), gathered per unit."""

    # The modules whose parameters are gathered together (FSDP's units); None: the model's repeated blocks.
    units: tuple[str, ...] | None = None
    # False: every bucket gathered at the start of the step and kept to its end (the older, gather-all step).
    per_unit: bool = True
    # FSDP's reshard_after_forward: drop a unit's parameters after its forward and gather them again for its
    # backward (False: keep them, one collective fewer and the peak of all units' parameters).
    reshard_after_forward: bool = True
    # Issue the next unit's gather before the current unit's ops, waited for just before its first reader: on
    # eager executors it overlaps the current unit's compute (one unit more held); on XLA it only moves earlier.
    prefetch: bool = False
    # Found blocks smaller than this join the next ones into one unit (a gather costs a round trip whatever its
    # size); blocks named in units= are never joined.
    min_unit_mb: float = 1.0
    sharded_state = True

    def __post_init__(self):
        super().__post_init__()
        if self.units is not None:
            if isinstance(self.units, str) or not all(isinstance(u, str) for u in self.units):
                raise ValueError(f"ShardedDataParallel: units= expected a list of module names, got {self.units!r}")
            object.__setattr__(self, "units", tuple(self.units))
        if not (isinstance(self.min_unit_mb, (int, float)) and self.min_unit_mb >= 0):
            raise ValueError(f"ShardedDataParallel: min_unit_mb must be a number of megabytes >= 0, got "
                             f"{self.min_unit_mb!r}")
        for name in ("per_unit", "reshard_after_forward", "prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ShardedDataParallel: {name} must be True or False, got {getattr(self, name)!r}")

    def state_placement(self) -> dict:
        from ..placement import Shard

        return {self.axis: Shard(0)}

    def gather(self, flat, numel: int, num_shards: int):
        from ..collectives import all_gather

        full = all_gather(flat, self.axis, 0) if num_shards > 1 else flat
        return full.narrow(0, 0, numel)

    def reduce_gradient(self, grad, num_shards: int):
        from ..collectives import reduce_scatter

        return reduce_scatter(grad, self.axis, "mean", 0) if num_shards > 1 else grad

    def reduce(self, grads: list, loss, num_shards: int) -> tuple[list, object]:
        """Reduce-scatter every gradient bucket; all-reduce the loss."""
        from ..collectives import all_reduce

        if num_shards == 1:
            return grads, loss
        return [self.reduce_gradient(g, num_shards) for g in grads], all_reduce(loss, self.axis, "mean")

    def global_sum(self, x, num_shards: int):
        from ..collectives import all_reduce

        return all_reduce(x, self.axis, "sum") if num_shards > 1 else x


Plan = DataParallel
