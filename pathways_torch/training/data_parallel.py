"""`DataParallelRunner`: a step as one captured function on one mesh (``DataParallel`` and ``ShardedDataParallel``).

Parameters, buffers and optimizer state are flat buckets on the mesh (replicated, or each executor
its slice under a sharded plan); each step puts the batch's shards straight onto the executors that
use them and runs the captured step (`step.make_step`); evaluation and prediction run a captured
forward (`evaluation.make_forward`) on the parameters where they live.
"""

from __future__ import annotations

import dataclasses

from ..errors import CaptureError
from ..functions import Function
from ..placement import Replicate, Shard
from .buckets import split_for_exchange
from .units import plan_units
from .evaluation import make_forward
from .locate import located
from .step import make_layout, make_step

__all__ = ["DataParallelRunner"]


class DataParallelRunner:
    """The `StepRunner` of ``DataParallel(axis)`` / ``ShardedDataParallel(axis)`` on one mesh.

    Beside the protocol: ``function`` (the step's `Function`), ``forwards`` (evaluate's and predict's), the
    state's arrays (``flats``, ``states``, ``buffers``, ``frozen``) and ``units`` (a per-unit sharded step's
    gather groups), for tests and benches to look at."""

    state_on_executors = True     # from the start

    def __init__(self, basis, plan):
        self.basis, self.plan = basis, plan
        self.num_shards = plan.check(basis.mesh)

    def build(self, spec):
        b = self.basis
        self.units = None            # the gather groups of a per-unit sharded step (`units.Units`)
        if self._per_unit():
            def regroup(buckets):
                # With no blocks: one unit per bucket of local_bucket_mb (eager's cap, 4 MB by default).
                self.units = plan_units(b.model, buckets, self.plan.units, self.plan.local_bucket_bytes("eager"),
                                        int(self.plan.min_unit_mb * 2**20))
                return list(self.units.buckets)
        else:
            cap = self.plan.local_bucket_bytes(b.context.backend)
            # Cut as DDP cuts its buckets, last parameters first: the backward makes their gradients first.
            regroup = None if cap is None else lambda buckets: split_for_exchange(buckets, cap, cap)
        self.layout = make_layout(b.model, b.optimizer, spec, regroup)
        self.forwards: dict = {}         # "loss" / "predict" → its Function (evaluate, predict)
        self._output_specs: dict = {}    # form key → how predict rebuilds the model's output
        self.recapture(spec, b.seed)
        return self.layout

    def recapture(self, spec, seed: int) -> None:
        self.basis = b = dataclasses.replace(self.basis, seed=seed)
        layout = self.layout
        outs = [Replicate()] + self._state_placements() + [Replicate()] * len(layout.buffer_names)
        per_unit = self._per_unit()
        step = make_step(b.model, b.loss_fn, spec, layout, self.plan, self.num_shards, b.seed, b.max_grad_norm,
                         batch_forms=b.batch_forms, mark_forward_end=per_unit, tensor=self._tensor_step())
        # The old state is given up to the step that replaces it: executors free it inside the step, so they
        # never hold two copies of it (frozen parameters are not replaced: kept).
        self.function = Function(step, out=tuple(outs), name=step.__name__, mesh=b.mesh,
                                 donate_argnums=tuple(range(layout.num_state_inputs)),
                                 graph_pass=self._schedule() if per_unit else None)

    def _state_placements(self) -> list:
        """The placement of each flat, then of each optimizer state flat (bucket-major)."""
        return [self.plan.state_placement()] * len(self.layout.buckets) * (1 + len(self.layout.state_names))

    def _tensor_step(self):
        """The step's `tensor_parallel.TensorStep` (None: no layer is split over a model axis)."""
        return None

    def _rank_arrays(self) -> list:
        """The arrays after the scalars that tell each shard where it is (its data rank)."""
        return [self._rank]

    def _batch_placement(self) -> dict:
        return {self.plan.axis: Shard(0)}

    def _per_unit(self) -> bool:
        return self.plan.sharded_state and getattr(self.plan, "per_unit", False) and self.num_shards > 1

    def _schedule(self):
        from .unit_schedule import UnitSchedule   # registers a torch op: imported where the step is traced

        rest = frozenset(b for b, unit in enumerate(self.units.bucket_units) if unit is None)   # flats come first
        return UnitSchedule(reshard_after_forward=self.plan.reshard_after_forward, prefetch=self.plan.prefetch,
                            keep=rest)

    def batch_pieces(self) -> tuple[int, str]:
        return self.num_shards, f"the {self.num_shards} shards of mesh axis {self.plan.axis!r}"

    # ------------------------------------------------------------ state

    def restore(self, tensors: dict) -> None:
        self._put_rank()       # a lost executor took its rank's shard too
        self.put_state(tensors)

    def _put_rank(self) -> None:
        """Each shard's rank on the mesh (the step reads it: the first shard's buffers, dropout keys)."""
        import torch

        b = self.basis
        self._rank = b.context.put(torch.arange(self.num_shards, dtype=torch.int64), b.mesh,
                                   {self.plan.axis: Shard(0)})

    def put_state(self, tensors: dict) -> None:
        """The named state as flat buckets under the plan's placement (padded to split evenly when sharded)."""
        layout, b = self.layout, self.basis
        padded = [bucket.padded_numel(self.num_shards) if self.plan.sharded_state else bucket.numel
                  for bucket in layout.buckets]
        items = layout.state_items(tensors, layout.placer(padded, self.plan.state_placement()))
        self.flats, self.states, self.buffers, self.frozen = layout.split_state(b.context.put_many(items, b.mesh))

    def named_tensors(self) -> dict:
        return self.layout.named_tensors(self.checkpoint_arrays())

    def checkpoint_arrays(self) -> list:
        return [*self.flats, *self.states, *self.buffers, *self.frozen]

    def checkpoint_parts(self) -> list:
        from .sharded_checkpoint import CheckpointPart

        return [CheckpointPart.of_layout(self.layout, self.checkpoint_arrays(), self.basis.mesh,
                                         self.plan.sharded_state)]

    def placed_arrays(self) -> list:
        return [*self.checkpoint_arrays(), self._rank]

    # ------------------------------------------------------------ stepping

    def dispatch(self, form, tensors: list, scalars, modes: tuple, *, spec, step: int, placed):
        b = self.basis
        # The step's fresh inputs travel in one message per executor.
        fresh = b.context.put_many([(scalars, Replicate()), *[(x, self._batch_placement()) for x in tensors]],
                                   b.mesh)
        arrays = [*self.flats, *self.states, *self.buffers, *self.frozen, fresh[0], *self._rank_arrays(),
                  *fresh[1:]]
        try:
            # Train/eval modes are read while tracing (dropout, batch statistics): a change re-captures.
            outputs = self.function(*arrays, static_key=(spec.static_key(), modes, form.key))
        except CaptureError as exc:
            raise located(exc, b.model) from exc.__cause__
        self._take_outputs(outputs)
        return outputs[0]

    def _take_outputs(self, outputs) -> None:
        num_buckets, num_states = len(self.layout.buckets), len(self.layout.state_names)
        self.flats = list(outputs[1:1 + num_buckets])
        self.states = list(outputs[1 + num_buckets:1 + num_buckets * (1 + num_states)])
        self.buffers = list(outputs[1 + num_buckets * (1 + num_states):])

    # ------------------------------------------------------------ evaluation

    def evaluate(self, form, tensors: list, *, placed):
        (loss,) = self._forward("loss", form, tensors)
        return loss

    def refusal(self, kind: str) -> Exception | None:
        return None   # both supported

    def predict(self, form, tensors: list):
        from torch.utils._pytree import tree_unflatten

        arrays = iter(self._forward("predict", form, tensors))
        spec, statics, is_tensor = self._output_specs[form.key]
        return tree_unflatten([next(arrays) if tensor else static for static, tensor in zip(statics, is_tensor)],
                              spec)

    def _forward(self, kind: str, form, tensors: list) -> list:
        b = self.basis
        function = self.forwards.get(kind)
        if function is None:
            out = Replicate() if kind == "loss" else self._batch_placement()
            forward = make_forward(b.model, b.loss_fn, self.layout, self.plan, self.num_shards, kind,
                                   b.batch_forms, self._output_specs, tensor=self._tensor_step())
            # Per unit, a forward gathers each unit's parameters just before it reads them.
            function = self.forwards[kind] = Function(forward, out=out, name=forward.__name__, mesh=b.mesh,
                                                      graph_pass=self._schedule() if self._per_unit() else None)
        with b.context.batched_release():
            fresh = b.context.put_many([(x, self._batch_placement()) for x in tensors], b.mesh)
            arrays = [*self.flats, *self.buffers, *self.frozen, *self._rank_arrays(), *fresh]
            try:
                outputs = function(*arrays, static_key=form.key)
            except CaptureError as exc:
                raise located(exc, b.model, "evaluate" if kind == "loss" else "predict") from exc.__cause__
            del arrays, fresh     # inside the batched release: the inputs are freed together
        return list(outputs) if isinstance(outputs, tuple) else [outputs]

    def describe(self, step_count: int) -> str:
        return (f"<Trainer {type(self.basis.model).__name__} {type(self.plan).__name__}({self.plan.axis!r}) on "
                f"{self.num_shards} shards, {len(self.layout.buckets)} buckets, step {step_count}>")
