"""``@pw.program``: several function calls traced into one program, registered once, run as one.

Calling a program traces its Python body once per input signature: every
``@pw.function`` call inside records a node (its function, mesh, input values and
output layouts) instead of dispatching. The result is a dataflow graph of sharded
nodes that the controller lowers once (placement, transfers between meshes, a
buffer plan) and registers on the executors. Each later run sends one small
message per executor, whatever the number of nodes; every node still gets its own
island sequence number.

A function whose output sizes depend on the data (a boolean mask, ``nonzero``)
cannot be part of a static graph: what reads its outputs cannot be traced before it
has run. A program that calls one falls back to *sequential dispatch from that node
on*: the nodes traced before it still run as one registered program (its outputs are
every value they produce), then the body runs again on real arrays, its first calls
answered with that program's outputs (a replay) and the rest dispatched call by call —
without waiting, except that a call reading a data-dependent output waits until its
producer has run and reported the sizes. ``print(prog.graph(x))`` says so and names
the node; the trace marks it ("data-dependent output shapes: sequential dispatch").

Inside a program, arrays are symbolic: their shapes, dtypes and shardings are
known, their values are not. Python control flow on a value (``if x.result()``,
``bool(x)``) raises `CaptureError` pointing at the line: make the decision outside
the program, or express it in tensor ops.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from .array import Array
from .errors import CaptureError, PlacementError
from .tracing import (DataDependentNode, NodeRecord, Replay, SymbolicArray, Tracer, current_tracer, replaying,
                      tracing)

__all__ = ["program", "Program", "SymbolicArray", "ProgramGraph", "SequentialProgram", "current_tracer", "as_tuple"]

def as_tuple(value) -> tuple:
    """A call's outputs as a tuple: a function with one output returns it bare."""
    return value if isinstance(value, tuple) else (value,)


@dataclasses.dataclass
class ProgramGraph:
    """The traced program: inputs, nodes and outputs, by value number; prints as text."""

    name: str
    input_values: tuple[int, ...]
    layouts: dict                 # value → (shape, dtype, sharding, block)
    nodes: list[NodeRecord]
    output_values: tuple[int, ...]
    single_output: bool

    def __str__(self) -> str:
        def layout(v):
            shape, dtype, sharding, _ = self.layouts[v]
            spec = ", ".join(f"{a}: {p!r}" for a, p in zip(sharding.mesh.axis_names, sharding.placements))
            return f"{str(dtype).removeprefix('torch.')}{list(shape)} {{{spec}}} @mesh{sharding.mesh.allocation.mesh_id}"

        params = ", ".join(f"%{v}: {layout(v)}" for v in self.input_values)
        lines = [f"program {self.name}({params}) {{"]
        for node in self.nodes:
            outs = ", ".join(f"%{v}" for v in node.outputs)
            ins = ", ".join(f"%{v}" for v in node.inputs)
            lines.append(f"  {outs} = {node.version.name}({ins}) @mesh{node.mesh.allocation.mesh_id}"
                         f"  # {'; '.join(layout(v) for v in node.outputs)}")
        lines.append(f"  return {', '.join(f'%{v}' for v in self.output_values)}")
        lines.append("}")
        return "\n".join(lines)


@dataclasses.dataclass
class SequentialProgram:
    """A program that cannot be one static graph: from ``node`` on its output sizes depend on the data.

    ``prefix``: the nodes before it, as a program of their own (None when ``node`` is 0).
    """

    name: str
    node: int
    function: str
    prefix: "ProgramGraph | None" = None

    def __str__(self) -> str:
        before = "node 0 runs" if self.node == 1 else f"nodes 0-{self.node - 1} run"
        first = f"{before} as one program, then " if self.prefix is not None else ""
        return (f"program {self.name}: sequential dispatch — node {self.node} calls {self.function!r}, whose output "
                f"sizes depend on the data; {first}the body runs call by call from there, and a call that reads "
                f"such an output waits for its producer")


def program(fn: Callable | None = None, *, name: str | None = None):
    """Decorate a Python function that calls ``@pw.function``s; each call of it runs as one program."""
    if fn is None:
        return lambda f: Program(f, name=name)
    return Program(fn, name=name)


class Program:
    """A traced program; ``graph(*arrays)`` shows what a call would run."""

    def __init__(self, fn: Callable, *, name: str | None = None):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "program")
        self._graphs: dict[tuple, ProgramGraph] = {}
        functools.update_wrapper(self, fn)

    @property
    def num_traces(self) -> int:
        return len(self._graphs)

    def graph(self, *arrays: Array) -> "ProgramGraph | SequentialProgram":
        """The traced graph for these inputs (traced now if new), or why it runs call by call."""
        self._check_inputs(arrays)
        for a in arrays:
            a.learn_shape()
        # The mesh objects themselves (identity): a traced graph names its meshes, which belong
        # to one context; another context (or mesh) traces anew.
        key = tuple((a.shape, a.dtype, a.sharding.placements, a.mesh) for a in arrays)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._trace(arrays)
        return graph

    def __call__(self, *arrays: Array):
        graph = self.graph(*arrays)
        if isinstance(graph, SequentialProgram):
            return self._run_sequential(graph, arrays)
        outputs = arrays[0].dispatcher.run_program(graph, arrays)
        return outputs[0] if graph.single_output else tuple(outputs)

    def _run_sequential(self, plan: SequentialProgram, arrays):
        """Run the static prefix as one program, then the body call by call, replaying the prefix's calls."""
        replay = None
        if plan.prefix is not None:
            outputs = arrays[0].dispatcher.run_program(plan.prefix, arrays)
            by_value = dict(zip(plan.prefix.output_values, outputs))
            replay = Replay(self.name, [(n, [by_value[v] for v in n.outputs]) for n in plan.prefix.nodes])
        with replaying(replay):
            return self.fn(*arrays)

    def _check_inputs(self, arrays) -> None:
        if not arrays:
            raise PlacementError(f"program {self.name!r}: expected at least one pw.Array argument")
        for a in arrays:
            if not isinstance(a, Array):
                raise PlacementError(f"program {self.name!r}: every argument must be a pw.Array (made by ctx.put "
                                     f"or a call), got {type(a).__name__}; bake other values into the functions")

    def _prefix(self, tracer: Tracer, symbols) -> ProgramGraph | None:
        """The nodes traced before a data-dependent one, as a program whose outputs are all they produce."""
        if not tracer.nodes:
            return None
        produced = tuple(v for node in tracer.nodes for v in node.outputs)
        return ProgramGraph(f"{self.name}[:{len(tracer.nodes)}]", tuple(s.value for s in symbols), tracer.layouts,
                            list(tracer.nodes), produced, single_output=False)

    def _trace(self, arrays) -> ProgramGraph:
        tracer = Tracer(self.name)
        symbols = [tracer.new_value((a.shape, a.dtype, a.sharding, a.block_shape)) for a in arrays]
        try:
            with tracing(tracer):
                out = self.fn(*symbols)
        except DataDependentNode as stop:
            return SequentialProgram(self.name, stop.node, stop.function, self._prefix(tracer, symbols))
        single = not isinstance(out, (tuple, list))
        outs = [out] if single else list(out)
        for o in outs:
            if not isinstance(o, SymbolicArray) or o.tracer is not tracer:
                raise CaptureError(f"program {self.name!r} must return arrays computed inside it, got {o!r}")
        if not tracer.nodes:
            raise CaptureError(f"program {self.name!r} calls no @pw.function; it has nothing to run")
        return ProgramGraph(self.name, tuple(s.value for s in symbols), tracer.layouts, tracer.nodes,
                            tuple(o.value for o in outs), single)
