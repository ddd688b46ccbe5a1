"""The per-chunk functions a pipeline step is made of: forward, backward, tied gradients, update.

Each is a per-shard function over flat tensors, captured as a ``@pw.function`` on its
chunk's stage mesh (the executors of one pipe rank, along the data axis):

- ``forward(*flats, *constants, *batch leaves, *incoming) -> (*outgoing, [loss], *saved)``
- ``backward(*saved, [*flats], *output grads, [*accumulated]) -> (*incoming grads, *accumulated)``:
  the parameter gradients of one microbatch, added to those of the microbatches before it
  (the first microbatch's backward takes no accumulator: two captured versions);
- ``tied(*accumulated) -> flat``: the gradients of the parameters this chunk shares with
  another (a tied embedding and head), for the other chunk's update;
- ``update(*flats, *states, *accumulated, scalars, [*losses], [*tied]) -> (*flats, *states, [loss])``:
  the shared parameters' gradients summed across chunks, the data-parallel reduction
  inside the stage (one collective per bucket, the loss in the first), the optimizer step;
- with ``max_grad_norm``, the update in two: ``reduce`` (the same reductions, plus the squared norm of
  the chunk's gradients) and ``apply`` (every chunk's squared norm in, ``clip_grad_norm_``'s scaling, the
  optimizer step) — the global norm spans the stages, so the squared norms cross between them.
"""

from __future__ import annotations

import dataclasses

from ..training.buckets import Bucket, flatten, unflatten
from ..training.optimizers import DYNAMIC, OptimizerSpec, apply_update

__all__ = ["ChunkPlan", "make_forward", "make_backward", "make_tied", "make_update", "make_reduce", "make_apply",
           "make_eval_forward", "make_eval_loss"]


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """What a chunk's functions need to know: its graph pieces and its state's layout."""

    chunk: object                 # split.Chunk
    autograd: object              # autograd.ChunkAutograd
    buckets: tuple[Bucket, ...]
    num_states: int
    shared: tuple[str, ...]       # parameters also read by another chunk
    partners: tuple[tuple[int, tuple[str, ...]], ...]   # (other chunk, its shared names) to add in
    data: object                  # the DataParallel plan inside the stage
    num_shards: int
    tensor: object = None         # under tensor parallelism, the buckets' `TensorStep` (kinds, partial sums)

    @property
    def num_incoming_grads(self) -> int:
        ag, chunk = self.autograd, self.chunk
        first_incoming = chunk.num_inputs - len(chunk.incoming)
        return sum(1 for i in ag.differentiable if i >= first_incoming)

    @property
    def padded(self) -> list[int]:
        sharded = self.data.sharded_state
        return [b.padded_numel(self.num_shards) if sharded else b.numel for b in self.buckets]

    def params(self, flats) -> list:
        """The chunk's parameters, in its graph's input order, from its flat buckets (gathered if sharded)."""
        named = {}
        for bucket, flat in zip(self.buckets, flats):
            named.update(unflatten(bucket, self.data.gather(flat, bucket.numel, self.num_shards)))
        return [named[name] for name in self.chunk.params]


def make_forward(plan: ChunkPlan):
    num_buckets = len(plan.buckets)

    def forward(*tensors):
        params = plan.params(tensors[:num_buckets])
        return tuple(plan.autograd.forward(*params, *tensors[num_buckets:]))

    forward.__name__ = f"pipeline_forward[{plan.chunk.index}]"
    return forward


def make_backward(plan: ChunkPlan, accumulate: bool):
    import torch

    ag, chunk = plan.autograd, plan.chunk
    num_buckets, num_saved = len(plan.buckets), ag.num_saved
    takes_params = bool(ag.backward_params)
    first_incoming = chunk.num_inputs - len(chunk.incoming)

    def backward(*tensors):
        saved, rest = tensors[:num_saved], tensors[num_saved:]
        params = []
        if takes_params:
            params, rest = plan.params(rest[:num_buckets]), rest[num_buckets:]
        grad_outputs = list(rest[:len(rest) - num_buckets] if accumulate else rest)
        if ag.loss_seed is not None:   # d(mean over microbatches)/d(this microbatch's loss)
            value, dtype = ag.loss_seed
            grad_outputs.append(torch.full((), value, dtype=dtype))
        grads = dict(zip(ag.differentiable, ag.backward(*saved, *[params[i] for i in ag.backward_params],
                                                         *grad_outputs)))
        named = {}
        for index, name in enumerate(chunk.params):
            named[name] = grads[index] if index in grads else torch.zeros(_param_shape(plan, name))
        flats = [flatten(b, named, n) for b, n in zip(plan.buckets, plan.padded)]
        if accumulate:
            flats = [a + g for a, g in zip(rest[len(rest) - num_buckets:], flats)]
        incoming = [grads[i] for i in sorted(grads) if i >= first_incoming]
        return (*incoming, *flats)

    backward.__name__ = f"pipeline_backward{'_acc' if accumulate else ''}[{chunk.index}]"
    return backward


def _param_shape(plan: ChunkPlan, name: str):
    for bucket in plan.buckets:
        for slot in bucket.slots:
            if slot.name == name:
                return slot.shape
    raise KeyError(name)


def make_tied(plan: ChunkPlan):
    import torch

    def tied(*accumulated):
        named = {}
        for bucket, flat in zip(plan.buckets, accumulated):
            named.update(unflatten(bucket, flat))
        return torch.cat([named[name].reshape(-1) for name in plan.shared])

    tied.__name__ = f"pipeline_tied_grads[{plan.chunk.index}]"
    return tied


def make_update(plan: ChunkPlan, spec: OptimizerSpec, num_microbatches: int, num_groups: int, partner_slots: dict):
    """``partner_slots[c]``: (name, numel) of each value in chunk c's ``tied`` output, in order."""
    num_buckets, num_states = len(plan.buckets), plan.num_states
    has_loss = plan.chunk.has_loss

    def update(*tensors):
        it = iter(tensors)
        flats, states, grads, scalars = _state_grads_scalars(it, num_buckets, num_states)
        losses = [next(it) for _ in range(num_microbatches)] if has_loss else []
        grads, loss = _reduce(plan, grads, losses, [next(it) for _ in plan.partners], partner_slots)
        new_flats, new_states = _apply(plan, spec, num_groups, flats, states, grads, scalars)
        return (*new_flats, *new_states, *([loss] if has_loss else []))

    update.__name__ = f"pipeline_update[{plan.chunk.index}]"
    return update


def make_reduce(plan: ChunkPlan, num_microbatches: int, partner_slots: dict, owned: tuple[str, ...]):
    """With clipping, the update's first half: ``(*accumulated, [*losses], [*tied]) -> (*grads, sumsq, [loss])``;
    ``sumsq`` is the squared L2 norm of the reduced gradients of the parameters in ``owned`` (a shared
    parameter is counted by one chunk only), over the whole stage."""
    import torch

    num_buckets, has_loss = len(plan.buckets), plan.chunk.has_loss

    def reduce(*tensors):
        it = iter(tensors)
        grads = [next(it) for _ in range(num_buckets)]
        losses = [next(it) for _ in range(num_microbatches)] if has_loss else []
        grads, loss = _reduce(plan, grads, losses, [next(it) for _ in plan.partners], partner_slots)
        zero = torch.zeros((), dtype=torch.float64)
        if plan.data.sharded_state:   # this shard's slice of every bucket
            per_bucket = [(g.to(torch.float64) ** 2).sum() for g in grads]
        else:
            per_bucket = [sum(((t.to(torch.float64) ** 2).sum() for n, t in unflatten(bucket, flat).items()
                               if n in owned), zero) for bucket, flat in zip(plan.buckets, grads)]
        # Over the model axis (split buckets' slices summed, whole ones once), then over the stage's data axis.
        squares = plan.tensor.sum_squares(per_bucket) + zero if plan.tensor is not None else sum(per_bucket, zero)
        if plan.data.sharded_state:
            squares = plan.data.global_sum(squares, plan.num_shards)
        return (*grads, squares, *([loss] if has_loss else []))

    reduce.__name__ = f"pipeline_reduce[{plan.chunk.index}]"
    return reduce


def make_apply(plan: ChunkPlan, spec: OptimizerSpec, num_groups: int, num_chunks: int, max_norm: float):
    """With clipping, the update's second half: ``(*flats, *states, *grads, scalars, *sumsq of every chunk)
    -> (*flats, *states)``, the gradients scaled as ``clip_grad_norm_`` does over the whole model."""
    import torch

    num_buckets, num_states = len(plan.buckets), plan.num_states

    def apply(*tensors):
        it = iter(tensors)
        flats, states, grads, scalars = _state_grads_scalars(it, num_buckets, num_states)
        total = torch.stack([next(it) for _ in range(num_chunks)]).sum().sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grads = [g * coef.to(g.dtype) for g in grads]
        new_flats, new_states = _apply(plan, spec, num_groups, flats, states, grads, scalars)
        return (*new_flats, *new_states)

    apply.__name__ = f"pipeline_apply[{plan.chunk.index}]"
    return apply


def _state_grads_scalars(it, num_buckets: int, num_states: int) -> tuple:
    """The inputs an update starts with: flats, states (a tuple per bucket), gradients, the step's scalars."""
    flats = [next(it) for _ in range(num_buckets)]
    states = [tuple(next(it) for _ in range(num_states)) for _ in range(num_buckets)]
    grads = [next(it) for _ in range(num_buckets)]
    return flats, states, grads, next(it)


def _reduce(plan: ChunkPlan, grads: list, losses: list, partner_grads: list, partner_slots: dict):
    """Shared parameters' gradients summed across chunks, then the data-parallel mean (the loss rides along)."""
    import torch

    if partner_grads:
        grads = _add_partner_grads(plan, grads, partner_grads, partner_slots)
    if plan.tensor is not None:    # a sequence slice's gradients (its norms'), summed over the model axis
        grads = plan.tensor.complete(grads)
    loss = None
    if losses:
        loss = torch.stack(losses).mean()
        grads, loss = plan.data.reduce(grads, loss, plan.num_shards)
    elif plan.num_shards > 1:
        grads = [plan.data.reduce_gradient(g, plan.num_shards) for g in grads]
    return grads, loss


def _apply(plan: ChunkPlan, spec: OptimizerSpec, num_groups: int, flats, states, grads, scalars):
    step_number, hyper = scalars[0], scalars[1:].reshape(num_groups, len(DYNAMIC))
    new_flats, new_states = [], []
    for bucket, flat, grad, state in zip(plan.buckets, flats, grads, states):
        param, state = apply_update(spec, bucket.group, flat, grad, state, step_number, hyper[bucket.group])
        new_flats.append(param)
        new_states.extend(state)
    return new_flats, new_states


def _add_partner_grads(plan: ChunkPlan, grads: list, partner_grads: list, partner_slots: dict) -> list:
    """This chunk's gradients with the other chunks' gradients of the parameters they share added in."""
    named = {}
    for bucket, flat in zip(plan.buckets, grads):
        named.update(unflatten(bucket, flat))
    for (other, _), flat in zip(plan.partners, partner_grads):
        offset = 0
        for name, numel in partner_slots[other]:
            if name in named:
                named[name] = named[name] + flat.narrow(0, offset, numel).view(named[name].shape)
            offset += numel
    return [flatten(b, named, n) for b, n in zip(plan.buckets, plan.padded)]


def make_eval_forward(plan: ChunkPlan):
    """``(*flats, *constants, *batch leaves, *incoming) -> (*outgoing, [loss])``: the chunk's graph as traced
    in eval mode, no gradient, nothing saved (``trainer.evaluate``)."""
    import torch

    num_buckets = len(plan.buckets)

    def forward(*tensors):
        with torch.no_grad():
            return tuple(plan.chunk.graph_module(*plan.params(tensors[:num_buckets]), *tensors[num_buckets:]))

    forward.__name__ = f"pipeline_eval_forward[{plan.chunk.index}]"
    return forward


def make_eval_loss(data, num_shards: int):
    """The mean of the microbatches' losses over the global batch (replicated on the last stage)."""
    import torch

    from ..collectives import all_reduce

    def loss(*losses):
        mean = torch.stack(losses).mean()
        return all_reduce(mean, data.axis, "mean") if num_shards > 1 else mean

    loss.__name__ = "pipeline_eval_loss"
    return loss
