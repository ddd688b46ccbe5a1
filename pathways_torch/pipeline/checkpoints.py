"""Checkpoints written by the executors under `pw.Pipeline`, and recovery from them (`PipelineCheckpoints`).

``ctx.wrap(..., plan=pw.Pipeline(...), checkpoint_dir=, checkpoint_every=K)`` works as under the other
plans (`training.sharded_checkpoint`, `training.recovery`): each stage's executors write their own
chunks' state — one `CheckpointPart` per chunk: its buckets and their optimizer state (each data shard
its slice under a sharded ``data`` plan), its buffers and frozen parameters — to one folder, whose index
rebuilds the same named tensors as every other checkpoint (``model/<name>``,
``optimizer/<param>/<state>``), so it loads into eager PyTorch and under any other plan. A lost
executor is replaced, every chunk's state is put back from the last checkpoint (the runner's
``restore``), and the kept steps run again (`recovery.TrainerRecovery.recover_from`).

Two things differ from a data-parallel trainer:

- The model is split when the first batch shows its shapes, so the state reaches the executors only
  at the first step. A save asked before that (the step-0 checkpoint made with the trainer, or the one
  after `trainer.load`) is written at the next step's dispatch, of the state that step starts from.
- A name no chunk holds (a buffer, or a parameter, the forward never reads) is put on the first stage
  as a replicated array of its own, so the checkpoint still holds every name of the model.
"""

from __future__ import annotations

import concurrent.futures

from ..placement import Replicate
from ..training.sharded_checkpoint import CheckpointPart

__all__ = ["PipelineCheckpoints"]


class PipelineCheckpoints:
    """`PipelineRunner`'s half that deals with executor-written checkpoints and the state they hold."""

    _deferred_save: tuple | None = None   # (directory, update_latest, future) of a save asked before the first put
    _loose: tuple | list = ()             # (checkpoint name, replicated array) of names no chunk holds

    def defer_save(self, directory: str, update_latest: bool) -> concurrent.futures.Future | None:
        """Before the first step (the state is still on the client, the model not yet split) a sharded save is
        written at the next step's dispatch: its future, which resolves then (its ``step_dir`` is set then
        too). None once the state is on the executors (the trainer saves now)."""
        if self._state_on_executors():
            return None
        future = self._deferred_save[2] if self._deferred_save is not None else concurrent.futures.Future()
        self._deferred_save = (directory, update_latest, future)   # a later ask replaces an earlier one: one state
        return future

    def _place_state(self) -> None:
        """Put the state on the chunks' meshes if it is still on the client (the split is known: a step is being
        dispatched), then write a save that was asked before."""
        if self._chunk_state is None:
            self.put_state(self._host_state)
        if self._deferred_save is None:
            return
        directory, update_latest, future = self._deferred_save
        self._deferred_save = None
        try:
            started = self.trainer._start_sharded_save(directory, update_latest=update_latest)
        except BaseException as exc:
            future.set_exception(exc)
            raise
        future.step_dir = started.step_dir     # the folder it writes, as on every save's future
        started.add_done_callback(lambda done: _settle(future, done))

    def _put_loose(self, tensors: dict, plans: list) -> None:
        """Put the named state no chunk holds on the first stage (replicated), for checkpoints to hold every name."""
        held = {f"model/{n}" for plan in plans for n in plan.chunk.constants}
        for plan in plans:
            for bucket in plan.buckets:
                for slot in bucket.slots:
                    held.add(f"model/{slot.name}")
                    held.update(f"optimizer/{slot.name}/{state}" for state in self.layout.state_names)
        names = [n for n in tensors if n not in held and n.startswith(("model/", "optimizer/"))]
        arrays = self.trainer._context.put_many([(tensors[n], Replicate()) for n in names], self._stage_meshes[0])
        self._loose = list(zip(names, arrays))

    def checkpoint_parts(self) -> list:
        """One `CheckpointPart` per chunk, written by its stage's executors, and one of the loose names."""
        sharded = self.data.sharded_state and self.num_shards > 1
        if self.tensor is not None:
            return self._model_shard_parts(sharded)
        parts = [CheckpointPart(buckets=plan.buckets, state_names=self.layout.state_names, flats=flats, states=states,
                                wholes=[(f"model/{n}", a) for n, a in zip(plan.chunk.constants, constants)],
                                holders=tuple(self._mesh_of(plan.chunk.index).executor_ids), sharded=sharded)
                 for plan, (flats, states, constants) in zip(self._train_plans(), self._chunk_state)]
        if self._loose:
            parts.append(CheckpointPart(buckets=(), state_names=self.layout.state_names, flats=[], states=[],
                                        wholes=list(self._loose), holders=tuple(self._stage_meshes[0].executor_ids),
                                        sharded=False))
        return parts

    def _model_shard_parts(self, sharded: bool) -> list:
        """Under tensor parallelism: one part per chunk and model shard (`tensor_parallel.checkpoint_parts`)."""
        from ..tensor_parallel.checkpoint_parts import model_shard_parts

        parts = []
        for plan, (flats, states, constants) in zip(self._train_plans(), self._chunk_state):
            wholes = [(f"model/{n}", a) for n, a in zip(plan.chunk.constants, constants)]
            parts += model_shard_parts(plan.buckets, plan.tensor.kinds, self.layout.state_names, flats, states,
                                       wholes, self._mesh_of(plan.chunk.index), self.tensor.plan, sharded)
        if self._loose:
            parts.append(CheckpointPart(buckets=(), state_names=self.layout.state_names, flats=[], states=[],
                                        wholes=list(self._loose), holders=tuple(self._stage_meshes[0].executor_ids),
                                        sharded=False))
        return parts

    def checkpoint_arrays(self) -> list:
        if self._chunk_state is None:
            return []
        return [*(a for flats, states, constants in self._chunk_state for a in (*flats, *states, *constants)),
                *(array for _, array in self._loose)]

    def placed_arrays(self) -> list:
        return self.checkpoint_arrays()     # no shard ranks: the dropout keys ride in with each batch


def _settle(future: concurrent.futures.Future, done: concurrent.futures.Future) -> None:
    error = done.exception()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(done.result())
