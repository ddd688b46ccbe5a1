"""Automatic recovery of a training run from a lost executor (``ctx.wrap(..., checkpoint_every=K)``).

The trainer keeps what it needs to run again every step since the last checkpoint that was
written: the batch's host tensors, the optimizer's hyper-parameters of that step and the
modules' train/eval modes (a `KeptStep`). When a step fails with `ExecutorLostError` (its
dispatch, or the wait for its loss), `recover`:

1. has every lost executor of the mesh replaced (`Context.replace_executor`: a new incarnation
   in its place; the survivors keep their processes and compiled functions); a lost transfer
   replaces nothing (the link has reconnected: ZeroMQ reconnects by itself);
2. puts the last checkpoint's state back on the mesh (written by the executors: `latest`);
3. dispatches the kept steps again, in order, with their own step numbers (so dropout masks, which
   are keyed by the step, are the same) and their own hyper-parameters;
4. points each kept step's `StepLoss` at the re-run loss: the futures the user's loop already
   holds resolve to the re-run values, and the loop does not change.

A step is kept until a checkpoint after it is written *and* its loss is on the client (fetched by the save's
thread): a loss held only on the lost executor could not be fetched, nor its step run again.

At most ``checkpoint_every`` steps are run again (more only if the checkpoint after them was still
being written when the executor was lost). Other arrays derived from the failed steps (a
``trainer.predict`` output, an ``evaluate`` loss) are not re-run: they fail with the loss.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
import weakref

from ..errors import COLLECTIVE_ABANDONED, TRANSFER_LOST, ExecutorLostError, PathwaysError, RemoteError
from .checkpoint_folders import DEFAULT_KEEP, check_keep, pin, unpin

__all__ = ["StepLoss", "KeptStep", "RecoveryLog", "RecoveryFailed", "MAX_ATTEMPTS", "is_recoverable",
           "TRANSFER_LOST", "COLLECTIVE_ABANDONED", "describe_cause", "TrainerRecovery"]

log = logging.getLogger(__name__)

# Losses in a row while recovering (a replacement lost too) before the error reaches the user.
MAX_ATTEMPTS = 3
_STATE_WAIT_S = 600.0     # how long recovery waits for the newest state to end, to see whether it failed


class RecoveryFailed(ExecutorLostError):
    """Recovery itself failed for good (no replacement registered in time, or it exited at once): not tried
    again. An `ExecutorLostError`, as the loss it could not undo."""


def is_recoverable(error: BaseException | None) -> bool:
    """Whether recovery can undo ``error``: a lost executor, a transfer lost on a link (both ends alive), a
    collective abandoned after either."""
    if isinstance(error, RecoveryFailed):
        return False
    return isinstance(error, ExecutorLostError) or (isinstance(error, RemoteError) and error.remote_type in
                                                    (TRANSFER_LOST, COLLECTIVE_ABANDONED))


def describe_cause(error: BaseException, lost: list[str]) -> str:
    """What a recovery recovers from, for its log line and ``trainer.stats()["events"]``."""
    if lost:
        return f"the loss of {', '.join(lost)}"
    kind = getattr(error, "remote_type", "")
    if kind == TRANSFER_LOST:
        return "a transfer lost on a link"
    if kind == COLLECTIVE_ABANDONED:
        return "a collective abandoned after a fault in its island"
    return "the loss of an executor (replaced already)"


@dataclasses.dataclass(frozen=True)
class KeptStep:
    """What it takes to dispatch one training step again, exactly as it was."""

    number: int                # the step's number (1 for the first step)
    form: object               # its batch form (`batches.BatchForm`)
    tensors: tuple             # the batch's host tensors
    spec: object               # the optimizer's hyper-parameters then (`optimizers.OptimizerSpec`)
    modes: tuple               # every module's .training then
    loss: "StepLoss"


class StepLoss:
    """A training step's loss: a future like `pw.Array` (``result``, ``exception``, ``done``) that follows the step
    when it is run again after a recovery. ``array`` is the `pw.Array` it stands for now."""

    def __init__(self, trainer, array, number: int):
        self._trainer, self.array, self.number = trainer, array, number

    def result(self, timeout_s: float | None = None, *, timeout: float | None = None):
        return self._follow(lambda array: array.result(timeout_s, timeout=timeout))

    def exception(self, timeout_s: float | None = None, *, timeout: float | None = None):
        try:
            self._follow(lambda array: _raise(array.exception(timeout_s, timeout=timeout)))
        except TimeoutError:
            raise
        except BaseException as exc:   # noqa: BLE001 - the step's own failure (or recovery's), as a future reports it
            return exc
        return None

    def done(self) -> bool:
        return self.array.done()

    def _follow(self, wait):
        """``wait(array)``; if the array was lost with an executor or a link, recover (once per loss) and wait
        again."""
        for _ in range(MAX_ATTEMPTS + 1):
            array = self.array
            try:
                return wait(array)
            except (ExecutorLostError, RemoteError) as exc:
                if not is_recoverable(exc):
                    raise
                if array is not self.array or self._trainer.recover_from(exc, self):
                    # Re-run (by another future's wait, or now). The error stays on the failed array's record and
                    # in the controller's failures: its traceback's frames would keep this loss, the failed array
                    # and the re-run one's bytes alive for the rest of the run (the soak's leftover scalars).
                    exc.__traceback__ = None
                    continue
                raise
        raise ExecutorLostError(f"step {self.number}: failed again after {MAX_ATTEMPTS} recoveries")

    def __getattr__(self, name):   # shape, dtype, sharding ...: the array's
        return getattr(self.array, name)

    def __repr__(self) -> str:
        return f"StepLoss(step {self.number}, {self.array!r})"


def _unpin_all(paths: list) -> None:
    for path in paths:
        unpin(path)


def _raise(error):
    if error is not None:
        raise error


class RecoveryLog:
    """The kept steps and what recoveries did (``trainer.stats()``)."""

    def __init__(self):
        self.kept: collections.deque[KeptStep] = collections.deque()
        self.saved_step = -1          # the newest checkpoint known written (set from the save's thread)
        self.saved_path: str | None = None   # its step folder: what recovery restores
        # The pinned folders (saved_path's): a list the finalizer shares, so a dropped trainer unpins too.
        self._pinned: list[str] = []
        weakref.finalize(self, _unpin_all, self._pinned)
        self.recoveries = 0
        self.steps_rerun = 0           # steps dispatched again (their first run failed or was cut short)
        self.steps_recomputed = 0      # of those, the ones that had completed (at most K per recovery)
        self.seconds = 0.0
        self.events: list[str] = []

    def note_saved(self, step: int, step_dir: str) -> None:
        """Checkpoint ``step`` is written in ``step_dir`` (called from the save's thread, before older folders are
        removed): the newest becomes what recovery restores, pinned so no clean-up removes it meanwhile."""
        if step < self.saved_step:
            return
        pin(step_dir)
        previous, self.saved_step, self.saved_path = self.saved_path, step, step_dir
        self._pinned.append(step_dir)
        if previous is not None:
            self._pinned.remove(previous)
            unpin(previous)

    def losses_on_client(self, step: int) -> bool:
        """Fetch the loss of every kept step up to ``step`` (from the save's thread, once checkpoint ``step`` is
        written): True once all are on the client, False if one was lost with its executor or link (the
        checkpoint is then not what recovery restores: those steps stay kept, to run again from an older one)."""
        for kept in list(self.kept):
            if kept.number > step:
                break
            try:
                kept.loss.array.result(_STATE_WAIT_S)
            except (ExecutorLostError, RemoteError) as exc:
                if is_recoverable(exc):
                    return False
            except Exception:   # noqa: BLE001 - the step's own failure: kept on its array, its future raises it
                pass
        return True

    def forget_saved(self) -> None:
        """No checkpoint to restore any more (a load replaced the state)."""
        for step_dir in self._pinned:
            unpin(step_dir)
        self._pinned.clear()
        self.saved_step, self.saved_path = -1, None

    def keep(self, step: KeptStep) -> None:
        while self.kept and self.kept[0].number <= self.saved_step:
            self.kept.popleft()
        self.kept.append(step)

    def since(self, step: int) -> list[KeptStep]:
        return [k for k in self.kept if k.number > step]

    def failed(self) -> BaseException | None:
        """The recoverable error of a kept step that already failed with one (checked before each new step)."""
        for kept in reversed(self.kept):
            array = kept.loss.array
            if array.done() and is_recoverable(array.failure):
                return array.failure
        return None

    def note(self, cause: str, restored_step: int, rerun: int, recomputed: int, started: float) -> str:
        """Count a recovery from ``cause`` (what was lost): ``rerun`` steps dispatched again, of which
        ``recomputed`` had completed before."""
        self.recoveries += 1
        self.steps_rerun += rerun
        self.steps_recomputed += recomputed
        took = time.monotonic() - started
        self.seconds += took
        event = (f"recovered from {cause}: restored "
                 f"step {restored_step}, ran {rerun} step(s) again ({recomputed} of them had completed) in "
                 f"{took:.1f} s")
        self.events.append(event)
        log.warning("trainer: %s", event)
        return event

    def stats(self) -> dict:
        return {"recoveries": self.recoveries, "steps_rerun": self.steps_rerun,
                "steps_recomputed": self.steps_recomputed,
                "recovery_seconds": round(self.seconds, 3), "kept_steps": len(self.kept),
                "last_checkpoint_step": self.saved_step, "events": list(self.events)}


class TrainerRecovery:
    """`Trainer`'s half that keeps steps and recovers from a loss; the state goes back through its runner
    (``runner.restore``), whatever the plan."""

    recover = False            # recovery from a lost executor (set in `_set_up_recovery` with checkpoint_every)
    _recovery: RecoveryLog | None = None

    def _set_up_recovery(self, checkpoint_dir, checkpoint_every: int, recover, replacement_timeout_s: float, *,
                         checkpoint_keep: int = DEFAULT_KEEP) -> None:
        """Checkpoints written by the executors every ``checkpoint_every`` steps, and recovery from them; the
        ``checkpoint_keep`` newest kept (0: all; `checkpoint_folders`)."""
        self.checkpoint_keep = check_keep(checkpoint_keep)
        if checkpoint_every and not checkpoint_dir or checkpoint_every < 0:
            raise ValueError(f"checkpoint_every={checkpoint_every!r}: expected a number of steps >= 1 with "
                             f"checkpoint_dir (got checkpoint_dir={checkpoint_dir!r}), or 0 for none")
        if checkpoint_dir:   # a service client's lands under its folder of the checkpoint root, or is refused here
            checkpoint_dir = self._context.checkpoint_path(checkpoint_dir)
        self.checkpoint_dir, self.checkpoint_every = checkpoint_dir, int(checkpoint_every)
        self._checkpoint = None    # the save in flight (one at a time): a concurrent.futures.Future
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

    def _recover_from_failed_step(self) -> None:
        """Before a new step: recover from a kept step that already failed with a recoverable error (its loss not
        waited for yet), so the new step starts from a whole state."""
        error = self._recovery.failed()
        if error is not None:
            self.recover_from(error)

    def _after_recovery(self, run):
        """``run()``; if the state lost a shard meanwhile, recover (if on) and run it again on the restored
        state (evaluation and prediction: their results are not kept to follow a later recovery)."""
        try:
            return run()
        except ExecutorLostError as exc:
            if not self.recover_from(exc):
                raise
            return run()

    def recover_from(self, error: BaseException, loss: StepLoss | None = None) -> bool:
        """Recover from ``error`` (a lost executor or a lost transfer: see `training.recovery`); False if recovery
        is off or the state is whole. Raises what makes it fail (no replacement within ``replacement_timeout_s``,
        no checkpoint)."""
        if not self.recover:
            return False
        if loss is not None and loss.array is not None and loss.array.failure is not error:
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
        lost = [e for e in self.mesh.executor_ids if self._context.is_lost(e)]
        if not lost and not self._state_broken(error):
            return False   # the state is whole (recovered already): this step's loss cannot be run again
        cause = describe_cause(error, lost)
        log.warning("trainer: %s; recovering from %s", error, cause)
        if self._checkpoint is not None:
            # The save in flight ends first: it fails if it needed the lost executor, and must not ask the
            # replacement for shards it never held.
            self._checkpoint.exception()
            self._checkpoint = None
        self._replace(lost, error)
        if self._recovery.saved_path is None:
            raise PathwaysError(f"recovery from {error}: no checkpoint of this trainer was written yet (the first is "
                                f"written when the trainer is made, in the background; it failed or is not done)")
        tensors, meta = read_sharded(self._recovery.saved_path)
        restored = int(meta["step"])
        self.runner.restore(tensors)
        self.step_count, self.samples_seen = restored, int(meta["samples_seen"])
        rerun = self._recovery.since(restored)
        recomputed = sum(1 for kept in rerun if kept.loss.array is not None and kept.loss.array.done()
                         and kept.loss.array.failure is None)
        for kept in rerun:
            with self._context.batched_release():
                kept.loss.array = self._dispatch_step(kept.form, list(kept.tensors), spec=kept.spec,
                                                      modes=kept.modes)
            self._unfinished_steps.append(kept.loss.array.completion)
            self._maybe_save()
        self._recovery.note(cause, restored, len(rerun), recomputed, started)
        return True

    def _replace(self, lost: list, error: BaseException) -> None:
        """Have every lost executor of the mesh replaced (a new incarnation in its place)."""
        for executor_id in lost:
            if self._context.is_lost(executor_id):   # its node may have restarted it meanwhile
                try:
                    self._context.replace_executor(executor_id, timeout_s=self.replacement_timeout_s)
                except ExecutorLostError as exc:   # no replacement: trying again would only wait as long again
                    raise RecoveryFailed(f"recovery from {error}: {exc}", executor_id=executor_id) from exc

    def _state_broken(self, error: BaseException) -> bool:
        """Whether the state on the mesh is lost (a shard's holder was lost) or failed (a lost transfer made a step
        fail on one island: every later state there fails too, so the newest shows it once its steps end)."""
        placed = self.runner.placed_arrays()
        if any(a.lost_holders for a in placed):
            return True
        if not isinstance(error, RemoteError):
            return False
        deadline = time.monotonic() + _STATE_WAIT_S      # the newest steps end (they fail at once after the fault)
        try:
            return any(is_recoverable(a.exception(timeout_s=max(0.0, deadline - time.monotonic()))) for a in placed)
        except TimeoutError:
            raise PathwaysError(f"recovery from {error}: the trainer's newest state did not end within "
                                f"{_STATE_WAIT_S:.0f} s (its steps still run); nothing was restored") from None

    def stats(self) -> dict:
        """What recovery did: ``recoveries``, ``steps_rerun`` (dispatched again), ``steps_recomputed`` (of those, the
        ones that had completed: at most ``checkpoint_every`` per recovery), ``recovery_seconds``, ``kept_steps``
        (held to be run again), ``last_checkpoint_step`` and one line per recovery (``events``)."""
        return {"steps": self.step_count, "checkpoints_written": self.checkpoints_written,
                **self._recovery.stats()}
