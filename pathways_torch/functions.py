"""``@pw.function``: a per-shard (SPMD) function captured once per input signature.

On a mesh, every executor runs the function on its *local* blocks. Outputs are
placed as declared by ``out=`` or, by default, sharded like the first sharded
input: ``Shard(0)`` on each mesh axis that input is sharded on (local blocks
concatenated along dim 0; 0-d blocks stacked), ``Replicate()`` on the others.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable

from .array import Array
from .capture import CapturedVersion, InputSpec, capture
from .collectives import tracing_mesh
from .errors import CaptureError, PlacementError
from .placement import Replicate, Shard, Sharding, data_dependent_global_shape, normalize_placements
from .tracing import SymbolicArray, call_site, current_tracer, replayed_call
from .wire.limits import COST_SECONDS, bounded

__all__ = ["function", "Function"]


def function(fn: Callable | None = None, *, out=None, name: str | None = None, sim_time_s: float = 0.0,
             donate_argnums: tuple[int, ...] = ()):
    """Decorate a per-shard function. ``out``: one spec or a tuple (one per output); a spec is
    ``pw.Shard(d)`` / ``pw.Replicate()`` (every mesh axis) or ``{axis: placement}``.
    ``sim_time_s``: how long a run occupies a simulated (``backend="sim"``) executor.
    ``donate_argnums``: the positions of array arguments the caller gives up (JAX's spelling): each call frees
    them as it runs, so their memory can hold its outputs; using such an array again raises
    `DonatedArrayError`."""
    if fn is None:
        return lambda f: Function(f, out=out, name=name, sim_time_s=sim_time_s, donate_argnums=donate_argnums)
    return Function(fn, out=out, name=name, sim_time_s=sim_time_s, donate_argnums=donate_argnums)


def _checked_sim_time(name: str, sim_time_s) -> float:
    """0 (not simulated) or seconds within `COST_SECONDS`: the controller charges a call this estimate too, and
    refuses anything else (a NaN or an infinity there would stop every client's calls)."""
    if not isinstance(sim_time_s, bool) and isinstance(sim_time_s, (int, float)) and sim_time_s == 0:
        return 0.0
    return bounded(sim_time_s, f"{name}: sim_time_s", COST_SECONDS,
                   "give the seconds one run takes on a simulated executor, or 0 for none")


class Function:
    """A captured per-shard function; ``num_traces`` counts the versions traced so far."""

    def __init__(self, fn: Callable, *, out=None, name: str | None = None, mesh=None, sim_time_s: float = 0.0,
                 donate_argnums: tuple[int, ...] = (), graph_pass: Callable | None = None,
                 traces: dict | None = None):
        """``traces``: another Function's `traces` to share (`on` makes such a copy: the same function)."""
        self.name = name or getattr(fn, "__name__", "function")
        self.sim_time_s = _checked_sim_time(self.name, sim_time_s)
        donate_argnums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        if any(not isinstance(i, int) or i < 0 for i in donate_argnums):
            raise ValueError(f"donate_argnums: expected argument positions (ints >= 0), got {donate_argnums}")
        self.donate_argnums = frozenset(donate_argnums)
        self.fn = fn
        self.graph_pass = graph_pass     # rewrites each trace before it is sent (a sharded step's unit schedule)
        self.out = out
        self._mesh = mesh
        self._versions: dict[tuple, CapturedVersion] = {} if traces is None else traces
        # (signature, mesh) → (version, output layouts): what a call site repeats needs no recomputing.
        self._calls: dict[tuple, tuple] = {}
        functools.update_wrapper(self, fn)

    @property
    def num_traces(self) -> int:
        return len(self._versions)

    @property
    def traces(self) -> dict:
        """Its captured versions, by signature and mesh shape: shared by its `.on(mesh)` copies, which makes them
        one function (a program's replay checks it)."""
        return self._versions

    def on(self, mesh) -> "Function":
        """The same function, run on ``mesh`` (inputs elsewhere are moved executor→executor)."""
        # One trace cache for every mesh it runs on.
        return Function(self.fn, out=self.out, name=self.name, mesh=mesh, sim_time_s=self.sim_time_s,
                        donate_argnums=tuple(self.donate_argnums), graph_pass=self.graph_pass, traces=self._versions)

    def __call__(self, *args, **kwargs):
        tracer = current_tracer()
        if tracer is not None:
            return self._record(tracer, args, kwargs, SymbolicArray)
        replayed = replayed_call(self)
        if replayed is not None:   # a sequential program's prefix already ran this call
            return replayed
        arrays = [a for a in args if isinstance(a, Array)]
        if not arrays:
            raise PlacementError(f"{self.name}: expected at least one pw.Array argument (made by ctx.put or a call), "
                                 f"got none; put tensors on a mesh with ctx.put first")
        for value in list(args) + list(kwargs.values()):
            if _is_tensor(value):
                raise PlacementError(f"{self.name}: got a torch.Tensor argument; put it on a mesh with "
                                     f"ctx.put(tensor, mesh, placements) and pass the array")
            if isinstance(value, Array) and value in kwargs.values():
                raise PlacementError(f"{self.name}: pass arrays positionally, not as keywords")
        mesh = self._mesh or arrays[0].mesh
        dispatcher = arrays[0].dispatcher
        for a in arrays:
            # Sequential dispatch: an input whose size the data decides is traced against only
            # once its producer has run and reported it.
            a.learn_shape()
        for a in arrays:
            a.check_not_donated(self.name)
            if a.dispatcher is not dispatcher:
                raise PlacementError(f"{self.name}: arrays from different contexts cannot meet in one call")
            if not a.mesh.same_shape(mesh):
                raise PlacementError(
                    f"{self.name}: array {a.array_id} lives on a mesh of shape {a.mesh.axes}, the call runs on "
                    f"{mesh.axes}; resharding across mesh shapes is not supported yet — put it on a mesh of "
                    f"the same shape")
        signature = self._signature(args, kwargs, mesh)
        known = self._calls.get((signature, mesh))
        if known is None:
            version = self._version(signature, args, kwargs, mesh)
            layouts = self._layouts(version, mesh, self._out_placements(arrays, mesh, len(version.outputs)))
            if len(self._calls) >= _MAX_CACHED_CALLS:
                self._calls.clear()
            known = self._calls[(signature, mesh)] = (version, layouts)
        version, layouts = known
        outputs = dispatcher.call(version, mesh, arrays, layouts, call_site(), _donated(version, arrays))
        return outputs[0] if version.single_output else tuple(outputs)

    def _record(self, tracer, args, kwargs, symbolic_type):
        """Inside ``@pw.program``: add a node instead of dispatching."""
        arrays = [a for a in args if isinstance(a, symbolic_type)]
        if any(isinstance(a, Array) for a in list(args) + list(kwargs.values())):
            raise PlacementError(f"{self.name}: inside @pw.program {tracer.name!r}, pass arrays in as program "
                                 f"arguments instead of using arrays from outside")
        if not arrays:
            raise PlacementError(f"{self.name}: inside @pw.program, expected at least one array argument")
        mesh = self._mesh or arrays[0].mesh
        for a in arrays:
            if not a.mesh.same_shape(mesh):
                raise PlacementError(f"{self.name}: %{a.value} lives on a mesh of shape {a.mesh.axes}, the call runs "
                                     f"on {mesh.axes}; resharding across mesh shapes is not supported yet")
        signature = self._signature(args, kwargs, mesh, symbolic_type)
        version = self._version(signature, args, kwargs, mesh, symbolic_type)
        layouts = self._layouts(version, mesh, self._out_placements(arrays, mesh, len(version.outputs)))
        outputs = tracer.add_node(self, version, mesh, arrays, layouts)
        return outputs[0] if version.single_output else tuple(outputs)

    # ------------------------------------------------------------ capture

    def _signature(self, args, kwargs, mesh, array_type=Array) -> tuple:
        parts = []
        for a in args:
            if isinstance(a, array_type):
                parts.append(("array", a.block_shape, a.dtype, a.sharding.placements))
            else:
                parts.append(("static", _static_key(a, self.name)))
        statics = tuple(sorted((k, _static_key(v, self.name)) for k, v in kwargs.items()))
        return (tuple(parts), statics, tuple(mesh.axes.items()))

    def _version(self, signature, args, kwargs, mesh, array_type=Array) -> CapturedVersion:
        cache = self._versions
        version = cache.get(signature)
        if version is None:
            specs = [InputSpec(a.block_shape, a.dtype) for a in args if isinstance(a, array_type)]
            slots = [i for i, a in enumerate(args) if isinstance(a, array_type)]
            # The static arguments only: the version outlives this call (it can re-trace itself), and must
            # not keep the call's arrays, and so their shards on the executors, alive.
            template = [None if isinstance(a, array_type) else a for a in args]

            def rebuild(tensors):
                rebuilt = list(template)
                for slot, tensor in zip(slots, tensors):
                    rebuilt[slot] = tensor
                return rebuilt, kwargs

            with tracing_mesh(mesh.axes):
                version = capture(self.fn, self.name, specs, rebuild, self.graph_pass)
            version.sim_seconds = self.sim_time_s
            # Which of the function's inputs its callers donate: XLA compiles it to reuse their buffers.
            version.graph.donated_inputs.extend(index for index, slot in enumerate(slots)
                                                if slot in self.donate_argnums)
            cache[signature] = version
        return version

    def _out_placements(self, arrays, mesh, num_outputs: int) -> list[tuple]:
        if self.out is None:
            first = next((a for a in arrays if not a.sharding.is_replicated), None)
            if first is None:
                spec = tuple(Replicate() for _ in mesh.axes)
            else:
                spec = tuple(Shard(0) if isinstance(p, Shard) else Replicate() for p in first.sharding.placements)
            return [spec] * num_outputs
        specs = self.out if isinstance(self.out, (tuple, list)) else (self.out,) * num_outputs
        if len(specs) != num_outputs:
            raise CaptureError(f"{self.name}: out= gives {len(specs)} placements, the function returns "
                               f"{num_outputs} outputs")
        return [normalize_placements(spec, mesh) for spec in specs]

    def _layouts(self, version, mesh, out_placements) -> list[tuple]:
        """(global shape, dtype, sharding, block shape) of each output; checked before dispatch.

        A size the data decides is None in both shapes until the call has run.
        """
        layouts = []
        for index, (spec, placements) in enumerate(zip(version.outputs, out_placements)):
            try:
                shape = data_dependent_global_shape(spec.shape, placements, mesh)
            except PlacementError as exc:
                raise CaptureError(f"{self.name}: output {index} has local shape {list(spec.shape)}, "
                                   f"which placements {list(placements)} cannot take: {exc}") from None
            layouts.append((shape, spec.dtype, Sharding(mesh, placements), spec.shape))
        return layouts

    def __repr__(self) -> str:
        return f"<pw.function {self.name} ({self.num_traces} traced versions)>"


def _donated(version: CapturedVersion, arrays: list) -> tuple[int, ...]:
    """Positions among a call's arrays that it may free: the donated arguments (``version.graph.donated_inputs``)
    no one holds (a checkpoint being written holds its step's state: `Array.hold`)."""
    return tuple(i for i in version.graph.donated_inputs if not arrays[i].held)


def _is_tensor(value) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _static_key(value, name: str):
    if isinstance(value, (int, float, bool, str, type(None))):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_static_key(v, name) for v in value))
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.dtype):
        return ("dtype", str(value))
    raise CaptureError(f"{name}: argument {value!r} of type {type(value).__name__} is neither a pw.Array nor a "
                       f"static Python value (int, float, bool, str, None, dtype, tuple of those)")


_MAX_CACHED_CALLS = 1024
