"""Data parallelism across islands: ``pw.DataParallel(("island", "data"))`` (or ``ShardedDataParallel``).

A step is one registered program over every island's mesh (its executors along the
``data`` axis):

1. ``grads`` on each island: forward and backward on the island's part of the batch,
   then each gradient bucket *reduce-scattered* over the island's ``data`` axis (gloo or
   NCCL, inside the island): executor d of every island holds slice d of its island's mean;
2. ``update`` on each island: the slices of the same rank d from every other island arrive
   as program transfers — executor to executor over ZeroMQ (through the shaped link when
   there is one), not a collective: two islands' gang orders cannot gate one operation —
   are added and averaged, all-gathered inside the island (``DataParallel``; a sharded
   plan keeps its slice), clipped by the global norm if asked, and applied. Buffers (a
   BatchNorm's running statistics) come from island 0's first shard, as DDP keeps rank 0's.

So per step each executor sends (I - 1) / I of its island's reduced gradient bytes / D
across the link, and every island holds the same parameters after the update. What is not
there yet: gradients leave per bucket *during* the backward (the exchange overlapping the
rest of the backward) — today the exchange starts when the island's backward has ended.
"""

from __future__ import annotations

import collections

from ..errors import PlacementError
from ..functions import Function
from ..islands import ISLAND_AXIS
from ..placement import Replicate, Shard
from ..programs import Program, as_tuple
from .buckets import flatten, unflatten
from .optimizers import DYNAMIC, apply_update, read_optimizer
from .plans import DataParallel, ShardedDataParallel
from .step import _from_first_shard, batch_form, gathered_params, loss_and_grads
from .trainer import Trainer

__all__ = ["CrossIslandTrainer", "make_island_grads", "make_island_update"]


def make_island_grads(model, loss_fn, layout, inner: DataParallel, num_shards: int, seed: int,
                      batch_forms: dict):
    """``(*flats, *buffers, *frozen, scalars, rank, *batch) -> (loss, *slices, *buffers)`` on one island."""
    from ..collectives import all_reduce, reduce_scatter

    buckets = layout.buckets

    def grads(*tensors, static_key=None):
        it = iter(tensors)
        flats = [next(it) for _ in buckets]
        buffers = {name: next(it) for name in layout.buffer_names}
        frozen = {name: next(it) for name in layout.frozen_names}
        scalars, rank = next(it), next(it)
        batch = list(it)
        form = batch_form(batch_forms, static_key[-1] if static_key else None, batch)
        params = gathered_params(buckets, flats, inner, num_shards)
        named, loss, new_buffers = loss_and_grads(model, loss_fn, params, buffers, frozen, form, batch,
                                                  (seed, scalars[0], rank), inner.axis, num_shards)
        slices = [flatten(b, named, b.padded_numel(num_shards)) for b in buckets]
        loss = loss.detach()
        if num_shards > 1:
            slices = [reduce_scatter(g, inner.axis, "mean", 0) for g in slices]
            loss = all_reduce(loss, inner.axis, "mean")
        buffers_out = _from_first_shard([new_buffers[n] for n in layout.buffer_names], inner, rank, num_shards)
        return (loss, *slices, *buffers_out)

    grads.__name__ = f"island_grads[{type(model).__name__}]"
    return grads


def make_island_update(spec, layout, inner: DataParallel, num_islands: int, num_shards: int,
                       max_grad_norm: float | None):
    """``(*flats, *states, scalars, *losses[I], *slices[I][buckets], *buffers of island 0)
    -> (loss, *flats, *states, *buffers)``: the islands' slices averaged, gathered, applied."""
    import torch

    from ..collectives import all_gather, all_reduce

    buckets, num_states = layout.buckets, len(layout.state_names)

    def update(*tensors):
        it = iter(tensors)
        flats = [next(it) for _ in buckets]
        states = [tuple(next(it) for _ in range(num_states)) for _ in buckets]
        scalars = next(it)
        losses = [next(it) for _ in range(num_islands)]
        by_island = [[next(it) for _ in buckets] for _ in range(num_islands)]
        buffers = list(it)
        grads = [sum(island[b] for island in by_island) / num_islands for b in range(len(buckets))]
        if not inner.sharded_state and num_shards > 1:
            grads = [all_gather(g, inner.axis, 0).narrow(0, 0, b.numel) for g, b in zip(grads, buckets)]
        if max_grad_norm is not None:
            squares = sum((g.to(torch.float64) ** 2).sum() for g in grads)
            if inner.sharded_state and num_shards > 1:
                squares = all_reduce(squares, inner.axis, "sum")
            coef = torch.clamp(max_grad_norm / (squares.sqrt() + 1e-6), max=1.0)
            grads = [g * coef.to(g.dtype) for g in grads]
        step_number, hyper = scalars[0], scalars[1:].reshape(layout.num_groups, len(DYNAMIC))
        new_flats, new_states = [], []
        for bucket, flat, grad, state in zip(buckets, flats, grads, states):
            param, state = apply_update(spec, bucket.group, flat, grad, state, step_number, hyper[bucket.group])
            new_flats.append(param)
            new_states.extend(state)
        return (torch.stack(losses).mean(), *new_flats, *new_states, *buffers)

    update.__name__ = "island_update"
    return update


class CrossIslandTrainer(Trainer):
    """Train under ``DataParallel(("island", axis))`` on a mesh ``{"island": I, axis: D}`` (see module doc)."""

    def __init__(self, context, model, *, optimizer, loss_fn, mesh, plan, max_grad_norm=None, seed=0):
        import torch

        from .buckets import make_buckets
        from .step import StepLayout

        axes = tuple(plan.axis)
        if len(axes) != 2 or axes[0] != ISLAND_AXIS or list(mesh.axes) != list(axes):
            raise PlacementError(f"{type(plan).__name__}({axes!r}): expected ({ISLAND_AXIS!r}, <data axis>) on a mesh "
                                 f"with exactly those axes in that order, got a mesh with {dict(mesh.axes)}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm: expected a positive number or None, got {max_grad_norm!r}")
        self._context, self.model, self.optimizer, self.loss_fn = context, model, optimizer, loss_fn
        self.mesh, self.plan, self.max_grad_norm, self.seed = mesh, plan, max_grad_norm, int(seed)
        self.inner = (ShardedDataParallel if plan.sharded_state else DataParallel)(axes[1])
        self.num_islands, self.num_shards = mesh.axes[ISLAND_AXIS], mesh.axes[axes[1]]
        self._spec = read_optimizer(optimizer)
        buckets, frozen = make_buckets(model, optimizer)
        self.layout = StepLayout(buckets=tuple(buckets), state_names=self._spec.state_names,
                                 buffer_names=tuple(n for n, _ in model.named_buffers()),
                                 frozen_names=tuple(frozen), num_groups=len(optimizer.param_groups))
        self.samples_seen, self.step_count = 0, self._optimizer_step_count()
        self._batch_forms: dict = {}
        self._unfinished_steps: collections.deque = collections.deque()
        self._islands = self._island_meshes()
        self._program = self._make_function()
        self._ranks = [context.put(torch.arange(self.num_shards, dtype=torch.int64) + i * self.num_shards, m,
                                   {self.inner.axis: Shard(0)}) for i, m in enumerate(self._islands)]
        self._put_state(self._initial_tensors())

    def _island_meshes(self) -> list:
        per = self.num_shards
        ids = self.mesh.executor_ids
        return [self._context.mesh({self.inner.axis: per}, executors=list(ids[i * per:(i + 1) * per]))
                for i in range(self.num_islands)]

    def _state_placement(self):
        return {self.inner.axis: Shard(0)} if self.inner.sharded_state else Replicate()

    def _make_function(self):
        """The step's two functions (captured on first use, once per island mesh); programs are made per batch."""
        layout, state = self.layout, self._state_placement()
        self._grads = Function(
            make_island_grads(self.model, self.loss_fn, layout, self.inner, self.num_shards, self.seed,
                              self._batch_forms),
            out=(Replicate(), *[{self.inner.axis: Shard(0)}] * len(layout.buckets),
                 *[Replicate()] * len(layout.buffer_names)), mesh=self._islands[0])
        self._update = Function(
            make_island_update(self._spec, layout, self.inner, self.num_islands, self.num_shards, self.max_grad_norm),
            out=(Replicate(), *[state] * (len(layout.buckets) * (1 + len(layout.state_names))),
                 *[Replicate()] * len(layout.buffer_names)), mesh=self._islands[0])
        self._programs: dict = {}
        return self._grads

    def _program_for(self, static_key, num_leaves: int) -> Program:
        """The step as one program for this kind of batch: grads on every island, then every island's update."""
        key = (static_key, num_leaves)
        program = self._programs.get(key)
        if program is not None:
            return program
        layout = self.layout
        nb, ns, nbuf, nfrozen = (len(layout.buckets), len(layout.state_names), len(layout.buffer_names),
                                 len(layout.frozen_names))
        per_island = nb * (1 + ns) + nbuf + nfrozen + 2 + num_leaves
        grads, update, islands = self._grads, self._update, self._islands

        def cross_island_step(*arrays):
            parts = [arrays[i * per_island:(i + 1) * per_island] for i in range(len(islands))]
            computed = []
            for mesh, part in zip(islands, parts):
                flats, rest = part[:nb], part[nb * (1 + ns):]       # buffers, frozen, scalars, rank, batch
                computed.append(as_tuple(grads.on(mesh)(*flats, *rest, static_key=static_key)))
            losses = [c[0] for c in computed]
            slices = [a for c in computed for a in c[1:1 + nb]]
            buffers0 = computed[0][1 + nb:]
            outputs = []
            for mesh, part in zip(islands, parts):
                scalars = part[nb * (1 + ns) + nbuf + nfrozen]
                outputs.extend(as_tuple(update.on(mesh)(*part[:nb * (1 + ns)], scalars, *losses, *slices,
                                                         *buffers0)))
            return tuple(outputs)

        program = self._programs[key] = Program(cross_island_step,
                                                name=f"cross_island_step[{type(self.model).__name__}]")
        return program

    # ------------------------------------------------------------ state

    def _put_state(self, tensors: dict) -> None:
        layout, placement = self.layout, self._state_placement()
        sharded = self.inner.sharded_state
        padded = [b.padded_numel(self.num_shards) if sharded else b.numel for b in layout.buckets]

        def bucket_flat(bucket, n, key):
            return flatten(bucket, {s.name: tensors[key(s.name)].to(bucket.dtype) for s in bucket.slots}, n)

        self._state = []
        for mesh in self._islands:
            items = [(bucket_flat(b, n, lambda s: f"model/{s}"), placement) for b, n in zip(layout.buckets, padded)]
            items += [(bucket_flat(b, n, lambda s, name=name: f"optimizer/{s}/{name}"), placement)
                      for b, n in zip(layout.buckets, padded) for name in layout.state_names]
            items += [(tensors[f"model/{n}"], Replicate()) for n in layout.buffer_names + layout.frozen_names]
            self._state.append(self._context.put_many(items, mesh))

    def _named_tensors(self) -> dict:
        layout, state = self.layout, self._state[0]   # every island holds the same state
        nb, ns = len(layout.buckets), len(layout.state_names)
        tensors = {}
        for bucket, flat in zip(layout.buckets, state[:nb]):
            tensors.update({f"model/{n}": t.clone() for n, t in unflatten(bucket, flat.result()).items()})
        states = iter(state[nb:nb * (1 + ns)])
        for bucket in layout.buckets:
            for name in layout.state_names:
                values = unflatten(bucket, next(states).result())
                tensors.update({f"optimizer/{n}/{name}": t.clone() for n, t in values.items()})
        rest = state[nb * (1 + ns):]
        for name, array in zip(layout.buffer_names + layout.frozen_names, rest):
            tensors[f"model/{name}"] = array.result()
        return tensors

    # ------------------------------------------------------------ stepping

    def _batch_pieces(self) -> tuple[int, str]:
        pieces = self.num_islands * self.num_shards
        return pieces, f"{self.num_islands} islands x {self.num_shards} data shards = {pieces}"

    def _dispatch_step(self, form, tensors: list):
        import torch

        from ..errors import CaptureError

        spec = read_optimizer(self.optimizer)
        if spec.static_key() != self._spec.static_key():   # the update's structure changed: capture it anew
            self._spec = spec
            self._make_function()
        self._spec = spec
        scalars = torch.tensor([self.step_count + 1, *spec.dynamic_values()], dtype=torch.float64)
        rows, axis = tensors[0].shape[0] // self.num_islands, self.inner.axis
        arrays = []
        for i, mesh in enumerate(self._islands):
            fresh = self._context.put_many([(scalars, Replicate()),
                                            *[(t[i * rows:(i + 1) * rows], {axis: Shard(0)}) for t in tensors]], mesh)
            arrays += [*self._state[i], fresh[0], self._ranks[i], *fresh[1:]]
        modes = tuple(m.training for m in self.model.modules())
        program = self._program_for((spec.static_key(), modes, form.key), len(tensors))
        try:
            outputs = program(*arrays)
        except CaptureError as exc:
            raise self._located(exc) from exc.__cause__
        self._take_island_outputs(outputs)
        self.optimizer._opt_called = True
        self.step_count += 1
        self.samples_seen += int(tensors[0].shape[0])
        return outputs[0]

    def _take_island_outputs(self, outputs) -> None:
        layout = self.layout
        nb, ns, nbuf = len(layout.buckets), len(layout.state_names), len(layout.buffer_names)
        width = 1 + nb * (1 + ns) + nbuf
        for i in range(self.num_islands):
            result = outputs[i * width:(i + 1) * width]
            frozen = self._state[i][nb * (1 + ns) + nbuf:]
            self._state[i] = [*result[1:], *frozen]

    def evaluate(self, batch):
        raise PlacementError("trainer.evaluate is not supported across islands yet; evaluate on the client from "
                             "trainer.state_dict(), or load a checkpoint into a trainer inside one island")

    predict = evaluate

    def __repr__(self) -> str:
        return (f"<CrossIslandTrainer {type(self.model).__name__} {type(self.plan).__name__}({self.plan.axis!r}) on "
                f"{self.num_islands} islands x {self.num_shards} shards, step {self.step_count}>")
