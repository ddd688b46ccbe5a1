"""Pipeline parallelism: a model cut into chunks across a mesh's ``pipe`` axis, one program per step.

- `marker`: ``pw.pipe_split()``, where a chunk ends;
- `split`: the traced forward + loss cut into chunk graphs (markers, or a block list balanced);
- `autograd`: each chunk's forward and backward graphs (what the forward keeps for the backward);
- `schedules`: GPipe, 1F1B and interleaved 1F1B as per-rank action lists, text in and out, simulated;
- `chunk_functions`: the per-chunk functions of a step (forward, backward, tied gradients, update);
- `plan`: `Pipeline`, the plan for ``ctx.wrap``; `trainer`: `PipelineTrainer`.
"""

from .marker import pipe_split
from .plan import Pipeline
from .schedules import Schedule, ScheduleError, make_schedule, simulate, with_communication
from .trainer import PipelineTrainer

__all__ = ["pipe_split", "Pipeline", "PipelineTrainer", "Schedule", "ScheduleError", "make_schedule", "simulate",
           "with_communication"]
