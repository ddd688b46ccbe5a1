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
  after `trainer.load`) is written at the next step's dispatch, of the state that step starts from: the
  trainer defers it while ``state_on_executors`` is False and writes it when `_place_state` calls ``placed``.
- A name no chunk holds (a buffer, or a parameter, the forward never reads) is put on the first stage
  as a replicated array of its own, so the checkpoint still holds every name of the model.
"""

from __future__ import annotations

from ..placement import Replicate
from ..training.sharded_checkpoint import CheckpointPart

__all__ = ["PipelineCheckpoints"]


class PipelineCheckpoints:
    """`PipelineRunner`'s part that deals with executor-written checkpoints and the state they hold."""

    _loose: tuple | list = ()             # (checkpoint name, replicated array) of names no chunk holds

    def _place_state(self, placed) -> None:
        """Put the state on the chunks' meshes if it is still on the client (the split is known: a step is being
        dispatched), then call ``placed()`` (the trainer writes a save it deferred until now)."""
        if self.chunk_state is None:
            self.put_state(self._host_state)
        placed()

    def _put_loose(self, tensors: dict, plans: list) -> None:
        """Put the named state no chunk holds on the first stage (replicated), for checkpoints to hold every name."""
        held = {f"model/{n}" for plan in plans for n in plan.chunk.constants}
        for plan in plans:
            for bucket in plan.buckets:
                for slot in bucket.slots:
                    held.add(f"model/{slot.name}")
                    held.update(f"optimizer/{slot.name}/{state}" for state in self.layout.state_names)
        names = [n for n in tensors if n not in held and n.startswith(("model/", "optimizer/"))]
        arrays = self.basis.context.put_many([(tensors[n], Replicate()) for n in names], self.stage_meshes[0])
        self._loose = list(zip(names, arrays))

    def checkpoint_parts(self) -> list:
        """One `CheckpointPart` per chunk, written by its stage's executors, and one of the loose names."""
        sharded = self.data.sharded_state and self.num_shards > 1
        if self.tensor is not None:
            return self._model_shard_parts(sharded)
        parts = [CheckpointPart(buckets=plan.buckets, state_names=self.layout.state_names, flats=flats, states=states,
                                wholes=[(f"model/{n}", a) for n, a in zip(plan.chunk.constants, constants)],
                                holders=tuple(self._mesh_of(plan.chunk.index).executor_ids), sharded=sharded)
                 for plan, (flats, states, constants) in zip(self.train_plans(), self.chunk_state)]
        if self._loose:
            parts.append(CheckpointPart(buckets=(), state_names=self.layout.state_names, flats=[], states=[],
                                        wholes=list(self._loose), holders=tuple(self.stage_meshes[0].executor_ids),
                                        sharded=False))
        return parts

    def _model_shard_parts(self, sharded: bool) -> list:
        """Under tensor parallelism: one part per chunk and model shard (`tensor_parallel.checkpoint_parts`)."""
        from ..tensor_parallel.checkpoint_parts import model_shard_parts

        parts = []
        for plan, (flats, states, constants) in zip(self.train_plans(), self.chunk_state):
            wholes = [(f"model/{n}", a) for n, a in zip(plan.chunk.constants, constants)]
            parts += model_shard_parts(plan.buckets, plan.tensor.kinds, self.layout.state_names, flats, states,
                                       wholes, self._mesh_of(plan.chunk.index), self.tensor.plan, sharded)
        if self._loose:
            parts.append(CheckpointPart(buckets=(), state_names=self.layout.state_names, flats=[], states=[],
                                        wholes=list(self._loose), holders=tuple(self.stage_meshes[0].executor_ids),
                                        sharded=False))
        return parts

    def checkpoint_arrays(self) -> list:
        if self.chunk_state is None:
            return []
        return [*(a for flats, states, constants in self.chunk_state for a in (*flats, *states, *constants)),
                *(array for _, array in self._loose)]

    def placed_arrays(self) -> list:
        return self.checkpoint_arrays()     # no shard ranks: the dropout keys ride in with each batch
