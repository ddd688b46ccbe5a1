"""`pw.Pipeline`: a model cut into stages across the mesh's ``pipe`` axis, microbatches flowing through them."""

from __future__ import annotations

import dataclasses

from ..errors import PlacementError
from ..islands import ISLAND_AXIS
from ..training.plans import DataParallel

__all__ = ["Pipeline"]

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved")


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """Pipeline parallelism, one registered program per step.

    ``stages``: pipe ranks (default: the size of the mesh's ``axis``); the model is cut
    into ``stages * virtual_stages`` chunks, chunk c on pipe rank c mod stages.
    ``microbatches``: how many pieces each batch is split into (rows, dim 0).
    ``schedule``: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or a schedule's text (see
    `pathways_torch.pipeline.schedules`). ``data``: ``None`` or ``pw.DataParallel(axis)`` /
    ``pw.ShardedDataParallel(axis)`` inside every stage. ``recompute``: save only each
    chunk's inputs and recompute its forward in the backward (activation checkpointing).
    ``balance``: how the automatic split weighs blocks (``"parameters"``). ``tensor``: ``None`` or
    ``pw.TensorParallel(plan, axis)``: every stage's layers split over the mesh's model axis too (a 3-D
    mesh pipe x data x model); its ``data`` stays None, the stages' data plan is this one's ``data``.
    """

    stages: int | None = None
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    data: DataParallel | None = None
    recompute: bool = False
    axis: str = "pipe"
    balance: str = "parameters"
    tensor: object = None

    def __post_init__(self):
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise PlacementError(f"pw.Pipeline: microbatches must be a positive int, got {self.microbatches!r}")
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise PlacementError(f"pw.Pipeline: virtual_stages must be a positive int, got {self.virtual_stages!r}")
        if self.stages is not None and (not isinstance(self.stages, int) or self.stages < 1):
            raise PlacementError(f"pw.Pipeline: stages must be a positive int or None, got {self.stages!r}")
        if self.data is not None and not isinstance(self.data, DataParallel):
            raise PlacementError(f"pw.Pipeline: data must be None, pw.DataParallel(axis) or "
                                 f"pw.ShardedDataParallel(axis), got {self.data!r}")
        _check_tensor(self.tensor)
        if self.balance != "parameters":
            raise PlacementError(f"pw.Pipeline: balance must be 'parameters', got {self.balance!r}")
        is_text = "\n" in self.schedule or ":" in self.schedule
        if not is_text and self.schedule not in SCHEDULE_NAMES:
            raise PlacementError(f"pw.Pipeline: schedule must be one of {list(SCHEDULE_NAMES)} or a schedule's "
                                 f"text, got {self.schedule!r}")
        if self.schedule in ("gpipe", "1f1b") and self.virtual_stages != 1:
            raise PlacementError(f"pw.Pipeline: schedule {self.schedule!r} runs one chunk per rank; with "
                                 f"virtual_stages={self.virtual_stages} use schedule='interleaved'")

    def make_runner(self, basis):
        """The `runner.StepRunner` of this plan, built from ``basis`` (a `runner.RunnerBasis`): `PipelineRunner`
        (``ctx.wrap`` calls it through `Trainer`)."""
        from .runner import PipelineRunner   # here: the plan stays importable without torch (tools, simulations)

        return PipelineRunner(basis, self)

    def check(self, mesh) -> tuple[int, int]:
        """(pipe ranks, data shards) on ``mesh``; refuses a mesh that does not fit the plan.

        On a mesh with an outer ``"island"`` axis the stages run across islands: pipe rank
        ``island_index x pipe_size + pipe_index`` (activations and gradients cross the link).
        """
        axes = dict(mesh.axes)
        if self.axis not in axes:
            raise PlacementError(f"pw.Pipeline: the mesh has axes {list(axes)}, no {self.axis!r} axis to put the "
                                 f"stages on; make the mesh with one, e.g. ctx.mesh({{{self.axis!r}: 2}})")
        islands = axes.get(ISLAND_AXIS, 1)
        stages = axes[self.axis] * islands
        if self.stages is not None and self.stages != stages:
            across = f" x {islands} islands" if islands > 1 else ""
            raise PlacementError(f"pw.Pipeline: stages={self.stages} but the mesh's {self.axis!r} axis has size "
                                 f"{axes[self.axis]}{across}; use stages={stages} (or None), or a mesh with "
                                 f"{self.axis!r}: {self.stages}")
        model_axis = self.tensor.axis if self.tensor is not None else None
        if model_axis is not None:
            if model_axis not in axes:
                raise PlacementError(f"pw.Pipeline: tensor={self.tensor!r} splits layers over axis {model_axis!r}; "
                                     f"the mesh has axes {list(axes)}: make it with one, e.g. ctx.mesh("
                                     f"{{{self.axis!r}: 2, 'data': 1, {model_axis!r}: 2}})")
            if islands > 1:
                raise PlacementError("pw.Pipeline: tensor parallelism inside stages that run across islands is not "
                                     "supported yet; use one island")
        others = {a: n for a, n in axes.items() if a not in (self.axis, ISLAND_AXIS, model_axis)}
        if self.data is None:
            if any(n > 1 for n in others.values()):
                raise PlacementError(f"pw.Pipeline: the mesh has axes {others} besides {self.axis!r} but the plan "
                                     f"has no data=...; pass data=pw.DataParallel({next(iter(others))!r})")
            return stages, 1
        if self.data.axis not in others or len([n for n in others.values() if n > 1]) > 1 and len(others) > 1:
            raise PlacementError(f"pw.Pipeline: data={self.data!r} names axis {self.data.axis!r}; the mesh's other "
                                 f"axes are {others}")
        return stages, others[self.data.axis]

    @property
    def num_chunks_per_rank(self) -> int:
        return self.virtual_stages


def _check_tensor(tensor) -> None:
    if tensor is None:
        return
    from ..tensor_parallel.plan import TensorParallel

    if not isinstance(tensor, TensorParallel):
        raise PlacementError(f"pw.Pipeline: tensor must be None or pw.TensorParallel(plan, axis), got {tensor!r}")
    if tensor.data is not None:
        raise PlacementError(f"pw.Pipeline: tensor={tensor!r} has its own data=...; inside a pipeline the stages' "
                             f"data plan is the pipeline's: pass data= to pw.Pipeline instead")
