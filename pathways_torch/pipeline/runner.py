"""`PipelineRunner`: a model cut into chunks on the pipe ranks of a mesh, each step one registered program.

The step is built at the first batch (`build`); one ``RunProgram`` per executor per step; activations
and gradients move between stage meshes as program transfers (executor to executor). Each chunk's
state lives on its rank's stage mesh; checkpoints and recovery: `checkpoints`; evaluation: `evaluation`.
Those three modules each hold a part of `PipelineRunner`: a base class of its own (`PipelineBuild`,
`PipelineCheckpoints`, `PipelineEvaluation`), one object in the end.
"""

from __future__ import annotations

import collections
import dataclasses

from ..errors import PlacementError
from ..placement import Replicate, Shard
from ..training.buckets import flatten, unflatten
from ..training.plans import DataParallel
from ..training.step import make_layout
from .build import Built, PipelineBuild, pipeline_schedule, stage_meshes
from .checkpoints import PipelineCheckpoints
from .evaluation import PipelineEvaluation
from .tensor import stage_tensor
from ..tensor_parallel.shards import host_flat, whole_tensors

__all__ = ["PipelineRunner"]


class PipelineRunner(PipelineBuild, PipelineEvaluation, PipelineCheckpoints):
    """The `StepRunner` of a `Pipeline` plan (see module doc).

    Beside the protocol, the plan's own views: ``schedule``, ``stages``, ``placements`` and ``timeline(path)``;
    for tests and benches, ``stage_meshes`` (one per pipe rank), ``chunk_state`` (each chunk's state arrays),
    ``train_plans()`` and ``last_step_spans()``."""

    def __init__(self, basis, plan):
        self.basis, self.plan = basis, plan
        self.num_ranks, self.num_shards = plan.check(basis.mesh)
        self.data = plan.data if plan.data is not None else DataParallel("data")
        self._schedule, self._compute_actions = pipeline_schedule(plan, self.num_ranks)
        self.tensor = stage_tensor(basis.model, plan, basis.mesh)    # None without tensor=

    def build(self, spec):
        b = self.basis
        self.layout = make_layout(b.model, b.optimizer, spec)
        model = (self.tensor.axis, self.tensor.size) if self.tensor is not None else None
        self.stage_meshes = stage_meshes(b.context, b.mesh, self.plan.axis, self.data.axis, self.num_shards,
                                         self.num_ranks, model)
        self._built: dict = {}
        self._last_built: Built | None = None
        self._assignment = None          # chunk → its parameter names, fixed by the first split
        self._host_state: dict | None = None     # the state until the split is known (then on the executors)
        self.chunk_state: list | None = None     # per chunk: (flats, states, constants) arrays
        return self.layout

    def recapture(self, spec, seed: int) -> None:
        # Split again at the next step (a loaded seed changes the dropout keys traced into the chunks).
        self.basis = dataclasses.replace(self.basis, seed=seed)
        self._built.clear()
        self._assignment = None

    def _mesh_of(self, chunk: int):
        """The stage mesh chunk ``chunk`` runs on (its pipe rank's)."""
        return self.stage_meshes[self._schedule.rank_of(chunk)]

    def batch_pieces(self) -> tuple[int, str]:
        pieces = self.plan.microbatches * self.num_shards
        return pieces, f"{self.plan.microbatches} microbatches x {self.num_shards} data shards = {pieces}"

    @property
    def schedule(self) -> str:
        """The per-rank actions, with the sends and receives between ranks, as text (parses back)."""
        return str(self._schedule)

    @property
    def stages(self) -> str:
        """Which modules went to which chunk and rank, and each chunk's parameter count (after a first step)."""
        if not self._built:
            raise PlacementError("trainer.runner.stages: the model is split when the first batch shows its shapes; "
                                 "call trainer.step(batch) first")
        split = next(b for b in self._built.values() if isinstance(b, Built)).split
        numel = {n: p.numel() for n, p in self.basis.model.named_parameters()}
        return split.describe(numel, rank_of=self._schedule.rank_of)

    # ------------------------------------------------------------ state

    def restore(self, tensors: dict) -> None:
        """At set-up and in recovery: the state back on the chunks' meshes (no shard ranks: the dropout keys
        ride in with each batch)."""
        self.put_state(tensors)

    def put_state(self, tensors: dict) -> None:
        """Keep the state on the client until the split is known; once it is, put it on the chunks' meshes."""
        if self._assignment is None:
            self._host_state = tensors
            self.chunk_state = None
            return
        plans, state_names = self.train_plans(), self.layout.state_names
        chunk_state = []
        for plan in plans:
            items = [self._host_flat(plan, b, tensors, lambda s: f"model/{s}") for b in range(len(plan.buckets))]
            items += [self._host_flat(plan, b, tensors, lambda s, name=name: f"optimizer/{s}/{name}")
                      for b in range(len(plan.buckets)) for name in state_names]
            items += [(tensors[f"model/{n}"], Replicate()) for n in plan.chunk.constants]
            arrays = self.basis.context.put_many(items, self._mesh_of(plan.chunk.index))
            nb, ns = len(plan.buckets), len(state_names)
            chunk_state.append([arrays[:nb], arrays[nb:nb * (1 + ns)], arrays[nb * (1 + ns):]])
        self._put_loose(tensors, plans)
        self.chunk_state, self._host_state = chunk_state, None

    def state_placements(self, plan) -> list:
        """Where each of ``plan``'s (a `ChunkPlan`) flats lives on its stage mesh: as the data plan places state,
        and ``Shard(0)`` on the model axis for a bucket of split parameters."""
        data = self.data.state_placement() if self.num_shards > 1 else Replicate()
        if self.tensor is None:
            return [data] * len(plan.buckets)
        return [self.tensor.placement(kind, data) for kind in plan.tensor.kinds]

    def _host_flat(self, plan, index: int, tensors: dict, key) -> tuple:
        """(host array, placement) of flat ``index`` of ``plan``, from the named ``tensors`` (``key(name)``)."""
        bucket, numel = plan.buckets[index], plan.padded[index]
        placement = self.state_placements(plan)[index]
        if self.tensor is None:
            return _flat(bucket, numel, tensors, key), placement
        named = {s.name: tensors[key(s.name)].to(bucket.dtype) for s in bucket.slots}
        return host_flat(bucket, plan.tensor.kinds[index], named, self.tensor.plan, numel, placement,
                         self._mesh_of(plan.chunk.index)), placement

    def _named(self, plan, index: int, array) -> dict:
        """The named whole tensors of flat ``index`` of ``plan`` from its array (joined over the model axis)."""
        bucket = plan.buckets[index]
        if self.tensor is None:
            return {n: t.clone() for n, t in unflatten(bucket, array.result()).items()}
        return whole_tensors(bucket, plan.tensor.kinds[index], array.result(), self.tensor.plan,
                             self.state_placements(plan)[index], self._mesh_of(plan.chunk.index))

    @property
    def placements(self):
        """Each parameter's placement on the model axis (under ``tensor=``): the plan's styles, global shape ->
        local shape."""
        if self.tensor is None:
            raise PlacementError("trainer.runner.placements: this pipeline splits no layers; pass "
                                 "tensor=pw.TensorParallel(plan) to pw.Pipeline")
        from ..tensor_parallel.runner import _Text

        return _Text(self.tensor.describe(f"{self.num_ranks} stages on {self.plan.axis!r}, data axis "
                                          f"{self.data.axis!r} of {self.num_shards}"))

    def train_plans(self) -> list:
        """Each chunk's `chunk_functions.ChunkPlan` for training (after a first step)."""
        return next(b for b in self._built.values() if isinstance(b, Built)).plans

    @property
    def state_on_executors(self) -> bool:
        """Whether the state is on the chunks' meshes and their layout known (not before the first step, nor
        between a `load` and the next step)."""
        return self.chunk_state is not None and any(isinstance(b, Built) for b in self._built.values())

    def named_tensors(self) -> dict:
        if self.chunk_state is None:
            return {k: v.clone() for k, v in self._host_state.items()}
        tensors = dict(self._constants_on_host())
        for plan, (flats, states, _) in zip(self.train_plans(), self.chunk_state):
            for index, flat in enumerate(flats):
                for name, t in self._named(plan, index, flat).items():
                    tensors.setdefault(f"model/{name}", t)
            it = iter(states)
            for index in range(len(plan.buckets)):
                for state_name in self.layout.state_names:
                    for name, t in self._named(plan, index, next(it)).items():
                        tensors.setdefault(f"optimizer/{name}/{state_name}", t)
        for name, array in self._loose:          # what no chunk holds (never updated by a step)
            tensors.setdefault(name, array.result())
        return tensors

    def _constants_on_host(self) -> dict:
        """Buffers and frozen parameters: not updated by a pipeline step (refused when a forward mutates one)."""
        model = self.basis.model
        return {f"model/{n}": t.detach().clone() for n, t in
                list(model.named_buffers()) + [(n, p) for n, p in model.named_parameters()
                                               if n in self.layout.frozen_names]}

    # ------------------------------------------------------------ stepping

    def dispatch(self, form, tensors: list, scalars, modes: tuple, *, spec, step: int, placed):
        built = self._last_built = self._build(form, tensors, spec, modes)
        self._place_state(placed)
        ctx, axis = self.basis.context, self.data.axis
        per_mesh: dict[int, list] = collections.defaultdict(list)   # rank → items, in program input order
        for r in range(self.num_ranks):
            per_mesh[r].append((scalars, Replicate()))
        rows = built.leaf_rows * self.num_shards
        for m in range(self.plan.microbatches):
            leaves = [*tensors, self._dropout_key(step, m, built.leaf_rows)]
            for plan in built.plans:
                r = self._schedule.rank_of(plan.chunk.index)
                for leaf in plan.chunk.batch_leaves:
                    if leaf == built.split.rank_leaf:
                        per_mesh[r].append(self.tensor.rank())
                        continue
                    value = leaves[leaf] if leaf == built.split.rng_leaf else leaves[leaf][m * rows:(m + 1) * rows]
                    per_mesh[r].append((value, {axis: Shard(0)}))
        put = {r: iter(ctx.put_many(items, self.stage_meshes[r])) for r, items in per_mesh.items()}
        state = [a for flats, states, consts in self.chunk_state for a in (*flats, *states, *consts)]
        scalar_arrays = [next(put[r]) for r in range(self.num_ranks)]
        batch_arrays = [next(put[self._schedule.rank_of(plan.chunk.index)])
                        for _ in range(self.plan.microbatches) for plan in built.plans for _ in plan.chunk.batch_leaves]
        outputs = built.program(*state, *scalar_arrays, *batch_arrays)
        self._take_outputs(built.plans, outputs)
        return outputs[0]

    def _dropout_key(self, step: int, microbatch: int, rows: int):
        """(step number, global index of the shard's first row) for each data shard of ``microbatch``: dropout
        masks keyed by sample, as the whole batch in one process draws them (`sample_keyed_rng`)."""
        import torch

        first = microbatch * rows * self.num_shards
        return torch.tensor([[step, first + d * rows] for d in range(self.num_shards)], dtype=torch.int64)

    def _take_outputs(self, plans: list, outputs) -> None:
        it = iter(outputs[1:])
        flats = [[next(it) for _ in p.buckets] for p in plans]
        states = [[next(it) for _ in range(len(p.buckets) * len(self.layout.state_names))] for p in plans]
        self.chunk_state = [[f, s, old[2]] for f, s, old in zip(flats, states, self.chunk_state)]

    # ------------------------------------------------------------ prediction and the timeline

    def refusal(self, kind: str) -> Exception | None:
        return PlacementError("trainer.predict is not supported under pw.Pipeline yet; use trainer.evaluate for the "
                              "loss, or run the model on the client from trainer.state_dict()['model']") \
            if kind == "predict" else None

    def predict(self, form, tensors: list):
        raise self.refusal("predict")

    def timeline(self, path: str = "step.png", *, trace_path: str | None = None) -> str:
        """Draw the last step from the executors' timestamps (matplotlib): one row per executor, forward and
        backward in two colours with microbatch numbers, the bubble visible; ``trace_path`` also writes that
        step's Chrome/Perfetto trace. Returns ``path``."""
        import json

        from ..observe.timeline import bubble_fraction, draw_pipeline as draw, pipeline_chrome_step as chrome_step

        if self._last_built is None:
            raise PlacementError("trainer.runner.timeline: no step has run yet; call trainer.step(batch) first")
        spans, full, rows, nodes = self.last_step_spans()
        title = (f"{self._schedule.name or 'schedule'}: {self.num_ranks} stages x {self.plan.microbatches} "
                 f"microbatches, {self.num_shards} data shard(s); bubble {bubble_fraction(spans):.0%}")
        draw(spans, path, title)
        if trace_path is not None:
            with open(trace_path, "w") as f:
                json.dump(chrome_step(full, nodes, rows), f)
        return path

    def last_step_spans(self):
        """The last step's spans (`timeline.Span`), the whole trace, the rows and the program's node count (waits
        for the trainer's unfinished steps)."""
        import os
        import tempfile

        from ..observe.timeline import pipeline_spans as step_spans

        built, ctx = self._last_built, self.basis.context
        rows = {eid: f"rank {r} · data {d} ({eid})" for r, mesh in enumerate(self.stage_meshes)
                for d, eid in enumerate(mesh.executor_ids)}
        handle, scratch = tempfile.mkstemp(suffix=".json")
        os.close(handle)
        try:
            ctx.flush_frees()
            for loss in list(self.basis.unfinished_steps):
                loss.wait()
            full = ctx.trace(scratch)
        finally:
            os.unlink(scratch)
        return step_spans(full, self._compute_actions, built.num_nodes, rows), full, rows, built.num_nodes

    def describe(self, step_count: int) -> str:
        return (f"<PipelineTrainer {type(self.basis.model).__name__} {self.plan.schedule} {self.num_ranks} ranks x "
                f"{self.num_shards} data shards, {self.plan.microbatches} microbatches, step {step_count}>")


def _flat(bucket, numel: int, tensors: dict, key):
    """One bucket's named tensors (``key(parameter name)``) as its flat buffer of ``numel`` elements."""
    return flatten(bucket, {s.name: tensors[key(s.name)].to(bucket.dtype) for s in bucket.slots}, numel)
