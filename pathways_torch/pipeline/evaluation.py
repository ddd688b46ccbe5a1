"""`PipelineTrainer.evaluate`: the loss on a batch from the chunks' forwards only, in eval mode.

The model is split again in eval mode (dropout off changes the graph), and must give each chunk
the parameters it has in training; the program runs microbatch after microbatch on the parameters
where they live, then one mean on the last stage.
"""

from __future__ import annotations

import collections
import dataclasses

from ..errors import CaptureError, ExecutorLostError, PlacementError
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


def evaluate(trainer, batch):
    """The loss on ``batch`` under ``trainer`` (a `PipelineTrainer`): see `PipelineTrainer.evaluate`."""
    try:
        return _run(trainer, batch)
    except ExecutorLostError as exc:   # the state lost a shard: recover (if on), then run on the restored state
        if not trainer.recover_from(exc):
            raise
        return _run(trainer, batch)


def _run(trainer, batch):
    form, tensors = trainer._batch_tensors(batch)
    trainer._spec = read_optimizer(trainer.optimizer)
    train = trainer._build(form, tensors)          # the state's layout (and its first put) come from it
    trainer._place_state()
    program, rows = _eval_program(trainer, form, tensors, train)
    microbatches, schedule = trainer.plan.microbatches, trainer._schedule
    per_mesh: dict[int, list] = collections.defaultdict(list)
    for m in range(microbatches):
        for chunk in program.chunks:
            r = schedule.rank_of(chunk.index)
            for leaf in chunk.batch_leaves:
                per_mesh[r].append((tensors[leaf][m * rows:(m + 1) * rows], {trainer.data.axis: Shard(0)}))
    put = {r: iter(trainer._context.put_many(items, trainer._stage_meshes[r])) for r, items in per_mesh.items()}
    batch_arrays = [next(put[schedule.rank_of(c.index)])
                    for _ in range(microbatches) for c in program.chunks for _ in c.batch_leaves]
    state = [a for flats, _, consts in trainer._chunk_state for a in (*flats, *consts)]
    return program.program(*state, *batch_arrays)


def _eval_program(trainer, form, tensors: list, train):
    """The evaluation program for this kind of batch (kept in ``trainer._built``), and the rows of a microbatch."""
    import torch

    from ..training.evaluation import eval_mode
    from .chunk_functions import make_eval_forward, make_eval_loss

    rows = train.leaf_rows * trainer.num_shards
    key = ("eval", form.key, tuple((tuple(t.shape), t.dtype) for t in tensors))
    known = trainer._built.get(key)
    if known is not None:
        return known, rows
    examples = [torch.empty((train.leaf_rows, *t.shape[1:]), dtype=t.dtype, device="meta") for t in tensors]
    layout = trainer.layout
    trained = [s.name for b in layout.buckets for s in b.slots]
    constants = list(layout.buffer_names) + list(layout.frozen_names)
    with eval_mode(trainer.model):
        try:
            split = split_model(trainer.model, trainer.loss_fn, form, examples, trained=trained, constants=constants,
                                num_chunks=trainer._schedule.num_chunks, seed=trainer.seed, allow_buffer_reads=True)
        except CaptureError as exc:
            raise trainer._located(exc, "evaluate") from exc.__cause__
    if tuple(c.params for c in split.chunks) != trainer._assignment:
        raise PlacementError("trainer.evaluate: the model in eval mode splits its parameters differently "
                             "from training; evaluate on the client from trainer.state_dict()")
    plans = [dataclasses.replace(p, chunk=c) for p, c in zip(train.plans, split.chunks)]
    functions = [Function(make_eval_forward(p), out=(Replicate(),) * (len(p.chunk.outgoing) + p.chunk.has_loss),
                          mesh=trainer._mesh_of(p.chunk.index)) for p in plans]
    mean = Function(make_eval_loss(trainer.data, trainer.num_shards), out=Replicate(),
                    mesh=trainer._mesh_of(plans[-1].chunk.index))
    num_microbatches = trainer.plan.microbatches

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

    known = trainer._built[key] = _EvalProgram(split.chunks, Program(
        pipeline_evaluate, name=f"pipeline_evaluate[{type(trainer.model).__name__}]"))
    return known, rows
