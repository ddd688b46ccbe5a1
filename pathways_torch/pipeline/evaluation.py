"""``trainer.evaluate`` under `pw.Pipeline`: the loss on a batch from the chunks' forwards only, in eval mode.

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
from ..training.optimizers import read_optimizer
from .split import split_model

__all__ = ["evaluate"]


@dataclasses.dataclass
class _EvalProgram:
    chunks: tuple
    program: Program
    rank_leaf: int = -1      # the model rank's batch leaf under tensor parallelism (`split.SplitModel`)


def evaluate(runner, batch):
    """The loss on ``batch`` under ``runner`` (a `PipelineRunner`): one program, microbatch after microbatch."""
    trainer = runner.trainer
    form, tensors = trainer._batch_tensors(batch)
    trainer._spec = read_optimizer(trainer.optimizer)
    train = runner._build(form, tensors)          # the state's layout (and its first put) come from it
    runner._place_state()
    program, rows = _eval_program(runner, form, tensors, train)
    microbatches, schedule = runner.plan.microbatches, runner._schedule
    per_mesh: dict[int, list] = collections.defaultdict(list)
    for m in range(microbatches):
        for chunk in program.chunks:
            r = schedule.rank_of(chunk.index)
            for leaf in chunk.batch_leaves:
                if leaf == program.rank_leaf:
                    per_mesh[r].append(runner.tensor.rank())
                    continue
                per_mesh[r].append((tensors[leaf][m * rows:(m + 1) * rows], {runner.data.axis: Shard(0)}))
    put = {r: iter(trainer._context.put_many(items, runner._stage_meshes[r])) for r, items in per_mesh.items()}
    batch_arrays = [next(put[schedule.rank_of(c.index)])
                    for _ in range(microbatches) for c in program.chunks for _ in c.batch_leaves]
    state = [a for flats, _, consts in runner._chunk_state for a in (*flats, *consts)]
    return program.program(*state, *batch_arrays)


def _eval_program(runner, form, tensors: list, train):
    """The evaluation program for this kind of batch (kept in ``runner._built``), and the rows of a microbatch."""
    import torch

    from ..training.evaluation import eval_mode
    from .chunk_functions import make_eval_forward, make_eval_loss

    trainer = runner.trainer
    rows = train.leaf_rows * runner.num_shards
    key = ("eval", form.key, tuple((tuple(t.shape), t.dtype) for t in tensors))
    known = runner._built.get(key)
    if known is not None:
        return known, rows
    examples = [torch.empty((train.leaf_rows, *t.shape[1:]), dtype=t.dtype, device="meta") for t in tensors]
    layout = runner.layout
    trained = [s.name for b in layout.buckets for s in b.slots]
    constants = list(layout.buffer_names) + list(layout.frozen_names)
    with eval_mode(trainer.model):
        try:
            split = split_model(trainer.model, trainer.loss_fn, form, examples, trained=trained, constants=constants,
                                num_chunks=runner._schedule.num_chunks, seed=trainer.seed, allow_buffer_reads=True,
                                tensor=runner.tensor)
        except CaptureError as exc:
            raise trainer._located(exc, "evaluate") from exc.__cause__
    if tuple(c.params for c in split.chunks) != runner._assignment:
        raise PlacementError("trainer.evaluate: the model in eval mode splits its parameters differently "
                             "from training; evaluate on the client from trainer.state_dict()")
    plans = [dataclasses.replace(p, chunk=c) for p, c in zip(train.plans, split.chunks)]
    functions = [Function(make_eval_forward(p), out=(Replicate(),) * (len(p.chunk.outgoing) + p.chunk.has_loss),
                          mesh=runner._mesh_of(p.chunk.index)) for p in plans]
    mean = Function(make_eval_loss(runner.data, runner.num_shards), out=Replicate(),
                    mesh=runner._mesh_of(plans[-1].chunk.index))
    num_microbatches = runner.plan.microbatches

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

    known = runner._built[key] = _EvalProgram(split.chunks, Program(
        pipeline_evaluate, name=f"pipeline_evaluate[{type(trainer.model).__name__}]"), split.rank_leaf)
    return known, rows
