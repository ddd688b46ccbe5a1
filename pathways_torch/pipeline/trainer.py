"""`PipelineTrainer`: a model cut into chunks on the pipe ranks of a mesh, each step one registered program.

At the first step (when a batch shows the shapes) the model's forward and loss are
traced once and cut into chunks (`split`), each chunk's joint forward/backward is
partitioned (`autograd`), and the per-chunk functions are captured on their stage
meshes (`chunk_functions`). The step itself is a ``@pw.program`` whose body calls
those functions in the order of the schedule's simulation — so the registered plan
of every executor lists its actions in its schedule's order, which the executor
keeps. One ``RunProgram`` per executor per step; activations and gradients move
between stage meshes as program transfers (executor to executor).
"""

from __future__ import annotations

import collections
import dataclasses
import functools

from ..errors import CaptureError, PlacementError
from ..functions import Function
from ..placement import Replicate, Shard
from ..programs import Program, as_tuple
from ..training.buckets import flatten, make_buckets, unflatten
from ..training.checkpoint_folders import DEFAULT_KEEP
from ..training.optimizers import read_optimizer
from ..training.plans import DataParallel
from ..training.step import StepLayout
from ..training.trainer import Trainer
from .autograd import partition_chunk
from .checkpoints import PipelineCheckpoints
from .chunk_functions import ChunkPlan, make_apply, make_backward, make_forward, make_reduce, make_tied, make_update
from .evaluation import evaluate
from .plan import Pipeline
from .schedules import Schedule, ScheduleError, make_schedule, simulate
from .split import split_model

__all__ = ["PipelineTrainer"]


@dataclasses.dataclass
class _Built:
    """Everything captured for one kind of batch (form, shapes, modes, optimizer structure)."""

    split: object
    plans: list                 # ChunkPlan per chunk
    program: Program
    leaf_rows: int              # rows of each batch leaf per microbatch shard
    num_nodes: int              # nodes in the step's program (computations, tied gradients, updates)


class PipelineTrainer(PipelineCheckpoints, Trainer):
    """Train ``model`` under a `Pipeline` plan on ``mesh`` (see `Context.wrap`); checkpoints and recovery:
    `checkpoints`."""

    def __init__(self, context, model, *, optimizer, loss_fn, mesh, plan: Pipeline, max_grad_norm=None, seed=0,
                 checkpoint_dir: str | None = None, checkpoint_every: int = 0, recover: bool | None = None,
                 replacement_timeout_s: float = 120.0, checkpoint_keep: int = DEFAULT_KEEP):
        import torch

        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ctx.wrap: expected an nn.Module, got {type(model).__name__}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm: expected a positive number or None, got {max_grad_norm!r}")
        self._context, self.model, self.optimizer, self.loss_fn = context, model, optimizer, loss_fn
        self.mesh, self.plan, self.max_grad_norm, self.seed = mesh, plan, max_grad_norm, int(seed)
        self.num_ranks, self.num_shards = plan.check(mesh)
        self.data = plan.data if plan.data is not None else DataParallel("data")
        self._schedule = self._make_schedule()
        self._spec = read_optimizer(optimizer)
        buckets, frozen = make_buckets(model, optimizer)
        self.layout = StepLayout(buckets=tuple(buckets), state_names=self._spec.state_names,
                                 buffer_names=tuple(n for n, _ in model.named_buffers()),
                                 frozen_names=tuple(frozen), num_groups=len(optimizer.param_groups))
        self.samples_seen = 0
        self.step_count = self._optimizer_step_count()
        self._batch_forms: dict = {}
        self._unfinished_steps: collections.deque = collections.deque()
        self._stage_meshes = self._make_stage_meshes()
        self._built: dict = {}
        self._last_built: _Built | None = None
        self._assignment = None          # chunk → its parameter names, fixed by the first split
        self._host_state = self._initial_tensors()   # put on the executors once the split is known
        self._chunk_state: list | None = None        # per chunk: (flats, states, constants) arrays
        self._set_up_recovery(checkpoint_dir, checkpoint_every, recover, replacement_timeout_s,
                              checkpoint_keep=checkpoint_keep)

    # ------------------------------------------------------------ set-up

    def _make_schedule(self) -> Schedule:
        plan, chunks = self.plan, self.num_ranks * self.plan.virtual_stages
        try:
            if plan.schedule in ("gpipe", "1f1b", "interleaved"):
                schedule = make_schedule(plan.schedule, self.num_ranks, plan.microbatches, plan.virtual_stages)
            else:
                schedule = Schedule.parse(plan.schedule, num_microbatches=plan.microbatches, num_chunks=chunks)
            if (schedule.num_ranks, schedule.num_chunks, schedule.num_microbatches) != (
                    self.num_ranks, chunks, plan.microbatches):
                raise PlacementError(
                    f"pw.Pipeline: the schedule has {schedule.num_ranks} ranks, {schedule.num_chunks} chunks and "
                    f"{schedule.num_microbatches} microbatches; the plan has {self.num_ranks} ranks, {chunks} "
                    f"chunks and {plan.microbatches} microbatches")
            # Checked as written (the error marks the user's own text), then with its sends and receives.
            self._simulation = simulate(schedule)
            # The program lists the computations in the simulation's order: node k is this action.
            self._compute_actions = [action for _, action in self._simulation.order if action.is_compute]
        except (ScheduleError, ValueError) as exc:
            if isinstance(exc, PlacementError):
                raise
            raise PlacementError(f"pw.Pipeline: {exc}") from exc
        return self._simulation.schedule

    def _make_stage_meshes(self) -> list:
        """One mesh per pipe rank: its executors along the data axis (in data order). Across islands, rank
        ``island x pipe_size + pipe``: each island holds consecutive stages."""
        from ..islands import ISLAND_AXIS

        mesh, axis = self.mesh, self.plan.axis
        names = mesh.axis_names
        pipe_dim, pipe_size = names.index(axis), mesh.axes[axis]
        island_dim = names.index(ISLAND_AXIS) if ISLAND_AXIS in names else None
        by_rank: dict[int, list] = collections.defaultdict(list)
        for position, executor_id in enumerate(mesh.executor_ids):
            coords = mesh.coords(position)
            island = coords[island_dim] if island_dim is not None else 0
            by_rank[island * pipe_size + coords[pipe_dim]].append(executor_id)
        return [self._context.mesh({self.data.axis: self.num_shards}, executors=by_rank[r])
                for r in range(self.num_ranks)]

    def _mesh_of(self, chunk: int):
        """The stage mesh chunk ``chunk`` runs on (its pipe rank's)."""
        return self._stage_meshes[self._schedule.rank_of(chunk)]

    @property
    def schedule(self) -> str:
        """The per-rank actions, with the sends and receives between ranks, as text (parses back)."""
        return str(self._schedule)

    @property
    def stages(self) -> str:
        """Which modules went to which chunk and rank, and each chunk's parameter count (after a first step)."""
        if not self._built:
            raise PlacementError("trainer.stages: the model is split when the first batch shows its shapes; "
                                 "call trainer.step(batch) first")
        split = next(b for b in self._built.values() if isinstance(b, _Built)).split
        numel = {n: p.numel() for n, p in self.model.named_parameters()}
        return split.describe(numel, rank_of=self._schedule.rank_of)

    # ------------------------------------------------------------ building the step

    def _build(self, form, tensors: list, modes: tuple | None = None) -> _Built:
        import torch

        rows = tensors[0].shape[0] // (self.plan.microbatches * self.num_shards)
        modes = modes if modes is not None else tuple(m.training for m in self.model.modules())
        key = (self._spec.static_key(), modes, form.key, tuple((tuple(t.shape), t.dtype) for t in tensors))
        built = self._built.get(key)
        if built is not None:
            return built
        examples = [torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device="meta") for t in tensors]
        trained = [s.name for b in self.layout.buckets for s in b.slots]
        constants = list(self.layout.buffer_names) + list(self.layout.frozen_names)
        try:
            split = split_model(self.model, self.loss_fn, form, examples, trained=trained, constants=constants,
                                num_chunks=self._schedule.num_chunks, seed=self.seed)
        except CaptureError as exc:
            raise self._located(exc) from exc.__cause__
        assignment = tuple(c.params for c in split.chunks)
        if self._assignment is not None and assignment != self._assignment:
            raise PlacementError("pw.Pipeline: this batch splits the model's parameters differently from the "
                                 "first one; use batches of one form")
        self._assignment = assignment
        plans = [self._chunk_plan(split, c, examples) for c in split.chunks]
        if self.max_grad_norm is not None and self.data.sharded_state and any(p.shared for p in plans):
            raise PlacementError("pw.Pipeline: max_grad_norm with ShardedDataParallel stages and parameters shared "
                                 "between chunks (a tied head) is not supported yet; use data=pw.DataParallel(...)")
        program = self._program(split, plans)
        updates = 2 if self.max_grad_norm is not None else 1   # reduce + apply with clipping
        num_nodes = len(self._compute_actions) + sum(1 for p in plans if p.shared) + updates * len(plans)
        built = self._built[key] = _Built(split, plans, program, rows, num_nodes)
        return built

    def _chunk_plan(self, split, chunk, examples) -> ChunkPlan:
        import torch

        params = dict(self.model.named_parameters())
        tensors = {**params, **dict(self.model.named_buffers())}
        inputs = [torch.empty(tensors[n].shape, dtype=tensors[n].dtype, device="meta")
                  for n in chunk.params + chunk.constants]
        examples = [*examples, torch.empty((1, 2), dtype=torch.int64, device="meta")]   # + the dropout key
        inputs += [examples[i] for i in chunk.batch_leaves]
        inputs += [torch.empty(split.value_layouts[v][0], dtype=split.value_layouts[v][1], device="meta")
                   for v in chunk.incoming]
        scale = 1.0 / self.plan.microbatches
        autograd = partition_chunk(chunk, inputs, set(range(len(chunk.params))), scale,
                                   recompute=self.plan.recompute)
        buckets, _ = make_buckets(self.model, self.optimizer, only=set(chunk.params))
        shared = tuple(n for n in chunk.params if any(n in o.params for o in split.chunks if o is not chunk))
        partners = tuple((o.index, tuple(n for n in o.params if n in chunk.params and n in shared))
                         for o in split.chunks if o is not chunk and set(o.params) & set(shared))
        return ChunkPlan(chunk=chunk, autograd=autograd, buckets=tuple(buckets),
                         num_states=len(self.layout.state_names), shared=shared, partners=partners,
                         data=self.data, num_shards=self.num_shards)

    def _functions(self, plans: list) -> list[dict]:
        """Each chunk's captured functions, on its rank's stage mesh."""
        state = self.data.state_placement() if self.num_shards > 1 else Replicate()
        numel = {s.name: s.numel for b in self.layout.buckets for s in b.slots}
        partner_slots = {p.chunk.index: [(n, numel[n]) for n in p.shared] for p in plans}
        owner = {}   # a shared parameter's norm is counted by the first chunk holding it
        for p in plans:
            for n in p.chunk.params:
                owner.setdefault(n, p.chunk.index)
        functions = []
        for plan in plans:
            mesh = self._mesh_of(plan.chunk.index)
            ag, nb = plan.autograd, len(plan.buckets)
            update_outs = [state] * (nb * (1 + plan.num_states)) + ([Replicate()] if plan.chunk.has_loss else [])
            functions.append({
                "forward": Function(make_forward(plan), out=(Replicate(),) * (ag.num_outputs + ag.num_saved),
                                    mesh=mesh),
                "backward": Function(make_backward(plan, False), out=self._backward_outs(plan), mesh=mesh),
                "backward_acc": Function(make_backward(plan, True), out=self._backward_outs(plan), mesh=mesh),
                "tied": Function(make_tied(plan), out=Replicate(), mesh=mesh),
                "update": Function(make_update(plan, self._spec, self.plan.microbatches, self.layout.num_groups,
                                               partner_slots), out=tuple(update_outs), mesh=mesh),
            })
            if self.max_grad_norm is not None:
                owned = tuple(n for n in plan.chunk.params if owner[n] == plan.chunk.index)
                functions[-1]["reduce"] = Function(
                    make_reduce(plan, self.plan.microbatches, partner_slots, owned), mesh=mesh,
                    out=(state,) * nb + (Replicate(),) * (1 + plan.chunk.has_loss))
                functions[-1]["apply"] = Function(
                    make_apply(plan, self._spec, self.layout.num_groups, len(plans), self.max_grad_norm),
                    out=(state,) * (nb * (1 + plan.num_states)), mesh=mesh)
        return functions

    def _backward_outs(self, plan: ChunkPlan) -> tuple:
        return (Replicate(),) * (plan.num_incoming_grads + len(plan.buckets))

    def _program(self, split, plans: list) -> Program:
        functions = self._functions(plans)
        num_microbatches, num_ranks = self.plan.microbatches, self.num_ranks
        num_states = len(self.layout.state_names)
        update = self._clipped_updates if self.max_grad_norm is not None else self._updates
        update = functools.partial(update, plans, functions)

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
            for action in self._compute_actions:
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

        return Program(pipeline_step, name=f"pipeline_step[{type(self.model).__name__}]")

    def _updates(self, plans, functions, flats, states, accumulated, scalars, extra):
        """One update node per chunk (inside the program trace): new flats, new states, the loss."""
        num_states = len(self.layout.state_names)
        new_flats, new_states, loss = [], [], None
        for plan in plans:
            c, nb = plan.chunk.index, len(plan.buckets)
            result = as_tuple(functions[c]["update"](*flats[c], *states[c], *accumulated[c],
                                                      scalars[self._schedule.rank_of(c)], *extra[c]))
            new_flats.append(result[:nb])
            new_states.append(result[nb:nb * (1 + num_states)])
            loss = result[-1] if plan.chunk.has_loss else loss
        return new_flats, new_states, loss

    def _clipped_updates(self, plans, functions, flats, states, accumulated, scalars, extra):
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
                                                     scalars[self._schedule.rank_of(c)], *squares))
            new_flats.append(result[:nb])
            new_states.append(result[nb:])
        return new_flats, new_states, loss

    # ------------------------------------------------------------ state

    def _put_state(self, tensors: dict) -> None:
        """Keep the state on the client until the split is known; once it is, put it on the chunks' meshes."""
        if self._assignment is None:
            self._host_state = tensors
            self._chunk_state = None
            return
        state_placement = self.data.state_placement() if self.num_shards > 1 else Replicate()
        plans = self._train_plans()
        chunk_state = []
        for plan in plans:
            mesh = self._mesh_of(plan.chunk.index)
            items = [(flatten(b, {s.name: tensors[f"model/{s.name}"].to(b.dtype) for s in b.slots}, n),
                      state_placement) for b, n in zip(plan.buckets, plan.padded)]
            items += [(flatten(b, {s.name: tensors[f"optimizer/{s.name}/{name}"].to(b.dtype) for s in b.slots}, n),
                       state_placement) for b, n in zip(plan.buckets, plan.padded) for name in self.layout.state_names]
            items += [(tensors[f"model/{n}"], Replicate()) for n in plan.chunk.constants]
            arrays = self._context.put_many(items, mesh)
            nb, ns = len(plan.buckets), len(self.layout.state_names)
            chunk_state.append([arrays[:nb], arrays[nb:nb * (1 + ns)], arrays[nb * (1 + ns):]])
        self._put_loose(tensors, plans)
        self._chunk_state, self._host_state = chunk_state, None

    def _train_plans(self) -> list:
        return next(b for b in self._built.values() if isinstance(b, _Built)).plans

    def _state_on_executors(self) -> bool:
        """Whether the state is on the chunks' meshes and their layout known (not before the first step, nor
        between a `load` and the next step)."""
        return self._chunk_state is not None and any(isinstance(b, _Built) for b in self._built.values())

    def _make_function(self):
        self._built.clear()
        self._assignment = None
        return None

    def _named_tensors(self) -> dict:
        if self._chunk_state is None:
            return {k: v.clone() for k, v in self._host_state.items()}
        tensors = dict(self._constants_on_host())
        plans = self._train_plans()
        for plan, (flats, states, _) in zip(plans, self._chunk_state):
            for bucket, flat in zip(plan.buckets, flats):
                for name, t in unflatten(bucket, flat.result()).items():
                    tensors.setdefault(f"model/{name}", t.clone())
            it = iter(states)
            for bucket in plan.buckets:
                for state_name in self.layout.state_names:
                    for name, t in unflatten(bucket, next(it).result()).items():
                        tensors.setdefault(f"optimizer/{name}/{state_name}", t.clone())
        for name, array in self._loose:          # what no chunk holds (never updated by a step)
            tensors.setdefault(name, array.result())
        return tensors

    def _constants_on_host(self) -> dict:
        """Buffers and frozen parameters: not updated by a pipeline step (refused when a forward mutates one)."""
        return {f"model/{n}": t.detach().clone() for n, t in
                list(self.model.named_buffers()) + [(n, p) for n, p in self.model.named_parameters()
                                                    if n in self.layout.frozen_names]}

    # ------------------------------------------------------------ stepping

    def _batch_pieces(self) -> tuple[int, str]:
        pieces = self.plan.microbatches * self.num_shards
        return pieces, f"{self.plan.microbatches} microbatches x {self.num_shards} data shards = {pieces}"

    def _dispatch_step(self, form, tensors: list, *, spec=None, modes=None):
        import torch

        # A step run again after a recovery passes the hyper-parameters and modes it had.
        self._spec = spec if spec is not None else read_optimizer(self.optimizer)
        built = self._last_built = self._build(form, tensors, modes)
        self._place_state()
        scalars = torch.tensor([self.step_count + 1, *self._spec.dynamic_values()], dtype=torch.float64)
        ctx, axis = self._context, self.data.axis
        per_mesh: dict[int, list] = collections.defaultdict(list)   # rank → items, in program input order
        for r in range(self.num_ranks):
            per_mesh[r].append((scalars, Replicate()))
        rows = built.leaf_rows * self.num_shards
        for m in range(self.plan.microbatches):
            leaves = [*tensors, self._dropout_key(m, built.leaf_rows)]
            for plan in built.plans:
                r = self._schedule.rank_of(plan.chunk.index)
                for leaf in plan.chunk.batch_leaves:
                    value = leaves[leaf] if leaf == built.split.rng_leaf else leaves[leaf][m * rows:(m + 1) * rows]
                    per_mesh[r].append((value, {axis: Shard(0)}))
        put = {r: iter(ctx.put_many(items, self._stage_meshes[r])) for r, items in per_mesh.items()}
        state = [a for flats, states, consts in self._chunk_state for a in (*flats, *states, *consts)]
        scalar_arrays = [next(put[r]) for r in range(self.num_ranks)]
        batch_arrays = [next(put[self._schedule.rank_of(plan.chunk.index)])
                        for _ in range(self.plan.microbatches) for plan in built.plans for _ in plan.chunk.batch_leaves]
        outputs = built.program(*state, *scalar_arrays, *batch_arrays)
        self._take_pipeline_outputs(built.plans, outputs)
        self.optimizer._opt_called = True
        self.step_count += 1
        self.samples_seen += int(tensors[0].shape[0])
        return outputs[0]

    def _dropout_key(self, microbatch: int, rows: int):
        """(step number, global index of the shard's first row) for each data shard of ``microbatch``: dropout
        masks keyed by sample, as the whole batch in one process draws them (`sample_keyed_rng`)."""
        import torch

        first = microbatch * rows * self.num_shards
        return torch.tensor([[self.step_count + 1, first + d * rows] for d in range(self.num_shards)],
                            dtype=torch.int64)

    def _take_pipeline_outputs(self, plans: list, outputs) -> None:
        it = iter(outputs[1:])
        flats = [[next(it) for _ in p.buckets] for p in plans]
        states = [[next(it) for _ in range(len(p.buckets) * len(self.layout.state_names))] for p in plans]
        self._chunk_state = [[f, s, old[2]] for f, s, old in zip(flats, states, self._chunk_state)]

    def timeline(self, path: str = "step.png", *, trace_path: str | None = None) -> str:
        """Draw the last step from the executors' timestamps (matplotlib): one row per executor, forward and
        backward in two colours with microbatch numbers, the bubble visible; ``trace_path`` also writes that
        step's Chrome/Perfetto trace. Returns ``path``."""
        import json

        from .timeline import bubble_fraction, chrome_step, draw

        if self._last_built is None:
            raise PlacementError("trainer.timeline: no step has run yet; call trainer.step(batch) first")
        spans, full, rows, nodes = self._last_step_spans()
        title = (f"{self._schedule.name or 'schedule'}: {self.num_ranks} stages x {self.plan.microbatches} "
                 f"microbatches, {self.num_shards} data shard(s); bubble {bubble_fraction(spans):.0%}")
        draw(spans, path, title)
        if trace_path is not None:
            with open(trace_path, "w") as f:
                json.dump(chrome_step(full, nodes, rows), f)
        return path

    def _last_step_spans(self):
        """The last step's spans (`timeline.Span`), the whole trace, the rows and the program's node count."""
        import os
        import tempfile

        from .timeline import step_spans

        built = self._last_built
        rows = {eid: f"rank {r} · data {d} ({eid})" for r, mesh in enumerate(self._stage_meshes)
                for d, eid in enumerate(mesh.executor_ids)}
        handle, scratch = tempfile.mkstemp(suffix=".json")
        os.close(handle)
        try:
            self._context._flush_frees()
            for loss in list(self._unfinished_steps):
                loss.wait()
            full = self._context.trace(scratch)
        finally:
            os.unlink(scratch)
        return step_spans(full, self._compute_actions, built.num_nodes, rows), full, rows, built.num_nodes

    def evaluate(self, batch):
        """The loss on ``batch`` (a replicated 0-d `pw.Array`, at once): the chunks' forwards only, in eval mode,
        microbatch after microbatch, on the parameters where they live (one program per call; `evaluation`)."""
        return evaluate(self, batch)

    def predict(self, batch):
        raise PlacementError("trainer.predict is not supported under pw.Pipeline yet; use trainer.evaluate for the "
                             "loss, or run the model on the client from trainer.state_dict()['model']")

    def __repr__(self) -> str:
        return (f"<PipelineTrainer {type(self.model).__name__} {self.plan.schedule} {self.num_ranks} ranks x "
                f"{self.num_shards} data shards, {self.plan.microbatches} microbatches, step {self.step_count}>")

