"""`PipelineTrainer`: the name of a `Trainer` under a `Pipeline` plan, kept for imports.

``ctx.wrap(..., plan=pw.Pipeline(...))`` returns a `Trainer` whose plan picked a `PipelineRunner`
(`runner`); how the step is built, run, checkpointed and evaluated lives there.
"""

from __future__ import annotations

from ..errors import PlacementError
from ..training.trainer import Trainer
from .plan import Pipeline

__all__ = ["PipelineTrainer"]


class PipelineTrainer(Trainer):
    """A `Trainer` made with a `Pipeline` plan (the same as ``ctx.wrap(..., plan=pw.Pipeline(...))``)."""

    def __init__(self, context, model, *, plan: Pipeline, **options):
        if not isinstance(plan, Pipeline):
            raise PlacementError(f"PipelineTrainer: expected a pw.Pipeline plan, got {plan!r}")
        super().__init__(context, model, plan=plan, **options)
