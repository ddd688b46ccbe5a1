"""`Trainer`: a user's ``nn.Module`` + ``torch.optim`` optimizer trained on a mesh (made by ``ctx.wrap``).

Parameters, buffers and optimizer state are put on the executors once and stay
there; each `step` puts the batch's shards straight onto the executors that use
them, dispatches one captured step and returns the loss as a future at once, so
the client runs ahead of the executors.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import time
from typing import Callable

from ..errors import CaptureError, ExecutorLostError, PathwaysError, PlacementError, RemoteError
from ..functions import Function
from ..placement import Replicate, Shard
from .batches import split_batch
from .evaluation import make_forward
from .buckets import flatten, make_buckets
from .checkpoint_folders import DEFAULT_KEEP, check_keep
from .locate import user_frame_summary
from .optimizers import read_optimizer
from .plans import DataParallel
from .recovery import MAX_ATTEMPTS, KeptStep, RecoveryFailed, RecoveryLog, StepLoss, describe_cause, is_recoverable
from .step import StepLayout, make_step
from .trainer_checkpoints import TrainerCheckpoints

__all__ = ["Trainer"]

log = logging.getLogger(__name__)

_STATE_WAIT_S = 600.0     # how long recovery waits for the newest state to end, to see whether it failed


class Trainer(TrainerCheckpoints):
    """Train ``model`` with ``optimizer`` under ``plan`` on ``mesh``; see `Context.wrap`."""

    # Checkpoints written by the executors (set in `_set_up_recovery`).
    checkpoint_dir: str | None = None
    checkpoint_every = 0
    checkpoint_keep = DEFAULT_KEEP
    checkpoints_written = 0
    _checkpoint = None
    recover = False            # recovery from a lost executor (set in __init__ with checkpoint_every)
    _recovery: RecoveryLog | None = None

    def __init__(self, context, model, *, optimizer, loss_fn: Callable | None, mesh, plan=None,
                 max_grad_norm: float | None = None, seed: int = 0, checkpoint_dir: str | None = None,
                 checkpoint_every: int = 0, recover: bool | None = None, replacement_timeout_s: float = 120.0,
                 checkpoint_keep: int = DEFAULT_KEEP):
        import torch

        check_keep(checkpoint_keep)      # before anything is put on the mesh
        plan = plan if plan is not None else DataParallel(next(iter(mesh.axes)))
        if not isinstance(plan, DataParallel):
            raise PlacementError(f"plan: expected pw.DataParallel(axis) or pw.ShardedDataParallel(axis), got {plan!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm: expected a positive number or None, got {max_grad_norm!r}")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ctx.wrap: expected an nn.Module, got {type(model).__name__}")
        self._context, self.model, self.optimizer, self.loss_fn = context, model, optimizer, loss_fn
        self.mesh, self.plan = mesh, plan
        self.max_grad_norm, self.seed = max_grad_norm, int(seed)
        self.num_shards = plan.check(mesh)
        self._spec = read_optimizer(optimizer)
        buckets, frozen = make_buckets(model, optimizer)
        self.layout = StepLayout(buckets=tuple(buckets), state_names=self._spec.state_names,
                                 buffer_names=tuple(n for n, _ in model.named_buffers()),
                                 frozen_names=tuple(frozen), num_groups=len(optimizer.param_groups))
        self.samples_seen = 0        # batch rows dispatched: the data position a checkpoint records
        # Steps dispatched (the step number of the last one); an optimizer that already stepped counts.
        self.step_count = self._optimizer_step_count()
        self._batch_forms: dict = {}     # form key → BatchForm: how the step rebuilds each kind of batch
        self._forwards: dict = {}        # "loss" / "predict" → its Function (evaluate, predict)
        self._output_specs: dict = {}    # form key → how predict rebuilds the model's output
        self._function = self._make_function()
        self._unfinished_steps: collections.deque = collections.deque()   # the losses' events, oldest first
        self._put_rank()
        self._put_state(self._initial_tensors())
        self._set_up_recovery(checkpoint_dir, checkpoint_every, recover, replacement_timeout_s,
                              checkpoint_keep=checkpoint_keep)

    def _set_up_recovery(self, checkpoint_dir, checkpoint_every: int, recover, replacement_timeout_s: float, *,
                         checkpoint_keep: int = DEFAULT_KEEP) -> None:
        """Checkpoints written by the executors every ``checkpoint_every`` steps, and recovery from them; the
        ``checkpoint_keep`` newest kept (0: all; `checkpoint_folders`)."""
        self.checkpoint_keep = check_keep(checkpoint_keep)
        if checkpoint_every and not checkpoint_dir or checkpoint_every < 0:
            raise ValueError(f"checkpoint_every={checkpoint_every!r}: expected a number of steps >= 1 with "
                             f"checkpoint_dir (got checkpoint_dir={checkpoint_dir!r}), or 0 for none")
        self.checkpoint_dir, self.checkpoint_every = checkpoint_dir, int(checkpoint_every)
        self._checkpoint: concurrent.futures.Future | None = None   # the save in flight (one at a time)
        self.checkpoints_written = 0
        if recover and not checkpoint_every:
            raise ValueError("recover=True: recovery restores the last checkpoint written by the executors; give "
                             "checkpoint_dir= and checkpoint_every=K (K steps at most are run again)")
        self.recover = bool(checkpoint_every) if recover is None else bool(recover)
        self.replacement_timeout_s = float(replacement_timeout_s)
        self._recovery = RecoveryLog()
        if self.recover:
            # Step 0: a loss before the first K steps restores this. It leaves an existing `latest` alone (a run
            # being resumed: the user loads it next).
            latest = os.path.join(self.checkpoint_dir, "latest")
            self.save_sharded(self.checkpoint_dir, update_latest=not os.path.exists(latest))

    # ------------------------------------------------------------ set-up

    def _make_function(self) -> Function:
        state = self.plan.state_placement()
        outs = ([Replicate()] + [state] * len(self.layout.buckets) * (1 + len(self.layout.state_names))
                + [Replicate()] * len(self.layout.buffer_names))
        step = make_step(self.model, self.loss_fn, self._spec, self.layout, self.plan, self.num_shards, self.seed,
                         self.max_grad_norm, batch_forms=self._batch_forms)
        return Function(step, out=tuple(outs), name=step.__name__, mesh=self.mesh)

    def _initial_tensors(self) -> dict:
        """Named host tensors of the whole training state, from the user's model and optimizer."""
        import torch

        params = dict(self.model.named_parameters())
        tensors = {f"model/{n}": t.detach() for n, t in self.model.named_buffers()}
        tensors.update({f"model/{n}": p.detach() for n, p in params.items()})
        for name in self.layout.state_names:
            for bucket in self.layout.buckets:
                for slot in bucket.slots:
                    existing = self.optimizer.state.get(params[slot.name], {}).get(name)
                    value = existing if existing is not None else torch.zeros_like(params[slot.name])
                    tensors[f"optimizer/{slot.name}/{name}"] = value.detach()
        return tensors

    def _put_rank(self) -> None:
        """Each shard's rank on the mesh (the step reads it: the first shard's buffers, dropout keys)."""
        import torch

        self._rank = self._context.put(torch.arange(self.num_shards, dtype=torch.int64), self.mesh,
                                       {self.plan.axis: Shard(0)})

    def _optimizer_step_count(self) -> int:
        """The step count of an optimizer that has already stepped (0 for a fresh one)."""
        steps = {float(s["step"]) for s in self.optimizer.state.values() if "step" in s}
        if len(steps) > 1:
            raise CaptureError(f"optimizer state: parameters are at different step counts {sorted(steps)}; "
                               f"the captured update keeps one step count")
        return int(steps.pop()) if steps else 0

    def _put_state(self, tensors: dict) -> None:
        """Put the named training state on the executors (flat buckets under the plan's placement)."""
        layout = self.layout
        placement = self.plan.state_placement()
        padded = [b.padded_numel(self.num_shards) if self.plan.sharded_state else b.numel for b in layout.buckets]

        def bucket_flat(bucket, n, key):
            return flatten(bucket, {s.name: tensors[key(s.name)].to(bucket.dtype) for s in bucket.slots}, n)

        items = [(bucket_flat(b, n, lambda s: f"model/{s}"), placement) for b, n in zip(layout.buckets, padded)]
        # Optimizer state bucket-major, in the step's input (and output) order.
        items += [(bucket_flat(b, n, lambda s, name=name: f"optimizer/{s}/{name}"), placement)
                  for b, n in zip(layout.buckets, padded) for name in layout.state_names]
        items += [(tensors[f"model/{n}"], Replicate()) for n in layout.buffer_names + layout.frozen_names]
        self._flats, self._states, self._buffers, self._frozen = layout.split_state(
            self._context.put_many(items, self.mesh))

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
            self._unfinished_steps.append(loss._record.event)
            self._maybe_save()
            return loss
        return self._recoverable_step(form, tensors)

    def _maybe_save(self) -> None:
        if self.checkpoint_every and self.step_count % self.checkpoint_every == 0:
            self.save_sharded(self.checkpoint_dir)

    # ------------------------------------------------------------ recovery (training.recovery)

    def _recoverable_step(self, form, tensors: list) -> StepLoss:
        """A step whose loss follows it through recoveries: kept until a checkpoint after it is written."""
        error = self._recovery.failed()
        if error is not None:
            self.recover_from(error)
        self._wait_for_room()
        spec, modes = read_optimizer(self.optimizer), tuple(m.training for m in self.model.modules())
        loss = StepLoss(self, None, self.step_count + 1)
        kept = KeptStep(number=loss.number, form=form, tensors=tuple(tensors), spec=spec, modes=modes, loss=loss)
        for attempt in range(MAX_ATTEMPTS + 1):
            try:
                with self._context._batched_release():
                    loss.array = self._dispatch_step(form, tensors, spec=spec, modes=modes)
                break
            except (ExecutorLostError, RemoteError) as exc:   # the state was lost: recover, then dispatch it
                if attempt == MAX_ATTEMPTS or not is_recoverable(exc) or not self.recover_from(exc):
                    raise
        self._recovery.keep(kept)
        self._unfinished_steps.append(loss.array._record.event)
        self._maybe_save()
        return loss

    def recover_from(self, error: BaseException, loss: StepLoss | None = None) -> bool:
        """Recover from ``error`` (a lost executor or a lost transfer: see `training.recovery`); False if recovery
        is off or the state is whole. Raises what makes it fail (no replacement within ``replacement_timeout_s``,
        no checkpoint)."""
        if not self.recover:
            return False
        if loss is not None and loss.array is not None and loss.array._record.error is not error:
            return True   # already re-run
        for _ in range(MAX_ATTEMPTS - 1):
            try:
                return self._recover_once(error)
            except (ExecutorLostError, RemoteError) as exc:   # another fault while recovering: recover from it
                if not is_recoverable(exc):
                    raise
                log.warning("trainer: recovery interrupted by %s; recovering again", exc)
                error = exc
        return self._recover_once(error)      # the last attempt: what fails it reaches the caller

    def _recover_once(self, error: BaseException) -> bool:
        from .sharded_checkpoint import read_sharded

        started = time.monotonic()
        ctx = self._context
        lost = [e for e in self.mesh.executor_ids if ctx.controller.resources.executors[e].lost]
        if not lost and not self._state_broken(error):
            return False   # the state is whole (recovered already): this step's loss cannot be run again
        cause = describe_cause(error, lost)
        log.warning("trainer: %s; recovering from %s", error, cause)
        if self._checkpoint is not None:
            # The save in flight ends first: it fails if it needed the lost executor, and must not ask the
            # replacement for shards it never held.
            self._checkpoint.exception()
            self._checkpoint = None
        for executor_id in lost:
            if ctx.controller.resources.executors[executor_id].lost:   # its node may have restarted it meanwhile
                try:
                    ctx.replace_executor(executor_id, timeout_s=self.replacement_timeout_s)
                except ExecutorLostError as exc:   # no replacement: trying again would only wait as long again
                    raise RecoveryFailed(f"recovery from {error}: {exc}", executor_id=executor_id) from exc
        if self._recovery.saved_path is None:
            raise PathwaysError(f"recovery from {error}: no checkpoint of this trainer was written yet (the first is "
                                f"written when the trainer is made, in the background; it failed or is not done)")
        tensors, meta = read_sharded(self._recovery.saved_path)
        restored = int(meta["step"])
        self._put_rank()
        self._put_state(tensors)
        self.step_count, self.samples_seen = restored, int(meta["samples_seen"])
        rerun = self._recovery.since(restored)
        recomputed = sum(1 for kept in rerun if kept.loss.array is not None and kept.loss.array.done()
                         and kept.loss.array._record.error is None)
        for kept in rerun:
            with ctx._batched_release():
                kept.loss.array = self._dispatch_step(kept.form, list(kept.tensors), spec=kept.spec,
                                                      modes=kept.modes)
            self._unfinished_steps.append(kept.loss.array._record.event)
            self._maybe_save()
        self._recovery.note(cause, restored, len(rerun), recomputed, started)
        return True

    def _state_broken(self, error: BaseException) -> bool:
        """Whether the state on the mesh is lost (a shard's holder was lost) or failed (a lost transfer made a step
        fail on one island: every later state there fails too, so the newest shows it once its steps end)."""
        placed = self._placed_arrays()
        if any(a._record.lost_holders for a in placed):
            return True
        if not isinstance(error, RemoteError):
            return False
        deadline = time.monotonic() + _STATE_WAIT_S      # the newest steps end (they fail at once after the fault)
        try:
            return any(is_recoverable(a.exception(timeout_s=max(0.0, deadline - time.monotonic()))) for a in placed)
        except TimeoutError:
            raise PathwaysError(f"recovery from {error}: the trainer's newest state did not end within "
                                f"{_STATE_WAIT_S:.0f} s (its steps still run); nothing was restored") from None

    def _placed_arrays(self) -> list:
        """Every array the trainer keeps on the mesh: its state and the shards' ranks."""
        return [*self._checkpoint_arrays(), self._rank]

    def stats(self) -> dict:
        """What recovery did: ``recoveries``, ``steps_rerun`` (dispatched again), ``steps_recomputed`` (of those, the
        ones that had completed: at most ``checkpoint_every`` per recovery), ``recovery_seconds``, ``kept_steps``
        (held to be run again), ``last_checkpoint_step`` and one line per recovery (``events``)."""
        return {"steps": self.step_count, "checkpoints_written": self.checkpoints_written,
                **self._recovery.stats()}

    def evaluate(self, batch):
        """The loss on ``batch`` (a replicated 0-d `pw.Array`, at once): forward and loss only, in eval mode,
        on the parameters where they live. Captured once per batch shape and form."""
        form, tensors = self._batch_tensors(batch)
        (loss,) = self._forward("loss", form, tensors)
        return loss

    def predict(self, batch):
        """The model's output on ``batch`` (in eval mode, no gradient), its tensors as `pw.Array` s sharded on
        dim 0 over the data axis, in the output's own structure (a tensor, a tuple, a ``transformers`` output)."""
        from torch.utils._pytree import tree_unflatten

        form, tensors = self._batch_tensors(batch)
        arrays = iter(self._forward("predict", form, tensors))
        spec, statics, is_tensor = self._output_specs[form.key]
        return tree_unflatten([next(arrays) if tensor else static for static, tensor in zip(statics, is_tensor)],
                              spec)

    def _forward(self, kind: str, form, tensors: list) -> list:
        function = self._forwards.get(kind)
        if function is None:
            out = Replicate() if kind == "loss" else {self.plan.axis: Shard(0)}
            forward = make_forward(self.model, self.loss_fn, self.layout, self.plan, self.num_shards, kind,
                                   self._batch_forms, self._output_specs)
            function = self._forwards[kind] = Function(forward, out=out, name=forward.__name__, mesh=self.mesh)
        try:
            return self._run_forward(function, form, tensors, kind)
        except ExecutorLostError as exc:   # the state lost a shard: recover (if on), then run it on the restored state
            if not self.recover_from(exc):
                raise
            return self._run_forward(function, form, tensors, kind)

    def _run_forward(self, function, form, tensors: list, kind: str) -> list:
        ctx = self._context
        with ctx._batched_release():
            fresh = ctx.put_many([(t, {self.plan.axis: Shard(0)}) for t in tensors], self.mesh)
            arrays = [*self._flats, *self._buffers, *self._frozen, self._rank, *fresh]
            try:
                outputs = function(*arrays, static_key=form.key)
            except CaptureError as exc:
                raise self._located(exc, "evaluate" if kind == "loss" else "predict") from exc.__cause__
            del arrays, fresh
        return list(outputs) if isinstance(outputs, tuple) else [outputs]

    def _wait_for_room(self) -> None:
        """Bounded run-ahead: at most ``max_inflight_steps`` steps unfinished; wait for the oldest past it."""
        limit = self._context.config.max_inflight_steps
        steps = self._unfinished_steps
        while steps and steps[0].is_set():
            steps.popleft()
        if len(steps) < limit:
            return
        start = time.time_ns()
        # Down to half the bound (as the controller does for calls): one wake-up per few steps. No flush of
        # pending frees here: they ride on the next step's messages, sent right after.
        while len(steps) > limit - max(1, limit // 2):
            steps.popleft().wait()       # set on success, failure, a lost executor or a closed context
        self._context._note_runahead_wait(start, limit, f"training step {self.step_count + 1}")

    def _dispatch_step(self, form, tensors: list, *, spec=None, modes=None):
        import torch

        # Hyper-parameters may change between steps (a step run again after a recovery passes its own).
        spec = spec if spec is not None else read_optimizer(self.optimizer)
        # What schedulers change (lr, momentum, betas, weight decay) rides in as values: no recompile.
        scalars = torch.tensor([self.step_count + 1, *spec.dynamic_values()], dtype=torch.float64)
        ctx, mesh, axis = self._context, self.mesh, self.plan.axis
        # The step's fresh inputs travel in one message per executor.
        fresh = ctx.put_many([(scalars, Replicate()), *[(t, {axis: Shard(0)}) for t in tensors]], mesh)
        arrays = [*self._flats, *self._states, *self._buffers, *self._frozen,
                  fresh[0], self._rank, *fresh[1:]]
        self._spec = spec
        try:
            # Train/eval modes are read while tracing (dropout, batch statistics): a change re-captures.
            modes = modes if modes is not None else tuple(m.training for m in self.model.modules())
            outputs = self._function(*arrays, static_key=(spec.static_key(), modes, form.key))
        except CaptureError as exc:
            raise self._located(exc) from exc.__cause__
        self._take_outputs(outputs)
        # The optimizer did step (on the executors): say so where lr_scheduler looks, or each scheduler warns
        # that it was stepped before its optimizer (and torch code reads this flag, not a method).
        self.optimizer._opt_called = True
        del arrays, fresh     # inside the batched release: the step's inputs are freed together
        self.step_count += 1
        self.samples_seen += int(tensors[0].shape[0])
        return outputs[0]

    def _take_outputs(self, outputs) -> None:
        num_buckets, num_states = len(self.layout.buckets), len(self.layout.state_names)
        self._flats = list(outputs[1:1 + num_buckets])
        self._states = list(outputs[1 + num_buckets:1 + num_buckets * (1 + num_states)])
        self._buffers = list(outputs[1 + num_buckets * (1 + num_states):])

    def _batch_tensors(self, batch) -> tuple:
        """The batch's form (kept for the step to rebuild it) and its tensor leaves, each checked to split."""
        form, tensors = split_batch(batch)
        self._batch_forms.setdefault(form.key, form)
        pieces, what = self._batch_pieces()
        for index, t in enumerate(tensors):
            if t.dim() == 0 or t.shape[0] % pieces:
                size = t.shape[0] if t.dim() else "a 0-d tensor"
                raise PlacementError(
                    f"trainer.step: batch tensor {index} has {size} rows, not divisible by {what}; use a batch "
                    f"size that is a multiple of {pieces} (or drop the last partial batch)")
        return form, tensors

    def _batch_pieces(self) -> tuple[int, str]:
        """How many equal pieces a batch is split into, and what they are (for the error)."""
        return self.num_shards, f"the {self.num_shards} shards of mesh axis {self.plan.axis!r}"

    def _located(self, exc: CaptureError, what: str = "the training step") -> CaptureError:
        where = user_frame_summary(exc, self.model)
        if where is None:
            return exc
        return CaptureError(f"{type(self.model).__name__}: {what} cannot be captured at {where}\n{exc}")

    def __repr__(self) -> str:
        return (f"<Trainer {type(self.model).__name__} {type(self.plan).__name__}({self.plan.axis!r}) on "
                f"{self.num_shards} shards, {len(self.layout.buckets)} buckets, step {self.step_count}>")
