"""Data parallelism across islands: ``pw.DataParallel(("island", "data"))`` (or ``ShardedDataParallel``).

`CrossIslandRunner` is that plan's `runner.StepRunner`.

A step is one registered program over every island's mesh (its executors along the
``data`` axis):

1. the gradient *segments* on each island: the step's forward and backward cut per gradient
   bucket (`bucket_cut`: segment 0 the forward, the loss and the backward of the last layers,
   each later one the backward of earlier layers), each bucket *reduce-scattered* over the
   island's ``data`` axis (gloo or NCCL, inside the island) at the end of the segment that
   completes it: executor d of every island holds slice d of its island's mean;
2. each slice goes, as soon as its segment has ended, to the same-rank executors of the other
   islands as a program transfer — executor to executor over ZeroMQ (through the shaped link
   when there is one), not a collective: two islands' gang orders cannot gate one operation —
   while the island's next segments run, so the exchange overlaps the rest of the backward;
3. ``update`` on each island: the slices are added and averaged, all-gathered inside the island
   (``DataParallel``; a sharded plan keeps its slice), clipped by the global norm if asked, and
   applied. Buffers (a BatchNorm's running statistics) come from island 0's first shard, as DDP
   keeps rank 0's.

The buckets are DDP's: ``bucket_mb`` (default 25 MB, the first at most 1 MB), from the model's
last parameter to its first. Per step each executor sends (I - 1) / I of its island's reduced
gradient bytes / D across the link, and every island holds the same parameters after the update.
``nn.SyncBatchNorm`` is refused (its statistics would span one island, not the batch).
"""

from __future__ import annotations

import dataclasses
import math

from ..errors import PlacementError
from ..functions import Function
from ..islands import ISLAND_AXIS
from ..placement import Replicate, Shard
from ..programs import Program, as_tuple
from .buckets import flatten
from .optimizers import DYNAMIC, apply_update
from .locate import located
from .step import _from_first_shard, gathered_params, loss_and_grads, make_layout

__all__ = ["CrossIslandRunner", "make_island_joint", "make_segment_function",
           "make_island_update"]


def make_island_joint(model, loss_fn, layout, inner, num_shards: int, seed: int, form, tensor=None):
    """``(*flats, *buffers, *frozen, scalars, rank, *batch) -> (loss, *gradient flats, *buffers)`` of one shard:
    the forward and backward, not yet reduced (the step cut per bucket adds the reductions, `bucket_cut`).
    ``tensor`` (a `tensor_parallel.TensorStep`): the model rank follows ``rank``, the plan lowered into the forward."""
    import contextlib

    buckets = layout.buckets

    def joint(*tensors):
        it = iter(tensors)
        flats = [next(it) for _ in buckets]
        buffers = {name: next(it) for name in layout.buffer_names}
        frozen = {name: next(it) for name in layout.frozen_names}
        scalars, rank = next(it), next(it)
        lowered = tensor.lowered(model, next(it)) if tensor is not None else contextlib.nullcontext()
        batch = list(it)
        params = gathered_params(buckets, flats, inner, num_shards)
        with lowered:
            named, loss, new_buffers = loss_and_grads(model, loss_fn, params, buffers, frozen, form, batch,
                                                      (seed, scalars[0], rank), inner.axis, num_shards)
        grads = [flatten(b, named, b.padded_numel(num_shards)) for b in buckets]
        return (loss.detach(), *grads, *[new_buffers[n] for n in layout.buffer_names])

    return joint


def make_segment_function(segment, inner, num_buckets: int, num_shards: int, index: int):
    """Segment ``index`` of the step as a per-shard function: its graph, then the reductions inside the island of
    what it completes — the loss (mean), its bucket's gradient (reduce-scatter, mean: executor d keeps slice d),
    the buffers (shard 0's: it then takes the shard's rank as its last input)."""
    from ..collectives import all_reduce, reduce_scatter

    num_carried = len(segment.carried_out)
    has_buffers = any(i > num_buckets for i in segment.outputs)

    def run_segment(*tensors):
        rank, tensors = (tensors[-1], tensors[:-1]) if has_buffers else (None, tensors)
        values = segment.graph_module(*tensors)
        carried, returned = list(values[:num_carried]), list(values[num_carried:])
        buffers = []
        for position, (output, value) in enumerate(zip(segment.outputs, returned)):
            if output == 0 and num_shards > 1:
                returned[position] = all_reduce(value, inner.axis, "mean")
            elif 0 < output <= num_buckets and num_shards > 1:
                returned[position] = reduce_scatter(value, inner.axis, "mean", 0)
            elif output > num_buckets:
                buffers.append(position)
        if buffers:
            shared = _from_first_shard([returned[p] for p in buffers], inner, rank, num_shards)
            for position, value in zip(buffers, shared):
                returned[position] = value
        return (*carried, *returned)

    run_segment.__name__ = f"island_grads[{index}]"
    return run_segment


def make_island_update(spec, layout, inner, num_islands: int, num_shards: int,
                       max_grad_norm: float | None, tensor=None):
    """``(*flats, *states, scalars, *losses[I], *slices[I][buckets], *buffers of island 0)
    -> (loss, *flats, *states, *buffers)``: the islands' slices averaged, gathered, applied (``tensor``: partial
    gradients summed over the model axis, each split parameter's slices counted once in the clipping norm)."""
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
        if tensor is not None:
            grads = tensor.complete(grads)
        if max_grad_norm is not None:
            per_bucket = [(g.to(torch.float64) ** 2).sum() for g in grads]
            squares = tensor.sum_squares(per_bucket) if tensor is not None else sum(per_bucket)
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


class CrossIslandRunner:
    """The `StepRunner` of ``DataParallel(("island", axis))`` on a mesh ``{"island": I, axis: D}`` (module doc).

    Beside the protocol, the plan's own views: ``bucket_cut`` (the step's segments, after a first step) and
    ``timeline(path)``; ``island_states`` (each island's state arrays) for tests and benches to look at."""

    state_on_executors = True     # from the start
    bucket_cut = None             # the step cut per gradient bucket (`bucket_cut.BucketCut`), once a step is built

    def __init__(self, basis, plan, model_axis: str | None = None):
        import torch

        model, mesh = basis.model, basis.mesh
        axes = tuple(plan.axis)
        expected = [*axes, *([model_axis] if model_axis else [])]
        if len(axes) != 2 or axes[0] != ISLAND_AXIS or list(mesh.axes) != expected:
            inside = f", {model_axis!r}" if model_axis else ""
            raise PlacementError(f"{type(plan).__name__}({axes!r}): expected ({ISLAND_AXIS!r}, <data axis>{inside}) on "
                                 f"a mesh with exactly those axes in that order, got a mesh with {dict(mesh.axes)}")
        synced = [name for name, m in model.named_modules() if isinstance(m, torch.nn.SyncBatchNorm)]
        if synced:
            raise PlacementError(f"{type(plan).__name__}({axes!r}): {type(model).__name__} has nn.SyncBatchNorm "
                                 f"({', '.join(synced[:3])}{', ...' if len(synced) > 3 else ''}), whose statistics "
                                 f"span the whole batch; across islands they would span one island only (a "
                                 f"collective cannot cross islands): use nn.BatchNorm (DDP's per-shard statistics) "
                                 f"or train inside one island")
        self.basis, self.plan = basis, plan
        # The same kind of plan on the data axis alone (the plan's own class: plans.py imports this module).
        self.inner = type(plan)(axes[1])
        self.num_islands, self.num_shards = mesh.axes[ISLAND_AXIS], mesh.axes[axes[1]]

    def build(self, spec):
        from .buckets import split_for_exchange

        b, mb = self.basis, self.plan.bucket_mb
        self.layout = make_layout(b.model, b.optimizer, spec, lambda buckets: split_for_exchange(
            buckets, int(mb * 2**20), int(min(1.0, mb) * 2**20)))
        self._islands = self._island_meshes()
        self.recapture(spec, b.seed)
        return self.layout

    def _island_axes(self) -> dict:
        """The axes of each island's mesh (its executors are consecutive in the mesh's row-major order)."""
        return {self.inner.axis: self.num_shards}

    def _island_meshes(self) -> list:
        axes, ctx = self._island_axes(), self.basis.context
        per, ids = math.prod(axes.values()), self.basis.mesh.executor_ids
        return [ctx.mesh(axes, executors=list(ids[i * per:(i + 1) * per])) for i in range(self.num_islands)]

    def _tensor_step(self):
        return None       # layers split over a model axis inside each island: `tensor_parallel.across_islands`

    def _bucket_placements(self) -> list:
        return [self._state_placement()] * len(self.layout.buckets)

    def _rank_arrays(self, island: int) -> list:
        """The rank inputs of island ``island``'s joint: the shard's rank (and, under TP, the model rank)."""
        return [self._ranks[island]]

    def recapture(self, spec, seed: int) -> None:
        """The update (captured on first use, once per island mesh); the gradient segments are made per kind of
        batch (`_program_for`)."""
        self.basis = dataclasses.replace(self.basis, seed=seed)
        layout, state = self.layout, self._bucket_placements()
        self._update_key = spec.static_key()      # the optimizer's structure the update was made for
        self._update = Function(
            make_island_update(spec, layout, self.inner, self.num_islands, self.num_shards, self.basis.max_grad_norm,
                               self._tensor_step()),
            out=(Replicate(), *state, *[p for p in state for _ in layout.state_names],
                 *[Replicate()] * len(layout.buffer_names)), mesh=self._islands[0])
        self._programs: dict = {}

    def batch_pieces(self) -> tuple[int, str]:
        pieces = self.num_islands * self.num_shards
        return pieces, f"{self.num_islands} islands x {self.num_shards} data shards = {pieces}"

    def _state_placement(self):
        return {self.inner.axis: Shard(0)} if self.inner.sharded_state else Replicate()

    # ------------------------------------------------------------ state

    def restore(self, tensors: dict) -> None:
        self._put_rank()       # a lost executor took its rank's shard too
        self.put_state(tensors)

    def _put_rank(self) -> None:
        """Each shard's rank over all islands (island i's shard d is i * D + d: its dropout key)."""
        import torch

        ctx = self.basis.context
        self._ranks = [ctx.put(torch.arange(self.num_shards, dtype=torch.int64) + i * self.num_shards, m,
                               {self.inner.axis: Shard(0)}) for i, m in enumerate(self._islands)]

    def put_state(self, tensors: dict) -> None:
        """The same state on every island (each island's own copy, under the inner plan's placement)."""
        layout, ctx = self.layout, self.basis.context
        padded = [b.padded_numel(self.num_shards) if self.inner.sharded_state else b.numel for b in layout.buckets]
        items = layout.state_items(tensors, layout.placer(padded, self._state_placement()))
        # Assigned whole at the end: a put that fails (a loss) leaves the previous state.
        self.island_states = [ctx.put_many(items, mesh) for mesh in self._islands]

    def named_tensors(self) -> dict:
        return self.layout.named_tensors(self.checkpoint_arrays())

    def checkpoint_arrays(self) -> list:
        return list(self.island_states[0])       # every island holds the same state: island 0's executors write it

    def checkpoint_parts(self) -> list:
        from .sharded_checkpoint import CheckpointPart

        return [CheckpointPart.of_layout(self.layout, self.checkpoint_arrays(), self._islands[0],
                                         self.plan.sharded_state)]

    def placed_arrays(self) -> list:
        return [*(array for island in self.island_states for array in island), *self._ranks]

    def _state_examples(self) -> list:
        """Meta tensors shaped as one shard's flats, buffers and frozen parameters (what the joint reads)."""
        import torch

        layout, num_shards, model = self.layout, self.num_shards, self.basis.model
        numels = [b.padded_numel(num_shards) // num_shards if self.inner.sharded_state else b.numel
                  for b in layout.buckets]
        named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        return ([torch.empty(n, dtype=b.dtype, device="meta") for b, n in zip(layout.buckets, numels)]
                + [torch.empty(named[n].shape, dtype=named[n].dtype, device="meta")
                   for n in layout.buffer_names + layout.frozen_names])

    # ------------------------------------------------------------ the step's program

    def _segments_for(self, form, example_inputs: list):
        """The step's forward and backward cut per bucket (`bucket_cut`), each segment a function."""
        from .bucket_cut import cut_per_bucket

        b, layout, nb = self.basis, self.layout, len(self.layout.buckets)
        tensor = self._tensor_step()
        joint = make_island_joint(b.model, b.loss_fn, layout, self.inner, self.num_shards, b.seed, form, tensor)
        cut = cut_per_bucket(joint, example_inputs, nb, self._island_axes(), functionalize_after=tensor is not None)
        self.bucket_cut = cut
        sliced = {self.inner.axis: Shard(0)}
        functions = []
        for index, segment in enumerate(cut.segments):
            # A carried value is one shard's own (an activation): it never leaves the executor, never fetched.
            out = [Replicate()] * len(segment.carried_out)
            out += [sliced if 0 < i <= nb else Replicate() for i in segment.outputs]
            functions.append(Function(make_segment_function(segment, self.inner, nb, self.num_shards, index),
                                      out=tuple(out), mesh=self._islands[0]))
        return cut, functions

    def _program_for(self, form, static_key, example_inputs: list) -> Program:
        """The step as one program for this kind of batch: every island's gradient segments, then its update."""
        key = (static_key, tuple((tuple(t.shape), t.dtype) for t in example_inputs))
        program = self._programs.get(key)
        if program is not None:
            return program
        layout = self.layout
        nb, ns, nbuf, nfrozen = (len(layout.buckets), len(layout.state_names), len(layout.buffer_names),
                                 len(layout.frozen_names))
        num_ranks = len(self._rank_arrays(0))
        num_leaves = len(example_inputs) - (nb + nbuf + nfrozen + 1 + num_ranks)
        per_island = nb * (1 + ns) + nbuf + nfrozen + 1 + num_ranks + num_leaves
        cut, functions = self._segments_for(form, example_inputs)
        update, islands = self._update, self._islands

        def island_grads(mesh, part):
            joint_inputs = (*part[:nb], *part[nb * (1 + ns):])     # flats, buffers, frozen, scalars, rank, batch
            rank = part[nb * (1 + ns) + nbuf + nfrozen + 1]
            carried, finished = {}, {}
            for segment, function in zip(cut.segments, functions):
                args = [joint_inputs[i] for i in segment.inputs] + [carried[n] for n in segment.carried_in]
                if any(i > nb for i in segment.outputs):
                    args.append(rank)
                values = as_tuple(function.on(mesh)(*args))
                carried.update(zip(segment.carried_out, values))
                finished.update(zip(segment.outputs, values[len(segment.carried_out):]))
            return finished[0], [finished[1 + b] for b in range(nb)], [finished[1 + nb + i] for i in range(nbuf)]

        def cross_island_step(*arrays):
            parts = [arrays[i * per_island:(i + 1) * per_island] for i in range(len(islands))]
            computed = [island_grads(mesh, part) for mesh, part in zip(islands, parts)]
            losses = [loss for loss, _, _ in computed]
            slices = [s for _, island_slices, _ in computed for s in island_slices]
            buffers0 = computed[0][2]
            outputs = []
            for mesh, part in zip(islands, parts):
                scalars = part[nb * (1 + ns) + nbuf + nfrozen]
                outputs.extend(as_tuple(update.on(mesh)(*part[:nb * (1 + ns)], scalars, *losses, *slices,
                                                         *buffers0)))
            return tuple(outputs)

        program = self._programs[key] = Program(cross_island_step,
                                                name=f"cross_island_step[{type(self.basis.model).__name__}]")
        return program

    # ------------------------------------------------------------ stepping

    def dispatch(self, form, tensors: list, scalars, modes: tuple, *, spec, step: int, placed):
        import torch

        from ..errors import CaptureError

        b = self.basis
        if spec.static_key() != self._update_key:   # the update's structure changed: capture it anew
            self.recapture(spec, b.seed)
        rows, axis = tensors[0].shape[0] // self.num_islands, self.inner.axis
        arrays = []
        for i, mesh in enumerate(self._islands):
            fresh = b.context.put_many([(scalars, Replicate()),
                                        *[(x[i * rows:(i + 1) * rows], {axis: Shard(0)}) for x in tensors]], mesh)
            arrays += [*self.island_states[i], fresh[0], *self._rank_arrays(i), *fresh[1:]]
        shard_rows = rows // self.num_shards
        ranks = [torch.zeros(1, dtype=torch.int64) for _ in self._rank_arrays(0)]
        examples = [*self._state_examples(), scalars, *ranks, *[x[:shard_rows] for x in tensors]]
        program = self._program_for(form, (spec.static_key(), modes, form.key), examples)
        try:
            outputs = program(*arrays)
        except CaptureError as exc:
            raise located(exc, b.model) from exc.__cause__
        self._take_outputs(outputs)
        return outputs[0]

    def _take_outputs(self, outputs) -> None:
        layout = self.layout
        nb, ns, nbuf = len(layout.buckets), len(layout.state_names), len(layout.buffer_names)
        width = 1 + nb * (1 + ns) + nbuf
        for i in range(self.num_islands):
            result = outputs[i * width:(i + 1) * width]
            frozen = self.island_states[i][nb * (1 + ns) + nbuf:]
            self.island_states[i] = [*result[1:], *frozen]

    def timeline(self, path: str = "step.png", *, trace_path: str | None = None) -> str:
        """Draw the last step from the executors' timestamps (matplotlib): rows grouped by island, the
        backward's segments (one per gradient bucket), the updates, each link transfer an arrow from its send
        to its receipt; ``trace_path`` also writes that step's Chrome/Perfetto trace. Returns ``path``."""
        import json
        import os
        import tempfile

        from ..observe.timeline import (draw_islands as draw, hidden_share, island_chrome_step as chrome_step,
                                        island_picture as step_picture)

        if self.bucket_cut is None:
            raise PlacementError("trainer.runner.timeline: no step has run yet; call trainer.step(batch) first")
        for island in self.island_states:          # every island's update has run: its transfers are in the trace
            for array in island:
                error = array.exception(timeout_s=600)
                if error is not None:
                    raise error
        handle, scratch = tempfile.mkstemp(suffix=".json")
        os.close(handle)
        try:
            full = self.basis.context.trace(scratch)
        finally:
            os.unlink(scratch)
        spans, flows = step_picture(full, len(self.bucket_cut.segments))
        title = (f"{self.num_islands} islands x {self.num_shards} executor(s): {len(self.layout.buckets)} gradient "
                 f"buckets; link transfer time hidden behind the receiver's backward "
                 f"{hidden_share(spans, flows):.0%}")
        draw(spans, flows, path, title)
        if trace_path is not None:
            with open(trace_path, "w") as f:
                json.dump(chrome_step(full, len(self.bucket_cut.segments)), f)
        return path

    def refusal(self, kind: str) -> Exception | None:
        return _not_across_islands(kind)

    def evaluate(self, form, tensors: list, *, placed):
        raise _not_across_islands("evaluate")

    def predict(self, form, tensors: list):
        raise _not_across_islands("predict")

    def describe(self, step_count: int) -> str:
        return (f"<CrossIslandTrainer {type(self.basis.model).__name__} {type(self.plan).__name__}("
                f"{self.plan.axis!r}) on {self.num_islands} islands x {self.num_shards} shards, step {step_count}>")


def _not_across_islands(what: str) -> PlacementError:
    return PlacementError(f"trainer.{what} is not supported across islands yet; {what} on the client from "
                          f"trainer.state_dict(), or load a checkpoint into a trainer inside one island")
