"""``trainer.evaluate`` under `pw.Pipeline` (`PipelineEvaluation`, a part of `PipelineRunner`): the loss on a batch
from the chunks' forwards only, in eval mode.

The model is split again in eval mode (dropout off changes the graph), and must give each chunk
the parameters it has in training; the program runs microbatch after microbatch on the parameters
where they live, then one mean on the last stage.
"""

from __future__ import annotations

import collections
import dataclasses

from ..errors import CaptureError, PlacementError
from ..functions import Function
from ..placement import Replicate, Shard
from ..programs import Program, as_tuple
from ..training.locate import located
from ..training.optimizers import read_optimizer
from .split import split_model

__all__ = ["PipelineEvaluation"]


@dataclasses.dataclass
class _EvalProgram:
    chunks: tuple
    program: Program
    rank_leaf: int = -1      # the model rank's batch leaf under tensor parallelism (`split.SplitModel`)


class PipelineEvaluation:
    """`PipelineRunner`'s part that evaluates: one program per call, microbatch after microbatch."""

    def evaluate(self, form, tensors: list, *, placed):
        """The chunks' forwards only, in eval mode, microbatch after microbatch, on the parameters where they live
        (one program per call); ``placed`` as ``dispatch`` takes it (a first call puts the state)."""
        # The state's layout (and its first put) come from the training step's split, for the current optimizer.
        train = self._build(form, tensors, read_optimizer(self.basis.optimizer))
        self._place_state(placed)
        program, rows = self._eval_program(form, tensors, train)
        microbatches, schedule = self.plan.microbatches, self._schedule
        per_mesh: dict[int, list] = collections.defaultdict(list)
        for m in range(microbatches):
            for chunk in program.chunks:
                r = schedule.rank_of(chunk.index)
                for leaf in chunk.batch_leaves:
                    if leaf == program.rank_leaf:
                        per_mesh[r].append(self.tensor.rank())
                        continue
                    per_mesh[r].append((tensors[leaf][m * rows:(m + 1) * rows], {self.data.axis: Shard(0)}))
        put = {r: iter(self.basis.context.put_many(items, self.stage_meshes[r])) for r, items in per_mesh.items()}
        batch_arrays = [next(put[schedule.rank_of(c.index)])
                        for _ in range(microbatches) for c in program.chunks for _ in c.batch_leaves]
        state = [a for flats, _, consts in self.chunk_state for a in (*flats, *consts)]
        return program.program(*state, *batch_arrays)

    def _eval_program(self, form, tensors: list, train):
        """The evaluation program for this kind of batch (kept in ``_built``), and the rows of a microbatch."""
        import torch

        from ..training.evaluation import eval_mode
        from .chunk_functions import make_eval_forward, make_eval_loss

        b = self.basis
        rows = train.leaf_rows * self.num_shards
        key = ("eval", form.key, tuple((tuple(t.shape), t.dtype) for t in tensors))
        known = self._built.get(key)
        if known is not None:
            return known, rows
        examples = [torch.empty((train.leaf_rows, *t.shape[1:]), dtype=t.dtype, device="meta") for t in tensors]
        layout = self.layout
        trained = [s.name for bucket in layout.buckets for s in bucket.slots]
        constants = list(layout.buffer_names) + list(layout.frozen_names)
        with eval_mode(b.model):
            try:
                split = split_model(b.model, b.loss_fn, form, examples, trained=trained, constants=constants,
                                    num_chunks=self._schedule.num_chunks, seed=b.seed, allow_buffer_reads=True,
                                    tensor=self.tensor)
            except CaptureError as exc:
                raise located(exc, b.model, "evaluate") from exc.__cause__
        if tuple(c.params for c in split.chunks) != self._assignment:
            raise PlacementError("trainer.evaluate: the model in eval mode splits its parameters differently "
                                 "from training; evaluate on the client from trainer.state_dict()")
        plans = [dataclasses.replace(p, chunk=c) for p, c in zip(train.plans, split.chunks)]
        functions = [Function(make_eval_forward(p), out=(Replicate(),) * (len(p.chunk.outgoing) + p.chunk.has_loss),
                              mesh=self._mesh_of(p.chunk.index)) for p in plans]
        mean = Function(make_eval_loss(self.data, self.num_shards), out=Replicate(),
                        mesh=self._mesh_of(plans[-1].chunk.index))
        num_microbatches = self.plan.microbatches

        def pipeline_evaluate(*arrays):
            it = iter(arrays)
            flats, consts = [], []
            for plan in plans:
                flats.append([next(it) for _ in plan.buckets])
                consts.append([next(it) for _ in plan.chunk.constants])
            losses = []
            for m_batch in [[[next(it) for _ in p.chunk.batch_leaves] for p in plans] for _ in range(num_microbatches)]:
                incoming = []
                for plan, fn, leaves in zip(plans, functions, m_batch):
                    c = plan.chunk.index
                    outputs = as_tuple(fn(*flats[c], *consts[c], *leaves, *incoming))
                    incoming = list(outputs[:len(plan.chunk.outgoing)])
                losses.append(outputs[-1])
            return mean(*losses)

        known = self._built[key] = _EvalProgram(split.chunks, Program(
            pipeline_evaluate, name=f"pipeline_evaluate[{type(b.model).__name__}]"), split.rank_leaf)
        return known, rows
