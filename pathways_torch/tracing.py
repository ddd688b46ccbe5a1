"""Tracer state: whether a ``@pw.program`` body is being traced or replayed, and the user's call site.

`Function` asks this module what to do with a call (record a node in the current trace, answer it from a
sequential program's replay, or dispatch it); `Program` sets the state while it traces or replays a body.
Both import it; it imports neither (so the two do not import each other).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import linecache
import os
import sys

from .errors import CaptureError
from .placement import Sharding

__all__ = ["Tracer", "SymbolicArray", "NodeRecord", "Replay", "DataDependentNode", "current_tracer",
           "replayed_call", "tracing", "replaying", "call_site"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

_TRACER: contextvars.ContextVar["Tracer | None"] = contextvars.ContextVar("pathways_program_tracer", default=None)
_REPLAY: contextvars.ContextVar["Replay | None"] = contextvars.ContextVar("pathways_program_replay", default=None)


def current_tracer() -> "Tracer | None":
    """The trace a ``@pw.program`` body is recording into on this thread, or None."""
    return _TRACER.get()


def replayed_call(function):
    """Inside a sequential program's replay: the outputs of the prefix node this call stands for, or None."""
    replay = _REPLAY.get()
    return None if replay is None else replay.take(function)


class SymbolicArray:
    """A value inside a program trace: layout known, value not."""

    def __init__(self, tracer: "Tracer", value: int, shape, dtype, sharding: Sharding, block_shape):
        self.tracer, self.value = tracer, value
        self.shape, self.dtype, self.sharding, self.block_shape = tuple(shape), dtype, sharding, tuple(block_shape)

    @property
    def mesh(self):
        return self.sharding.mesh

    def _no_value(self, what: str):
        raise CaptureError(
            f"{what} needs the value of %{self.value} inside @pw.program {self.tracer.name!r}, which is not known "
            f"while the program is traced; decide outside the program (run it, then look at the result), or "
            f"express the choice with tensor ops (torch.where)\nat:\n{call_site()}")

    def result(self, *args, **kwargs):
        self._no_value("result()")

    def done(self):
        self._no_value("done()")

    def exception(self, *args, **kwargs):
        self._no_value("exception()")

    def __bool__(self):
        self._no_value("bool()")

    def __index__(self):
        self._no_value("int()")

    def __float__(self):
        self._no_value("float()")

    def __repr__(self) -> str:
        return f"%{self.value}"


@dataclasses.dataclass(frozen=True)
class NodeRecord:
    """One call recorded in a trace: a node of the program graph."""

    index: int
    function: object          # the Function
    version: object           # its CapturedVersion
    mesh: object              # the Mesh it runs on
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    layouts: tuple            # (shape, dtype, sharding, block) per output


class Replay:
    """Answers a sequential program's first calls with the outputs of its prefix program, in trace order."""

    def __init__(self, name: str, calls: list[tuple["NodeRecord", list]]):
        self._name, self._calls, self._next = name, calls, 0   # (traced node, its output arrays)

    def take(self, function):
        if self._next >= len(self._calls):
            return None
        node, outputs = self._calls[self._next]
        # `.on(mesh)` copies share the trace cache: that is the function's identity.
        if node.function.traces is not function.traces:
            raise CaptureError(f"program {self._name!r} called {function.name!r} where its trace called "
                               f"{node.function.name!r}; a program body must call the same functions in the same "
                               f"order every time it runs")
        self._next += 1
        return outputs[0] if node.version.single_output else tuple(outputs)


class DataDependentNode(Exception):
    """Raised inside a program trace at the first node with data-dependent output sizes."""

    def __init__(self, node: int, function: str):
        super().__init__(function)
        self.node, self.function = node, function


class Tracer:
    """One program trace: the layout of every value, and the nodes recorded so far."""

    def __init__(self, name: str):
        self.name = name
        self.layouts: dict[int, tuple] = {}
        self.nodes: list[NodeRecord] = []
        self._next_value = 0

    def new_value(self, layout) -> SymbolicArray:
        value = self._next_value
        self._next_value += 1
        self.layouts[value] = layout
        return SymbolicArray(self, value, *layout)

    def add_node(self, function, version, mesh, inputs, layouts) -> list[SymbolicArray]:
        if version.data_dependent:
            raise DataDependentNode(len(self.nodes), version.name)
        outs = [self.new_value(layout) for layout in layouts]
        self.nodes.append(NodeRecord(len(self.nodes), function, version, mesh, tuple(a.value for a in inputs),
                                     tuple(o.value for o in outs), tuple(layouts)))
        return outs


@contextlib.contextmanager
def tracing(tracer: Tracer):
    """Inside: every ``@pw.function`` call records a node in ``tracer`` instead of dispatching."""
    token = _TRACER.set(tracer)
    try:
        yield tracer
    finally:
        _TRACER.reset(token)


@contextlib.contextmanager
def replaying(replay: "Replay | None"):
    """Inside: the first calls are answered from ``replay`` (a sequential program's prefix outputs)."""
    token = _REPLAY.set(replay)
    try:
        yield
    finally:
        _REPLAY.reset(token)


def call_site() -> str:
    """The innermost frame outside pathways_torch, formatted like a traceback line.

    Taken on every call (errors name it), so both questions — is a code object ours, what
    does a line say — are answered once and remembered.
    """
    frame = sys._getframe(1)
    while frame is not None and _is_ours(frame.f_code):
        frame = frame.f_back
    if frame is None:
        return ""
    key = (frame.f_code, frame.f_lineno)
    site = _SITES.get(key)
    if site is None:
        filename, lineno = frame.f_code.co_filename, frame.f_lineno
        line = linecache.getline(filename, lineno).strip()
        site = f'  File "{filename}", line {lineno}, in {frame.f_code.co_name}\n    {line}\n'
        if len(_SITES) < _MAX_SITES:
            _SITES[key] = site
    return site


def _is_ours(code) -> bool:
    ours = _OURS.get(code)
    if ours is None:
        ours = _OURS[code] = os.path.abspath(code.co_filename).startswith(_PACKAGE_DIR)
    return ours


_SITES: dict = {}
_OURS: dict = {}
_MAX_SITES = 4096
