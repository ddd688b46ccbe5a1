"""The captured training step: forward + loss + backward + gradient reduction + clipping + update.

`make_step` returns a per-shard function over flat tensors, run as one
``@pw.function`` on the mesh. Its inputs, in order:

    flat parameter buffers (one per bucket) · optimizer state (per bucket, per state name)
    · module buffers · frozen parameters · scalars = float64[1 + groups x 5] (step number, then
    each group's `DYNAMIC` hyper-parameters: lr, momentum, beta1, beta2, weight decay) · rank = int64[1] (this shard's index on the data axis)
    · under tensor parallelism, the model rank = int64[1] (its index on the model axis) · the batch tensors

and its outputs: the mean loss over the global batch, then the new parameter
buffers, optimizer state and module buffers in the same order. The step number
and learning rates are tensors so that a schedule changes them without a new
capture; every other hyper-parameter is a graph constant (changing one captures
a new version).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

from .batches import forward_loss, split_batch
from .buckets import Bucket, flatten, make_buckets, unflatten
from .optimizers import DYNAMIC, OptimizerSpec, apply_update
from .random import counter_rng
from .sync_batchnorm import global_batch_norm

__all__ = ["StepLayout", "make_layout", "make_step", "loss_and_grads", "gathered_params", "batch_form"]


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """The order and meaning of the step's tensors."""

    buckets: tuple[Bucket, ...]
    state_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    frozen_names: tuple[str, ...]
    num_groups: int

    @property
    def num_state_inputs(self) -> int:
        return len(self.buckets) * (1 + len(self.state_names)) + len(self.buffer_names)

    def split_state(self, arrays: list) -> tuple[list, list, list, list]:
        """``arrays`` in state order (flats, optimizer states bucket-major, buffers, frozen parameters) as those
        four lists."""
        nb, ns, nbuf = len(self.buckets), len(self.state_names), len(self.buffer_names)
        states_end = nb * (1 + ns)
        return (list(arrays[:nb]), list(arrays[nb:states_end]), list(arrays[states_end:states_end + nbuf]),
                list(arrays[states_end + nbuf:]))

    @staticmethod
    def placer(padded: list, placement):
        """How `state_items` lays a bucket's flat on the mesh by default: flattened, padded to ``padded[index]``
        elements, under ``placement``."""
        return lambda index, bucket, named: (flatten(bucket, named, padded[index]), placement)

    def state_items(self, tensors: dict, place) -> list:
        """``(host tensor, placement)`` of the named state ``tensors`` in state order: each bucket's parameters,
        then their optimizer state (bucket-major), each as ``place(bucket index, bucket, its named tensors)``
        lays them (`placer`); buffers and frozen parameters replicated."""
        from ..placement import Replicate

        def named(bucket, key):
            return {s.name: tensors[key(s.name)].to(bucket.dtype) for s in bucket.slots}

        items = [place(i, b, named(b, lambda s: f"model/{s}")) for i, b in enumerate(self.buckets)]
        items += [place(i, b, named(b, lambda s, name=name: f"optimizer/{s}/{name}"))
                  for i, b in enumerate(self.buckets) for name in self.state_names]
        items += [(tensors[f"model/{n}"], Replicate()) for n in self.buffer_names + self.frozen_names]
        return items

    def named_tensors(self, arrays: list, unflat=None) -> dict:
        """The state held in ``arrays`` (state order) as named host tensors (``model/<name>``,
        ``optimizer/<param>/<state>``); waits for them. ``unflat(bucket index, bucket, array)``: one flat's
        named tensors, copied out (default: the array's value, unflattened)."""
        if unflat is None:
            def unflat(index, bucket, array):
                return {n: t.clone() for n, t in unflatten(bucket, array.result()).items()}
        tensors = {}
        flats, states, buffers, frozen = self.split_state(arrays)
        for index, (bucket, flat) in enumerate(zip(self.buckets, flats)):
            tensors.update({f"model/{n}": t for n, t in unflat(index, bucket, flat).items()})
        states = iter(states)   # bucket-major
        for index, bucket in enumerate(self.buckets):
            for name in self.state_names:
                values = unflat(index, bucket, next(states))
                tensors.update({f"optimizer/{n}/{name}": t for n, t in values.items()})
        for name, array in zip(self.buffer_names + self.frozen_names, [*buffers, *frozen]):
            tensors[f"model/{name}"] = array.result()
        return tensors

    def describe(self) -> str:
        lines = [f"bucket {i}: {b.describe()}" for i, b in enumerate(self.buckets)]
        lines.append(f"optimizer state per bucket: {list(self.state_names)}")
        lines.append(f"buffers: {list(self.buffer_names)}; frozen: {list(self.frozen_names)}")
        return "\n".join(lines)


def make_layout(model, optimizer, spec: OptimizerSpec, regroup: Callable | None = None) -> StepLayout:
    """The layout of ``model``'s training state under ``optimizer``: DDP's buckets (``regroup``: cut again,
    as the exchange across islands does), the optimizer's state names, buffers and frozen parameters."""
    buckets, frozen = make_buckets(model, optimizer)
    if regroup is not None:
        buckets = regroup(buckets)
    return StepLayout(buckets=tuple(buckets), state_names=spec.state_names,
                      buffer_names=tuple(n for n, _ in model.named_buffers()),
                      frozen_names=tuple(frozen), num_groups=len(optimizer.param_groups))


def make_step(model, loss_fn: Callable | None, spec: OptimizerSpec, layout: StepLayout, plan, num_shards: int,
              seed: int, max_grad_norm: float | None, batch_forms: dict | None = None,
              mark_forward_end: bool = False, tensor=None) -> Callable:
    """The per-shard step function (to be captured); see the module docstring for its signature.
    ``mark_forward_end``: the trace marks where the forward ends (for `unit_schedule.UnitSchedule`).
    ``tensor``: a `tensor_parallel.TensorStep` (layers split over a model axis): one more input after the
    rank, this shard's index on that axis; the forward runs lowered, and its partial gradients are summed."""
    buckets, num_states = layout.buckets, len(layout.state_names)

    batch_forms = batch_forms if batch_forms is not None else {}

    def step(*tensors, static_key=None):   # static_key: hyper-parameters and the batch form, in the signature
        it = iter(tensors)
        flats = [next(it) for _ in buckets]
        states = [tuple(next(it) for _ in range(num_states)) for _ in buckets]
        buffers = {name: next(it) for name in layout.buffer_names}
        frozen = {name: next(it) for name in layout.frozen_names}
        scalars, rank = next(it), next(it)
        model_rank = next(it) if tensor is not None else None
        batch = list(it)
        form = batch_form(batch_forms, static_key[-1] if static_key else None, batch)
        step_number, hyper = scalars[0], scalars[1:].reshape(layout.num_groups, len(DYNAMIC))
        params = gathered_params(buckets, flats, plan, num_shards)
        with tensor.lowered(model, model_rank) if tensor is not None else contextlib.nullcontext():
            grads, loss, new_buffers = loss_and_grads(model, loss_fn, params, buffers, frozen, form, batch,
                                                      (seed, step_number, rank), plan.axis, num_shards,
                                                      mark_forward_end=mark_forward_end)
        padded = [b.padded_numel(num_shards) if plan.sharded_state else b.numel for b in buckets]
        grad_flats = [flatten(b, grads, n) for b, n in zip(buckets, padded)]
        if tensor is not None:
            grad_flats = tensor.complete(grad_flats)
        grad_flats, loss = plan.reduce(grad_flats, loss.detach(), num_shards)
        if max_grad_norm is not None:
            grad_flats = _clip(grad_flats, max_grad_norm, plan, num_shards, tensor)
        new_flats, new_states = [], []
        for bucket, flat, grad, state in zip(buckets, flats, grad_flats, states):
            # In place: the step's state inputs are donated (DataParallelRunner), so executors free no copy.
            new_param, new_state = apply_update(spec, bucket.group, flat, grad, state, step_number,
                                                hyper[bucket.group], in_place=True)
            new_flats.append(new_param)
            new_states.extend(new_state)
        # Buffers a forward updated from its own shard of the batch (BatchNorm's running statistics) follow
        # DDP's default: shard 0's values, broadcast, so that every shard holds the same state.
        buffers_out = _from_first_shard([new_buffers[name] for name in layout.buffer_names], plan, rank, num_shards)
        return (loss, *new_flats, *new_states, *buffers_out)

    step.__name__ = f"train_step[{type(model).__name__}]"
    return step


def loss_and_grads(model, loss_fn, params: dict, buffers: dict, frozen: dict, form, batch: list, rng: tuple,
                   axis: str, num_shards: int, mark_forward_end: bool = False) -> tuple:
    """(gradients by name, loss, new buffers) of one shard's batch; ``rng`` = (seed, step, rank) keys dropout."""
    from torch.func import functional_call, grad_and_value

    def loss_of(params, buffers):
        # Buffers are inputs of the transformed function so that in-place updates
        # (e.g. running statistics) are allowed; they act on copies and come back as aux.
        buffers = {name: b.clone() for name, b in buffers.items()}
        with counter_rng(*rng), global_batch_norm(model, axis, num_shards):
            loss = forward_loss(functional_call, model, loss_fn, {**params, **frozen, **buffers}, form, batch)
        if mark_forward_end:
            from .unit_schedule import forward_end   # registers a torch op: imported only where torch is

            forward_end()
        return loss, buffers

    grads, (loss, new_buffers) = grad_and_value(loss_of, has_aux=True)(params, buffers)
    return grads, loss, new_buffers


def batch_form(batch_forms: dict, key: str | None, batch: list):
    """The form the trainer recorded under ``key``; a tuple of tensors ``(*inputs, target)`` without one."""
    form = batch_forms.get(key) if key else None
    return form if form is not None else split_batch(tuple(batch))[0]


def gathered_params(buckets, flats: list, plan, num_shards: int) -> dict:
    """Every trained parameter by name, from the flat buckets (gathered first under a sharded plan)."""
    params = {}
    for bucket, flat in zip(buckets, flats):
        params.update(unflatten(bucket, plan.gather(flat, bucket.numel, num_shards)))
    return params


def _from_first_shard(buffers: list, plan, rank, num_shards: int) -> list:
    """Shard 0's buffers on every shard: one collective per dtype (the buffers of a dtype flattened together)."""
    import torch

    if num_shards == 1 or not buffers:
        return buffers
    out = list(buffers)
    for dtype in {b.dtype for b in buffers}:
        positions = [i for i, b in enumerate(buffers) if b.dtype == dtype]
        flat = plan.from_first_shard(torch.cat([buffers[i].reshape(-1) for i in positions]), rank, num_shards)
        offset = 0
        for i in positions:
            numel = buffers[i].numel()
            out[i] = flat[offset:offset + numel].reshape(buffers[i].shape)
            offset += numel
    return out


def _clip(grad_flats: list, max_norm: float, plan, num_shards: int, tensor=None) -> list:
    """Scale every gradient by min(1, max_norm / (global L2 norm + 1e-6)), as clip_grad_norm_ does."""
    import torch

    squares = [(g.to(torch.float64) ** 2).sum() for g in grad_flats]
    local = tensor.sum_squares(squares) if tensor is not None else sum(squares)
    total = plan.global_sum(local, num_shards).sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return [g * coef.to(g.dtype) for g in grad_flats]
