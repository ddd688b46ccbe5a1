"""`StepRunner`: the seam between the one `Trainer` and a plan's way of running a step.

A plan picks its runner (``plan.make_runner(basis)``): `DataParallelRunner` for
``DataParallel(axis)`` and ``ShardedDataParallel(axis)``, `CrossIslandRunner` for
``DataParallel(("island", axis))``, `PipelineRunner` for ``Pipeline(...)``. The `Trainer`
keeps what every plan shares — batches, run-ahead, step counting, recovery, checkpoints — and
asks the runner where the state lives and how a step, an evaluation and a save reach it.

A runner is built from a `RunnerBasis` (what every step of the trainer shares: the context, model,
optimizer, loss, mesh, seed, ``max_grad_norm``, the batch forms) and holds no trainer: what changes
from call to call (the optimizer's hyper-parameters, the step number, the batch) comes with the call,
and a step's loss goes back. A plan's own views are the runner's (``trainer.runner.schedule`` under a
pipeline, ``trainer.runner.bucket_cut`` across islands).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Protocol

__all__ = ["StepRunner", "RunnerBasis"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerBasis:
    """What a runner is built from: the parts of a `Trainer` every step shares."""

    context: object                  # the `Context` the state and the steps live in
    model: object                    # the user's ``nn.Module`` (traced, never run on the client)
    optimizer: object                # the user's ``torch.optim`` optimizer (its groups and state names)
    loss_fn: Callable | None
    mesh: object
    seed: int                        # the dropout seed (a `load` may change it: `StepRunner.recapture`)
    max_grad_norm: float | None
    # form key → `batches.BatchForm`, filled by the trainer as kinds of batch come: how a step rebuilds each.
    batch_forms: dict
    # The dispatched steps' loss completions, oldest first (the trainer's run-ahead): a picture of the last step
    # waits for them.
    unfinished_steps: collections.deque


class StepRunner(Protocol):
    """What a plan's runner does for `Trainer`."""

    num_shards: int                    # data shards a batch is split over (per stage, per island)
    # Whether the state is on the executors (False under a pipeline until a batch shows its split): the trainer
    # defers a sharded save until it is, and ``dispatch``/``evaluate`` call ``placed`` once it is.
    state_on_executors: bool

    def build(self, spec):
        """Capture what the step needs for the optimizer's hyper-parameters ``spec`` (`optimizers.OptimizerSpec`)
        and return the state's `step.StepLayout` (called once)."""

    def recapture(self, spec, seed: int) -> None:
        """Capture the step again (after a `load`: its ``seed`` may have changed)."""

    def batch_pieces(self) -> tuple[int, str]:
        """How many equal pieces a batch is split into, and what they are (for the error)."""

    def restore(self, tensors: dict) -> None:
        """Put the named state on the executors with all the runner keeps there besides (shard ranks): at
        set-up and after a loss (recovery)."""

    def put_state(self, tensors: dict) -> None:
        """Put the named state on the executors in place of the current one (``trainer.load``)."""

    def dispatch(self, form, tensors: list, scalars, modes: tuple, *, spec, step: int,
                 placed: Callable[[], None]):
        """Dispatch training step number ``step`` on the batch's host ``tensors`` (``scalars``: the step number and
        the hyper-parameters' values; ``spec``: the hyper-parameters; ``modes``: every module's ``.training``);
        take the new state; return the loss. ``placed()`` runs once the state is on the executors, before the
        step that starts from it (a runner whose state is always there need not call it)."""

    def evaluate(self, form, tensors: list, *, placed: Callable[[], None]):
        """The loss on the batch's host ``tensors``, forward only (a replicated 0-d `pw.Array`); ``placed`` as
        ``dispatch`` takes it."""

    def refusal(self, kind: str) -> Exception | None:
        """Why ``kind`` (``"evaluate"`` or ``"predict"``) is not supported under this plan, or None: the trainer
        raises it before it looks at the batch."""

    def predict(self, form, tensors: list):
        """The model's output on the batch's host ``tensors``."""

    def named_tensors(self) -> dict:
        """The state as named host tensors (``model/<name>``, ``optimizer/<param>/<state>``)."""

    def checkpoint_arrays(self) -> list:
        """Every array of the state a checkpoint writes (held until it is written)."""

    def checkpoint_parts(self) -> list:
        """The state as `sharded_checkpoint.CheckpointPart` s: each a layout on one set of holders."""

    def placed_arrays(self) -> list:
        """Every array the runner keeps on the mesh (recovery asks whether one was lost)."""

    def describe(self, step_count: int) -> str:
        """The trainer's ``repr`` at step ``step_count``."""
