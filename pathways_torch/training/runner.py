"""`StepRunner`: the seam between the one `Trainer` and a plan's way of running a step.

A plan picks its runner (``plan.make_runner(trainer)``): `DataParallelRunner` for
``DataParallel(axis)`` and ``ShardedDataParallel(axis)``, `CrossIslandRunner` for
``DataParallel(("island", axis))``, `PipelineRunner` for ``Pipeline(...)``. The `Trainer`
keeps what every plan shares — batches, run-ahead, step counting, recovery, checkpoints — and
asks the runner where the state lives and how a step, an evaluation and a save reach it.

A runner holds its `Trainer` (``runner.trainer``) and reads the shared fields from it: the
context, model, optimizer, loss, mesh, seed, ``max_grad_norm``, the optimizer's hyper-parameters
(``_spec``), ``step_count`` and the batch forms. Names a runner lists in ``exposed`` read as the
trainer's own (``trainer.schedule`` under a pipeline, ``trainer.bucket_cut`` across islands).
"""

from __future__ import annotations

import concurrent.futures
import weakref
from typing import Protocol

__all__ = ["StepRunner", "HoldsTrainer"]


class StepRunner(Protocol):
    """What a plan's runner does for `Trainer`."""

    num_shards: int                    # data shards a batch is split over (per stage, per island)
    exposed: tuple[str, ...]           # attribute names the trainer shows as its own

    def build(self):
        """Capture what the step needs and return the state's `step.StepLayout` (called once, after the
        optimizer is read)."""

    def recapture(self) -> None:
        """Capture the step again (after a `load`: its seed may have changed)."""

    def batch_pieces(self) -> tuple[int, str]:
        """How many equal pieces a batch is split into, and what they are (for the error)."""

    def restore(self, tensors: dict) -> None:
        """Put the named state on the executors with all the runner keeps there besides (shard ranks): at
        set-up and after a loss (recovery)."""

    def put_state(self, tensors: dict) -> None:
        """Put the named state on the executors in place of the current one (``trainer.load``)."""

    def dispatch(self, form, tensors: list, scalars, modes: tuple):
        """Dispatch one training step on the batch's host ``tensors`` (``scalars``: the step number and the
        hyper-parameters; ``modes``: every module's ``.training``); take the new state; return the loss."""

    def evaluate(self, batch):
        """The loss on ``batch``, forward only (a replicated 0-d `pw.Array`)."""

    def predict(self, batch):
        """The model's output on ``batch``."""

    def named_tensors(self) -> dict:
        """The state as named host tensors (``model/<name>``, ``optimizer/<param>/<state>``)."""

    def checkpoint_arrays(self) -> list:
        """Every array of the state a checkpoint writes (held until it is written)."""

    def checkpoint_parts(self) -> list:
        """The state as `sharded_checkpoint.CheckpointPart` s: each a layout on one set of holders."""

    def placed_arrays(self) -> list:
        """Every array the runner keeps on the mesh (recovery asks whether one was lost)."""

    def defer_save(self, directory: str, update_latest: bool) -> concurrent.futures.Future | None:
        """A future for a sharded save that cannot start yet (the state not on the executors), or None."""

    def describe(self) -> str:
        """The trainer's ``repr``."""


class HoldsTrainer:
    """A runner's link to its trainer, held weakly: the trainer holds its runner, and the cycle a strong
    link makes would keep the state's arrays (and so their shards on the executors) alive after ``del
    trainer``, until the cyclic collector happened to run."""

    @property
    def trainer(self):
        return self._trainer_ref()

    @trainer.setter
    def trainer(self, trainer) -> None:
        self._trainer_ref = weakref.ref(trainer)
