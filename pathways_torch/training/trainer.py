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

from ..errors import CaptureError, PlacementError
from .batches import split_batch
from .checkpoint_folders import DEFAULT_KEEP, check_keep
from .locate import user_frame_summary
from .optimizers import read_optimizer
from .plans import DataParallel
from .recovery import TrainerRecovery
from .trainer_checkpoints import TrainerCheckpoints

__all__ = ["Trainer"]


class Trainer(TrainerRecovery, TrainerCheckpoints):
    """Train ``model`` with ``optimizer`` under ``plan`` on ``mesh``; see `Context.wrap`.

    Beside the methods below, a plan's own views read as the trainer's: under ``pw.Pipeline``
    ``trainer.schedule``, ``trainer.stages`` and ``trainer.timeline(path)``; across islands
    ``trainer.bucket_cut`` and ``trainer.timeline(path)`` (the runner's ``exposed`` names).
    """

    _runner = None

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
        self.max_grad_norm, self.seed = max_grad_norm, int(seed)
        self._runner = plan.make_runner(self)      # checks the plan against the mesh
        self.num_shards = self._runner.num_shards
        self._spec = read_optimizer(optimizer)
        self._batch_forms: dict = {}     # form key → BatchForm: how the step rebuilds each kind of batch
        self.samples_seen = 0            # batch rows dispatched: the data position a checkpoint records
        # Steps dispatched (the step number of the last one); an optimizer that already stepped counts.
        self.step_count = self._optimizer_step_count()
        self._unfinished_steps: collections.deque = collections.deque()   # the losses' completions, oldest first
        self.layout = self._runner.build()
        self._runner.restore(self._initial_tensors())
        self._set_up_recovery(checkpoint_dir, checkpoint_every, recover, replacement_timeout_s,
                              checkpoint_keep=checkpoint_keep)

    def __getattr__(self, name: str):
        # Only names the normal lookup missed: a plan's own views (`exposed` by its runner).
        runner = self.__dict__.get("_runner")
        if runner is not None and name in runner.exposed:
            return getattr(runner, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

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
        """
        form, tensors = self._batch_tensors(batch)
        if not self.recover:
            self._wait_for_room()
            with self._context._batched_release():
                loss = self._dispatch_step(form, tensors)
            self._unfinished_steps.append(loss.completion)
            self._maybe_save()
            return loss
        return self._recoverable_step(form, tensors)

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
        self._context._note_runahead_wait(start, limit, f"training step {self.step_count + 1}")

    def _modes(self) -> tuple:
        """Every module's ``.training``: read while tracing (dropout, batch statistics), so a change re-captures."""
        return tuple(m.training for m in self.model.modules())

    def _dispatch_step(self, form, tensors: list, *, spec=None, modes=None):
        import torch

        # Hyper-parameters may change between steps (a step run again after a recovery passes its own).
        spec = spec if spec is not None else read_optimizer(self.optimizer)
        modes = modes if modes is not None else self._modes()
        # What schedulers change (lr, momentum, betas, weight decay) rides in as values: no recompile.
        scalars = torch.tensor([self.step_count + 1, *spec.dynamic_values()], dtype=torch.float64)
        self._spec = spec
        loss = self._runner.dispatch(form, tensors, scalars, modes)
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
        pieces, what = self._runner.batch_pieces()
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
        on the parameters where they live. Captured once per batch shape and form."""
        return self._runner.evaluate(batch)

    def predict(self, batch):
        """The model's output on ``batch`` (in eval mode, no gradient), its tensors as `pw.Array` s sharded on
        dim 0 over the data axis, in the output's own structure (a tensor, a tuple, a ``transformers`` output)."""
        return self._runner.predict(batch)

    def _located(self, exc: CaptureError, what: str = "the training step") -> CaptureError:
        where = user_frame_summary(exc, self.model)
        if where is None:
            return exc
        return CaptureError(f"{type(self.model).__name__}: {what} cannot be captured at {where}\n{exc}")

    def __repr__(self) -> str:
        return self._runner.describe()
