"""Building a pipeline step: schedule → stage meshes → split, autograd, chunk functions → one program.

At the first step (when a batch shows the shapes) the model's forward and loss are traced once and
cut into chunks (`split`), each chunk's joint forward/backward is partitioned (`autograd`), and the
per-chunk functions are captured on their stage meshes (`chunk_functions`). The step itself is a
``@pw.program`` whose body calls those functions in the order of the schedule's simulation — so the
registered plan of every executor lists its actions in its schedule's order, which the executor
keeps. `PipelineBuild` is the part of `PipelineRunner` that builds it (from the runner's plan, schedule,
stage meshes and basis); ``_build`` caches what it makes in ``_built``, one entry per kind of batch.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

from ..errors import CaptureError, PlacementError
from ..functions import Function
from ..placement import Replicate
from ..programs import Program, as_tuple
from ..training.buckets import make_buckets
from ..training.locate import located
from .autograd import partition_chunk
from .chunk_functions import ChunkPlan, make_apply, make_backward, make_forward, make_reduce, make_tied, make_update
from .schedules import Schedule, ScheduleError, make_schedule, simulate
from .split import split_model

__all__ = ["Built", "pipeline_schedule", "stage_meshes", "PipelineBuild"]


@dataclasses.dataclass
class Built:
    """Everything captured for one kind of batch (form, shapes, modes, optimizer structure)."""

    split: object
    plans: list                 # ChunkPlan per chunk
    program: Program
    leaf_rows: int              # rows of each batch leaf per microbatch shard
    num_nodes: int              # nodes in the step's program (computations, tied gradients, updates)


def pipeline_schedule(plan, num_ranks: int) -> tuple[Schedule, list]:
    """The plan's schedule, checked by simulation (with its sends and receives), and its computations in the
    simulation's order (node k of the step's program is action k)."""
    chunks = num_ranks * plan.virtual_stages
    try:
        if plan.schedule in ("gpipe", "1f1b", "interleaved"):
            schedule = make_schedule(plan.schedule, num_ranks, plan.microbatches, plan.virtual_stages)
        else:
            schedule = Schedule.parse(plan.schedule, num_microbatches=plan.microbatches, num_chunks=chunks)
        if (schedule.num_ranks, schedule.num_chunks, schedule.num_microbatches) != (
                num_ranks, chunks, plan.microbatches):
            raise PlacementError(
                f"pw.Pipeline: the schedule has {schedule.num_ranks} ranks, {schedule.num_chunks} chunks and "
                f"{schedule.num_microbatches} microbatches; the plan has {num_ranks} ranks, {chunks} "
                f"chunks and {plan.microbatches} microbatches")
        # Checked as written (the error marks the user's own text), then with its sends and receives.
        simulation = simulate(schedule)
    except (ScheduleError, ValueError) as exc:
        if isinstance(exc, PlacementError):
            raise
        raise PlacementError(f"pw.Pipeline: {exc}") from exc
    return simulation.schedule, [action for _, action in simulation.order if action.is_compute]


def stage_meshes(context, mesh, axis: str, data_axis: str, num_shards: int, num_ranks: int,
                 model: tuple[str, int] | None = None) -> list:
    """One mesh per pipe rank: its executors along the data axis (in data order), or, with ``model`` (the model
    axis and its size), a 2-D mesh data x model. Across islands, rank ``island x pipe_size + pipe``: each
    island holds consecutive stages."""
    from ..islands import ISLAND_AXIS

    names = mesh.axis_names
    pipe_dim, pipe_size = names.index(axis), mesh.axes[axis]
    island_dim = names.index(ISLAND_AXIS) if ISLAND_AXIS in names else None
    inner = [a for a in (data_axis, model[0] if model else None) if a in names]
    by_rank: dict[int, list] = collections.defaultdict(list)
    for position, executor_id in enumerate(mesh.executor_ids):
        coords = mesh.coords(position)
        island = coords[island_dim] if island_dim is not None else 0
        order = tuple(coords[names.index(a)] for a in inner)
        by_rank[island * pipe_size + coords[pipe_dim]].append((order, executor_id))
    axes = {data_axis: num_shards, **({model[0]: model[1]} if model else {})}
    return [context.mesh(axes, executors=[e for _, e in sorted(by_rank[r], key=lambda item: item[0])])
            for r in range(num_ranks)]


class PipelineBuild:
    """`PipelineRunner`'s part that builds a step: the model split into chunks, each chunk's functions, and the
    program that calls them in the schedule's order."""

    def _build(self, form, tensors: list, spec, modes: tuple | None = None) -> Built:
        """The step for this kind of batch under the optimizer's hyper-parameters ``spec`` (cached in ``_built``)."""
        import torch

        b, plan = self.basis, self.plan
        rows = tensors[0].shape[0] // (plan.microbatches * self.num_shards)
        modes = modes if modes is not None else tuple(m.training for m in b.model.modules())
        key = (spec.static_key(), modes, form.key, tuple((tuple(x.shape), x.dtype) for x in tensors))
        built = self._built.get(key)
        if built is not None:
            return built
        examples = [torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device="meta") for x in tensors]
        layout = self.layout
        trained = [s.name for bucket in layout.buckets for s in bucket.slots]
        constants = list(layout.buffer_names) + list(layout.frozen_names)
        try:
            split = split_model(b.model, b.loss_fn, form, examples, trained=trained, constants=constants,
                                num_chunks=self._schedule.num_chunks, seed=b.seed, tensor=self.tensor)
        except CaptureError as exc:
            raise located(exc, b.model) from exc.__cause__
        assignment = tuple(c.params for c in split.chunks)
        if self._assignment is not None and assignment != self._assignment:
            raise PlacementError("pw.Pipeline: this batch splits the model's parameters differently from the "
                                 "first one; use batches of one form")
        self._assignment = assignment
        plans = [self._chunk_plan(split, c, examples) for c in split.chunks]
        if b.max_grad_norm is not None and self.data.sharded_state and any(p.shared for p in plans):
            raise PlacementError("pw.Pipeline: max_grad_norm with ShardedDataParallel stages and parameters shared "
                                 "between chunks (a tied head) is not supported yet; use data=pw.DataParallel(...)")
        program = self._program(plans, spec)
        updates = 2 if b.max_grad_norm is not None else 1   # reduce + apply with clipping
        num_nodes = len(self._compute_actions) + sum(1 for p in plans if p.shared) + updates * len(plans)
        built = self._built[key] = Built(split, plans, program, rows, num_nodes)
        return built

    def _chunk_plan(self, split, chunk, examples) -> ChunkPlan:
        import torch

        model, tensor = self.basis.model, self.tensor
        params = dict(model.named_parameters())
        tensors = {**params, **dict(model.named_buffers())}
        inputs = [torch.empty(tensor.local_shape(n) if tensor is not None and n in params else tensors[n].shape,
                              dtype=tensors[n].dtype, device="meta") for n in chunk.params + chunk.constants]
        examples = [*examples, torch.empty((1, 2), dtype=torch.int64, device="meta")]   # + the dropout key
        if tensor is not None:
            examples.append(torch.empty((1,), dtype=torch.int64, device="meta"))       # + the model rank
        inputs += [examples[i] for i in chunk.batch_leaves]
        inputs += [torch.empty(split.value_layouts[v][0], dtype=split.value_layouts[v][1], device="meta")
                   for v in chunk.incoming]
        scale = 1.0 / self.plan.microbatches
        autograd = partition_chunk(chunk, inputs, set(range(len(chunk.params))), scale, recompute=self.plan.recompute)
        buckets, _ = make_buckets(model, self.basis.optimizer, only=set(chunk.params))
        buckets, kinds = tensor.cut(buckets) if tensor is not None else (buckets, None)
        shared = tuple(n for n in chunk.params if any(n in o.params for o in split.chunks if o is not chunk))
        partners = tuple((o.index, tuple(n for n in o.params if n in chunk.params and n in shared))
                         for o in split.chunks if o is not chunk and set(o.params) & set(shared))
        return ChunkPlan(chunk=chunk, autograd=autograd, buckets=tuple(buckets),
                         num_states=len(self.layout.state_names), shared=shared, partners=partners,
                         data=self.data, num_shards=self.num_shards,
                         tensor=tensor.step(kinds) if tensor is not None else None)

    def _functions(self, plans: list, spec) -> list[dict]:
        """Each chunk's captured functions, on its rank's stage mesh."""
        layout, microbatches, max_grad_norm = self.layout, self.plan.microbatches, self.basis.max_grad_norm
        numel = {s.name: s.numel for p in plans for b in p.buckets for s in b.slots}
        partner_slots = {p.chunk.index: [(n, numel[n]) for n in p.shared] for p in plans}
        owner = {}   # a shared parameter's norm is counted by the first chunk holding it
        for p in plans:
            for n in p.chunk.params:
                owner.setdefault(n, p.chunk.index)
        functions = []
        for plan in plans:
            mesh = self._mesh_of(plan.chunk.index)
            ag, nb = plan.autograd, len(plan.buckets)
            state = self.state_placements(plan)
            update_outs = state + [p for p in state for _ in range(plan.num_states)]
            update_outs += [Replicate()] if plan.chunk.has_loss else []
            backward_outs = (Replicate(),) * (plan.num_incoming_grads + len(plan.buckets))
            functions.append({
                "forward": Function(make_forward(plan), out=(Replicate(),) * (ag.num_outputs + ag.num_saved),
                                    mesh=mesh),
                "backward": Function(make_backward(plan, False), out=backward_outs, mesh=mesh),
                "backward_acc": Function(make_backward(plan, True), out=backward_outs, mesh=mesh),
                "tied": Function(make_tied(plan), out=Replicate(), mesh=mesh),
                "update": Function(make_update(plan, spec, microbatches, layout.num_groups, partner_slots),
                                   out=tuple(update_outs), mesh=mesh),
            })
            if max_grad_norm is not None:
                owned = tuple(n for n in plan.chunk.params if owner[n] == plan.chunk.index)
                functions[-1]["reduce"] = Function(
                    make_reduce(plan, microbatches, partner_slots, owned), mesh=mesh,
                    out=(*state, *(Replicate(),) * (1 + plan.chunk.has_loss)))
                functions[-1]["apply"] = Function(
                    make_apply(plan, spec, layout.num_groups, len(plans), max_grad_norm),
                    out=tuple(update_outs[:nb * (1 + plan.num_states)]), mesh=mesh)
        return functions

    def _program(self, plans: list, spec) -> Program:
        functions = self._functions(plans, spec)
        num_microbatches, num_ranks = self.plan.microbatches, self.num_ranks
        num_states = len(self.layout.state_names)
        update = _clipped_updates if self.basis.max_grad_norm is not None else _updates
        update = functools.partial(update, self._schedule, num_states, plans, functions)
        compute_actions = self._compute_actions

        def pipeline_step(*arrays):
            it = iter(arrays)
            flats, states, consts = [], [], []
            for plan in plans:
                nb = len(plan.buckets)
                flats.append([next(it) for _ in range(nb)])
                states.append([next(it) for _ in range(nb * num_states)])
                consts.append([next(it) for _ in plan.chunk.constants])
            scalars = [next(it) for _ in range(num_ranks)]
            batch = [[[next(it) for _ in plan.chunk.batch_leaves] for plan in plans] for _ in range(num_microbatches)]
            forwards, incoming_grads, accumulated = {}, {}, {}
            for action in compute_actions:
                c, m = action.chunk, action.microbatch
                plan, fns = plans[c], functions[c]
                if action.kind == "F":
                    incoming = forwards[(c - 1, m)][:len(plan.chunk.incoming)] if c else []
                    forwards[(c, m)] = as_tuple(fns["forward"](*flats[c], *consts[c], *batch[m][c], *incoming))
                    continue
                saved = forwards[(c, m)][plan.autograd.num_outputs:]
                grads_out = incoming_grads.pop((c + 1, m)) if c + 1 < len(plans) else []
                params = flats[c] if plan.autograd.backward_params else []
                if c in accumulated:
                    result = as_tuple(fns["backward_acc"](*saved, *params, *grads_out, *accumulated[c]))
                else:
                    result = as_tuple(fns["backward"](*saved, *params, *grads_out))
                incoming_grads[(c, m)] = result[:plan.num_incoming_grads]
                accumulated[c] = result[plan.num_incoming_grads:]
            tied = {p.chunk.index: functions[p.chunk.index]["tied"](*accumulated[p.chunk.index])
                    for p in plans if p.shared}
            last = plans[-1]
            losses = [forwards[(last.chunk.index, m)][last.autograd.num_outputs - 1] for m in range(num_microbatches)]
            extra = {p.chunk.index: (losses if p.chunk.has_loss else []) + [tied[o] for o, _ in p.partners]
                     for p in plans}
            new_flats, new_states, loss = update(flats, states, accumulated, scalars, extra)
            return (loss, *[a for f in new_flats for a in f], *[a for s in new_states for a in s])

        return Program(pipeline_step, name=f"pipeline_step[{type(self.basis.model).__name__}]")


def _updates(schedule, num_states, plans, functions, flats, states, accumulated, scalars, extra):
    """One update node per chunk (inside the program trace): new flats, new states, the loss."""
    new_flats, new_states, loss = [], [], None
    for plan in plans:
        c, nb = plan.chunk.index, len(plan.buckets)
        result = as_tuple(functions[c]["update"](*flats[c], *states[c], *accumulated[c],
                                                  scalars[schedule.rank_of(c)], *extra[c]))
        new_flats.append(result[:nb])
        new_states.append(result[nb:nb * (1 + num_states)])
        loss = result[-1] if plan.chunk.has_loss else loss
    return new_flats, new_states, loss


def _clipped_updates(schedule, num_states, plans, functions, flats, states, accumulated, scalars, extra):
    """With ``max_grad_norm``: every chunk reduces and reports its squared norm, then every chunk applies
    the update scaled by the global norm (the squared norms cross between stages)."""
    reduced, squares, loss = {}, [], None
    for plan in plans:
        c, nb = plan.chunk.index, len(plan.buckets)
        result = as_tuple(functions[c]["reduce"](*accumulated[c], *extra[c]))
        reduced[c], loss = result[:nb], result[nb + 1] if plan.chunk.has_loss else loss
        squares.append(result[nb])
    new_flats, new_states = [], []
    for plan in plans:
        c, nb = plan.chunk.index, len(plan.buckets)
        result = as_tuple(functions[c]["apply"](*flats[c], *states[c], *reduced[c],
                                                 scalars[schedule.rank_of(c)], *squares))
        new_flats.append(result[:nb])
        new_states.append(result[nb:])
    return new_flats, new_states, loss
