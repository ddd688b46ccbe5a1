"""`TrainerCheckpoints`: the trainer's state as named host tensors, and its checkpoints of either kind.

``trainer.save`` writes one file from the client (`checkpoint`); ``trainer.save_sharded`` (and
``checkpoint_every``) has the executors write their shards (`sharded_checkpoint`); ``trainer.load`` reads
either, under any plan and mesh size. A mixin of `Trainer`: where the state lives and how it is laid out is
the plan's runner's (``runner.named_tensors``, ``checkpoint_arrays``, ``checkpoint_parts``, ``put_state``).

A sharded save asked while the state is not on the executors (under a pipeline the model is split when the
first batch shows its shapes: the step-0 checkpoint made with the trainer, or the one after `load`) is written
once it is there: at the next step's dispatch (or evaluation), of the state that step starts from.
"""

from __future__ import annotations

import concurrent.futures

from .checkpoint import check_matches, read_checkpoint, write_checkpoint
from .checkpoint_folders import DEFAULT_KEEP
from .recovery import is_recoverable

__all__ = ["TrainerCheckpoints"]


class TrainerCheckpoints:
    """`Trainer`'s half that reads its state out and writes and loads checkpoints."""

    # Checkpoints written by the executors (set in `TrainerRecovery._set_up_recovery`).
    checkpoint_dir: str | None = None
    checkpoint_every = 0
    checkpoint_keep = DEFAULT_KEEP
    checkpoints_written = 0
    _checkpoint = None
    _deferred_save: tuple | None = None   # (directory, update_latest, future): a save asked before the state was placed

    def save_sharded(self, directory: str, *, update_latest: bool = True) -> "concurrent.futures.Future":
        """Write a checkpoint **from the executors**, in the background (`sharded_checkpoint`): each writes the
        shards it holds to ``directory`` (storage every host sees), no tensor bytes through the client; the
        next steps are dispatched meanwhile. Returns a future of the bytes written, done once ``latest`` names
        this step (in a fresh folder: the future's ``step_dir``) and all but the ``checkpoint_keep`` newest
        checkpoints there are removed. One save at a time: a second waits for the first. Under a pipeline,
        before the first step (the state still on the client), it is written at the next step's dispatch. A client
        of a `pathways-controller`: ``directory`` is under its folder of the checkpoint root
        (`Context.checkpoint_path`)."""
        directory = self._context.checkpoint_path(directory)
        if not self.runner.state_on_executors:
            return self._defer_save(directory, update_latest)
        return self._start_sharded_save(directory, update_latest=update_latest)

    def _defer_save(self, directory: str, update_latest: bool) -> "concurrent.futures.Future":
        """The future of a save written once the state is on the executors (`_write_deferred_save`); it resolves
        then, and its ``step_dir`` is set then too. A later ask replaces an earlier one: there is one state."""
        future = self._deferred_save[2] if self._deferred_save is not None else concurrent.futures.Future()
        self._deferred_save = (directory, update_latest, future)
        return future

    def _write_deferred_save(self) -> None:
        """Start a save asked before the state was on the executors (the runner calls this once it is there,
        before the step that starts from it runs)."""
        if self._deferred_save is None:
            return
        directory, update_latest, future = self._deferred_save
        self._deferred_save = None
        try:
            started = self._start_sharded_save(directory, update_latest=update_latest)
        except BaseException as exc:
            future.set_exception(exc)
            raise
        future.step_dir = started.step_dir     # the folder it writes, as on every save's future
        started.add_done_callback(lambda done: _settle(future, done))

    def _start_sharded_save(self, directory: str, *, update_latest: bool) -> "concurrent.futures.Future":
        """`save_sharded` of the state on the executors now."""
        from .sharded_checkpoint import save_sharded

        if self._checkpoint is not None:
            error = self._checkpoint.exception()     # the previous save's failure is raised here ...
            if error is not None and not (self.recover and is_recoverable(error)):
                raise error                          # ... but one lost with an executor or a link is recovery's
        step = self.step_count
        self._checkpoint = save_sharded(self.runner, directory, self._checkpoint_meta(),
                                        update_latest=update_latest, keep=self.checkpoint_keep,
                                        on_written=lambda step_dir: self._count_checkpoint(step, step_dir))
        return self._checkpoint

    def _count_checkpoint(self, step: int, step_dir: str) -> None:
        # From the save's thread, before older folders go. Recovery restores exactly this folder (not whatever
        # `latest` names: another run's, or a load's).
        self.checkpoints_written += 1
        # Its steps are forgotten once it is what recovery restores: their losses must be on the client first
        # (held on an executor, a loss the loop never read went with it, and nothing could run its step again).
        if self._recovery is not None and self._recovery.losses_on_client(step):
            self._recovery.note_saved(step, step_dir)

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """The training state as ordinary host tensors: ``{"model": ..., "optimizer": ..., "step": int}``.

        ``model`` is keyed like ``model.state_dict()``; ``optimizer`` maps each trained
        parameter's name to its state tensors. Waits for the dispatched steps.
        """
        tensors = self._named_tensors()
        model = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
        optimizer: dict = {}
        for key, value in tensors.items():
            if key.startswith("optimizer/"):
                name, state = key.removeprefix("optimizer/").rsplit("/", 1)
                optimizer.setdefault(name, {})[state] = value
        return {"model": model, "optimizer": optimizer, "step": self.step_count}

    def _named_tensors(self) -> dict:
        return self.runner.named_tensors()

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

    def save(self, path: str, *, data_position: dict | None = None) -> str:
        """Write a checkpoint directory (safetensors + JSON, no pickle); returns the file written.

        Holds parameters, buffers, optimizer state, the step count, the dropout RNG
        seed, the client's torch RNG state and the data position (``samples_seen``,
        plus any integers given in ``data_position``). A client of a `pathways-controller` writes under its
        folder of the checkpoint root alone (`Context.checkpoint_path`).
        """
        import torch

        path = self._context.checkpoint_path(path)   # a service client's: under its folder of the checkpoint root
        tensors = self._named_tensors()
        tensors["rng/torch"] = torch.get_rng_state()
        return write_checkpoint(path, tensors, self._checkpoint_meta(data_position))

    def _checkpoint_meta(self, data_position: dict | None = None) -> dict:
        """What every checkpoint records beside the tensors (either kind: `save`, `save_sharded`)."""
        return {"step": self.step_count, "samples_seen": self.samples_seen, "seed": self.seed,
                "optimizer": self._spec.kind, "plan": type(self.plan).__name__,
                "data_position": dict(data_position or {})}

    def load(self, path: str) -> dict:
        """Restore a checkpoint written by `save` or `save_sharded` (under any plan and mesh size); returns its
        metadata. A client of a `pathways-controller` reads under its folder of the checkpoint root alone."""
        path = self._context.checkpoint_path(path)
        tensors, meta = read_checkpoint(path)
        check_matches(path, tensors, self._initial_tensors())
        if meta.get("optimizer") != self._spec.kind:
            raise ValueError(f"checkpoint {path}: saved with a {meta.get('optimizer')!r} optimizer, this trainer "
                             f"uses {self._spec.kind!r}")
        if self._checkpoint is not None:   # a save of the state being replaced: let it end first
            self._checkpoint.exception()
            self._checkpoint = None
        self.runner.put_state(tensors)
        self.step_count, self.samples_seen = int(meta["step"]), int(meta["samples_seen"])
        self.seed = int(meta["seed"])
        self.runner.recapture(self._spec, self.seed)     # the dropout seed may differ
        if "rng/torch" in tensors:
            import torch

            torch.set_rng_state(tensors["rng/torch"])
        if self.recover:   # what recovery restores is now the loaded state: written again, under checkpoint_dir
            self._recovery.kept.clear()
            self._recovery.forget_saved()
            self.save_sharded(self.checkpoint_dir)     # a fresh folder: never the one just read
        return meta


def _settle(future: concurrent.futures.Future, done: concurrent.futures.Future) -> None:
    error = done.exception()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(done.result())
