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

At most ``checkpoint_every`` steps are run again (more only if the checkpoint after them was still
being written when the executor was lost). Other arrays derived from the failed steps (a
``trainer.predict`` output, an ``evaluate`` loss) are not re-run: they fail with the loss.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
import weakref

from ..errors import COLLECTIVE_ABANDONED, TRANSFER_LOST, ExecutorLostError, RemoteError
from .checkpoint_folders import pin, unpin

__all__ = ["StepLoss", "KeptStep", "RecoveryLog", "RecoveryFailed", "MAX_ATTEMPTS", "is_recoverable",
           "TRANSFER_LOST", "COLLECTIVE_ABANDONED", "describe_cause"]

log = logging.getLogger(__name__)

# Losses in a row while recovering (a replacement lost too) before the error reaches the user.
MAX_ATTEMPTS = 3



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
            record = kept.loss.array._record
            if record.event.is_set() and is_recoverable(record.error):
                return record.error
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
