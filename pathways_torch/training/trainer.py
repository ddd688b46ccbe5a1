"""`Trainer`: a user's ``nn.Module`` + ``torch.optim`` optimizer trained on a mesh (made by ``ctx.wrap``).

Parameters, buffers and optimizer state are put on the executors once and stay
there; each `step` puts the batch's shards straight onto the executors that use
them, dispatches one step and returns the loss as a future at once, so the client
runs ahead of the executors. How a step runs, and where the state lives, is the
plan's: it picks a `runner.StepRunner` (data parallel, across islands, pipeline);
recovery (`recovery.TrainerRecovery`) and checkpoints (`trainer_checkpoints`) work
through that runner, whatever the plan.
"""

from __future__ import annotations

import collections
import time
from typing import Callable

from ..errors import CaptureError, ExecutorLostError, PlacementError, RemoteError
from .batches import split_batch
from .checkpoint_folders import DEFAULT_KEEP, check_keep
from .optimizers import read_optimizer
from .plans import DataParallel
from .recovery import MAX_ATTEMPTS, KeptStep, StepLoss, TrainerRecovery, is_recoverable
from .runner import RunnerBasis
from .trainer_checkpoints import TrainerCheckpoints

__all__ = ["Trainer"]


class Trainer(TrainerRecovery, TrainerCheckpoints):
    """Train ``model`` with ``optimizer`` under ``plan`` on ``mesh``; see `Context.wrap`.

    A plan's own views are its runner's (``trainer.runner``, a `runner.StepRunner`): under ``pw.Pipeline``
    ``trainer.runner.schedule``, ``trainer.runner.stages`` and ``trainer.runner.timeline(path)``; across islands
    ``trainer.runner.bucket_cut`` and ``trainer.runner.timeline(path)``; under ``pw.TensorParallel``
    ``trainer.runner.placements``.
    """

    def __init__(self, context, model, *, optimizer, loss_fn: Callable | None, mesh, plan=None,
                 max_grad_norm: float | None = None, seed: int = 0, checkpoint_dir: str | None = None,
                 checkpoint_every: int = 0, recover: bool | None = None, replacement_timeout_s: float = 120.0,
                 checkpoint_keep: int = DEFAULT_KEEP):
        import torch

        check_keep(checkpoint_keep)      # before anything is put on the mesh
        plan = plan if plan is not None else DataParallel(next(iter(mesh.axes)))
        if not callable(getattr(plan, "make_runner", None)):
            raise PlacementError(f"plan: expected pw.DataParallel(axis), pw.ShardedDataParallel(axis), "
                                 f"pw.TensorParallel(plan, ...) or pw.Pipeline(...), got {plan!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm: expected a positive number or None, got {max_grad_norm!r}")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ctx.wrap: expected an nn.Module, got {type(model).__name__}")
        self._context, self.model, self.optimizer, self.loss_fn = context, model, optimizer, loss_fn
        self.mesh, self.plan = mesh, plan
        self.seed = int(seed)
        self._batch_forms: dict = {}     # form key → BatchForm: how the step rebuilds each kind of batch
        self._unfinished_steps: collections.deque = collections.deque()   # the losses' completions, oldest first
        # The plan's runner (checks the plan against the mesh): how a step runs and where the state lives.
        self.runner = plan.make_runner(RunnerBasis(
            context=context, model=model, optimizer=optimizer, loss_fn=loss_fn, mesh=mesh, seed=self.seed,
            max_grad_norm=max_grad_norm, batch_forms=self._batch_forms, unfinished_steps=self._unfinished_steps))
        self.num_shards = self.runner.num_shards
        self._spec = read_optimizer(optimizer)
        self.samples_seen = 0            # batch rows dispatched: the data position a checkpoint records
        # Steps dispatched (the step number of the last one); an optimizer that already stepped counts.
        self.step_count = self._optimizer_step_count()
        self.layout = self.runner.build(self._spec)
        self.runner.restore(self._initial_tensors())
        self._set_up_recovery(checkpoint_dir, checkpoint_every, recover, replacement_timeout_s,
                              checkpoint_keep=checkpoint_keep)

    @property
    def max_grad_norm(self) -> float | None:
        """The gradient norm the step clips to (None: no clipping): fixed when the trainer is made, since every
        captured step holds it."""
        return self.runner.basis.max_grad_norm

    def _optimizer_step_count(self) -> int:
        """The step count of an optimizer that has already stepped (0 for a fresh one)."""
        steps = {float(s["step"]) for s in self.optimizer.state.values() if "step" in s}
        if len(steps) > 1:
            raise CaptureError(f"optimizer state: parameters are at different step counts {sorted(steps)}; "
                               f"the captured update keeps one step count")
        return int(steps.pop()) if steps else 0

    # ------------------------------------------------------------ stepping

    def step(self, batch):
        """Dispatch one training step on ``batch`` and return its loss (a replicated 0-d `pw.Array`) at once.

        ``batch`` is ``(*inputs, target)``: the loss is ``loss_fn(model(*inputs), target)``
        (``model(*batch)`` when ``loss_fn`` is None); or a dict or dataclass passed as keywords
        (``model(**batch)``, then ``loss_fn(output, batch)`` or the model's own ``.loss``); see
        `pathways_torch.training.batches`. Every tensor is split on dim 0 over the plan's axis;
        other values are static (a new value captures a new step).

        With recovery on (``checkpoint_every``), the loss is a `recovery.StepLoss` that follows the step when a
        lost executor makes it run again, and the step is kept until a checkpoint after it is written.
        """
        form, tensors = self._batch_tensors(batch)
        if self.recover:
            self._recover_from_failed_step()
        self._wait_for_room()
        spec, modes = read_optimizer(self.optimizer), self._modes()
        number = self.step_count + 1
        for attempt in range(MAX_ATTEMPTS + 1):
            try:
                with self._context.batched_release():
                    array = self._dispatch_step(form, tensors, spec=spec, modes=modes)
                break
            except (ExecutorLostError, RemoteError) as exc:   # the state was lost: recover (if on), dispatch it again
                if attempt == MAX_ATTEMPTS or not is_recoverable(exc) or not self.recover_from(exc):
                    raise
        loss = array
        if self.recover:
            loss = StepLoss(self, array, number)
            self._recovery.keep(KeptStep(number=number, form=form, tensors=tuple(tensors), spec=spec, modes=modes,
                                         loss=loss))
        self._unfinished_steps.append(array.completion)
        self._maybe_save()
        return loss

    def _maybe_save(self) -> None:
        if self.checkpoint_every and self.step_count % self.checkpoint_every == 0:
            self.save_sharded(self.checkpoint_dir)

    def _wait_for_room(self) -> None:
        """Bounded run-ahead: at most ``max_inflight_steps`` steps unfinished; wait for the oldest past it."""
        limit = self._context.config.max_inflight_steps
        steps = self._unfinished_steps
        while steps and steps[0].done():
            steps.popleft()
        if len(steps) < limit:
            return
        start = time.time_ns()
        # Down to half the bound (as the controller does for calls): one wake-up per few steps. No flush of
        # pending frees here: they ride on the next step's messages, sent right after.
        while len(steps) > limit - max(1, limit // 2):
            steps.popleft().wait()       # settles on success, failure, a lost executor or a closed context
        self._context.note_runahead_wait(start, limit, f"training step {self.step_count + 1}")

    def _modes(self) -> tuple:
        """Every module's ``.training``: read while tracing (dropout, batch statistics), so a change re-captures."""
        return tuple(m.training for m in self.model.modules())

    def _dispatch_step(self, form, tensors: list, *, spec, modes):
        import torch

        # Hyper-parameters may change between steps (a step run again after a recovery passes its own).
        # What schedulers change (lr, momentum, betas, weight decay) rides in as values: no recompile.
        scalars = torch.tensor([self.step_count + 1, *spec.dynamic_values()], dtype=torch.float64)
        self._spec = spec
        loss = self.runner.dispatch(form, tensors, scalars, modes, spec=spec, step=self.step_count + 1,
                                    placed=self._write_deferred_save)
        # The optimizer did step (on the executors): say so where lr_scheduler looks, or each scheduler warns
        # that it was stepped before its optimizer (and torch code reads this flag, not a method).
        self.optimizer._opt_called = True
        self.step_count += 1
        self.samples_seen += int(tensors[0].shape[0])
        return loss

    def _batch_tensors(self, batch) -> tuple:
        """The batch's form (kept for the step to rebuild it) and its tensor leaves, each checked to split."""
        form, tensors = split_batch(batch)
        self._batch_forms.setdefault(form.key, form)
        pieces, what = self.runner.batch_pieces()
        for index, t in enumerate(tensors):
            if t.dim() == 0 or t.shape[0] % pieces:
                size = t.shape[0] if t.dim() else "a 0-d tensor"
                raise PlacementError(
                    f"trainer.step: batch tensor {index} has {size} rows, not divisible by {what}; use a batch "
                    f"size that is a multiple of {pieces} (or drop the last partial batch)")
        return form, tensors

    # ------------------------------------------------------------ evaluation

    def evaluate(self, batch):
        """The loss on ``batch`` (a replicated 0-d `pw.Array`, at once): forward and loss only, in eval mode,
        on the parameters where they live. Captured once per batch shape and form. After a loss of the state,
        on the restored state (recovery on)."""
        form, tensors = self._checked_batch("evaluate", batch)
        return self._after_recovery(lambda: self.runner.evaluate(form, tensors, placed=self._write_deferred_save))

    def predict(self, batch):
        """The model's output on ``batch`` (in eval mode, no gradient), its tensors as `pw.Array` s sharded on
        dim 0 over the data axis, in the output's own structure (a tensor, a tuple, a ``transformers`` output)."""
        form, tensors = self._checked_batch("predict", batch)
        return self._after_recovery(lambda: self.runner.predict(form, tensors))

    def _checked_batch(self, kind: str, batch) -> tuple:
        """The batch of an evaluation or prediction, once the plan supports ``kind`` (refused before the batch is
        looked at)."""
        refused = self.runner.refusal(kind)
        if refused is not None:
            raise refused
        return self._batch_tensors(batch)

    def __repr__(self) -> str:
        return self.runner.describe(self.step_count)
