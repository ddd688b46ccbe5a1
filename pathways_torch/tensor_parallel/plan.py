"""`pw.TensorParallel`: layers split over the mesh's ``model`` axis by torch's own plan, data parallel beside it."""

from __future__ import annotations

import dataclasses

from ..errors import PlacementError
from ..training.plans import DataParallel

__all__ = ["TensorParallel"]


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Tensor parallelism on ``axis`` with ``plan`` (module path pattern → torch ``ParallelStyle``, as
    ``parallelize_module`` takes it; `pw.tensor_parallel_plan` proposes one), and ``data``: None, or
    ``pw.DataParallel(axis)`` / ``pw.ShardedDataParallel(axis)`` over another mesh axis (a 2-D mesh).

    Each shard holds its slice of every split parameter and of its optimizer state; the collectives
    the styles need are explicit ops of the captured step. Under ``ShardedDataParallel`` each shard's
    flats are split again over the data axis and gathered whole at the step's start (the gather-all
    step: per-unit gathering is for the data-parallel plans on their own).
    """

    plan: object = None
    axis: str = "model"
    data: DataParallel | None = None
    sharded_state = False

    def __post_init__(self):
        if isinstance(self.plan, dict):
            object.__setattr__(self, "plan", tuple(self.plan.items()))    # frozen, and hashable
        if not isinstance(self.plan, tuple) or not self.plan:
            raise PlacementError(f"pw.TensorParallel: plan= expected a dict of module path pattern -> style, got "
                                 f"{self.plan!r}; pw.tensor_parallel_plan(model) proposes one")
        if self.data is not None and not isinstance(self.data, DataParallel):
            raise PlacementError(f"pw.TensorParallel: data must be None, pw.DataParallel(axis) or "
                                 f"pw.ShardedDataParallel(axis), got {self.data!r}")
        if self.data is not None and self.data.axis == self.axis:
            raise PlacementError(f"pw.TensorParallel: the data axis and the model axis are both {self.axis!r}; "
                                 f"name two axes of a 2-D mesh, e.g. ctx.mesh({{'data': 2, 'model': 2}})")

    def make_runner(self, basis):
        """The `runner.StepRunner` of this plan, built from ``basis`` (a `runner.RunnerBasis`): inside one mesh, or
        across islands when the data axis is ``("island", <data axis>)``."""
        # Imported here: the plan stays importable without torch.
        if self.across_islands:
            from .across_islands import TensorIslandRunner

            return TensorIslandRunner(basis, self)
        from .runner import TensorParallelRunner

        return TensorParallelRunner(basis, self)

    @property
    def across_islands(self) -> bool:
        """Whether the data axis is ``("island", <data axis>)``: TP inside each island, DP across them."""
        return self.data is not None and isinstance(self.data.axis, (tuple, list))

    def check(self, mesh) -> tuple[int, int]:
        """(model shards, data shards) on ``mesh``; refuses a mesh the plan does not fit."""
        axes = dict(mesh.axes)
        if self.axis not in axes:
            raise PlacementError(f"pw.TensorParallel: the mesh has axes {list(axes)}, no {self.axis!r} axis to "
                                 f"split layers over; make it with one, e.g. ctx.mesh({{'data': 2, "
                                 f"{self.axis!r}: 2}})")
        others = {a: n for a, n in axes.items() if a != self.axis}
        if self.across_islands:     # the axes' order is the cross-island runner's to check
            return axes[self.axis], axes.get(self.data.axis[-1], 1)
        if self.data is None:
            if any(n > 1 for n in others.values()):
                raise PlacementError(f"pw.TensorParallel: the mesh has axes {others} besides {self.axis!r} but the "
                                     f"plan has no data=...; pass data=pw.DataParallel({next(iter(others))!r})")
            return axes[self.axis], 1
        if self.data.axis not in others:
            raise PlacementError(f"pw.TensorParallel: data={self.data!r} names axis {self.data.axis!r}; the mesh's "
                                 f"other axes are {others}")
        extra = {a: n for a, n in others.items() if a != self.data.axis and n > 1}
        if extra:
            raise PlacementError(f"pw.TensorParallel: the mesh's axes {extra} are neither the model axis nor the "
                                 f"data axis; for a pipe axis, pass this plan as pw.Pipeline(..., tensor=...)")
        return axes[self.axis], axes[self.data.axis]

    def styles(self) -> dict:
        return dict(self.plan)
