"""Pipeline parallelism: a model cut into chunks across a mesh's ``pipe`` axis, one program per step.

- `marker`: ``pw.pipe_split()``, where a chunk ends;
- `split`: the traced forward + loss cut into chunk graphs (markers, or a block list balanced);
- `autograd`: each chunk's forward and backward graphs (what the forward keeps for the backward);
- `schedules`: GPipe, 1F1B and interleaved 1F1B as per-rank action lists, text in and out, simulated
  (a package: the action IR, communication, the generators, the simulator);
- `chunk_functions`: the per-chunk functions of a step (forward, backward, tied gradients, update);
- `plan`: `Pipeline`, the plan for ``ctx.wrap``, which picks `runner.PipelineRunner` (built by `build`);
  `trainer`: the name `PipelineTrainer`, kept for imports;
- `evaluation`: its ``evaluate`` (forwards only, in eval mode); `checkpoints`: its executor-written
  checkpoints (each stage writes its own chunks) and recovery.

The fx carver the splitter shares with the bucket cut is `pathways_torch.graph_cut`; the step's
picture (``trainer.runner.timeline``) is `pathways_torch.observe.timeline`.
"""

import importlib

__all__ = ["pipe_split", "Pipeline", "PipelineTrainer", "Schedule", "ScheduleError", "make_schedule", "simulate",
           "with_communication"]

# Resolved lazily: `schedules` imports no torch (simulated executors and tools use it alone).
_WHERE = {"pipe_split": "marker", "Pipeline": "plan", "PipelineTrainer": "trainer", "Schedule": "schedules",
          "ScheduleError": "schedules", "make_schedule": "schedules", "simulate": "schedules",
          "with_communication": "schedules"}


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'pathways_torch.pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
