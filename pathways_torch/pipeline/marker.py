"""``pw.pipe_split()``: a marker in ``forward`` where one pipeline chunk ends and the next begins.

The marker is a ``torch.library`` op with no inputs and no outputs: tracing the model
records it as a node at the point it was called, between the ops before it and after
it. The splitter cuts the traced forward there; the op never reaches an executor.

A marker inside an ``if`` (or ``while``/``try``) would make the number of chunks depend
on a value the trace does not see again; it is refused with the line. Markers in a
``for`` loop over the blocks are fine: the loop is unrolled by the trace.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys

import torch

from ..errors import CaptureError

__all__ = ["pipe_split", "MARKER", "count_markers_into", "stop_counting_into"]


@torch.library.custom_op("pathways::pipe_split", mutates_args=())
def _marker() -> None:
    return None


@_marker.register_fake
def _() -> None:
    return None


MARKER = torch.ops.pathways.pipe_split.default


def pipe_split() -> None:
    """End the current pipeline chunk here (in a model's ``forward``; a no-op outside a pipeline trace)."""
    caller = sys._getframe(1)
    branch = _enclosing_branch(caller.f_code, caller.f_lineno)
    if branch is not None:
        raise CaptureError(f"pw.pipe_split() at {caller.f_code.co_filename}:{caller.f_lineno} is inside "
                           f"{branch}: the number of pipeline chunks must not depend on a branch; put the marker "
                           f"at the top level of forward (a for loop over the blocks is fine)")
    if _RECORDER:
        _RECORDER[-1].markers += 1
    torch.ops.pathways.pipe_split()


_RECORDER: list = []   # the recorders of the traces in progress; pipe_split counts into the innermost


def count_markers_into(recorder) -> None:
    """Until `stop_counting_into`, each ``pipe_split()`` call adds one to ``recorder.markers``."""
    _RECORDER.append(recorder)


def stop_counting_into(recorder) -> None:
    """End `count_markers_into`."""
    _RECORDER.remove(recorder)


@functools.lru_cache(maxsize=256)
def _enclosing_branch(code, line: int) -> str | None:
    """The kind and line of the ``if``/``while``/``try`` around ``line`` in ``code``'s source, or None."""
    try:
        lines, first = inspect.getsourcelines(code)
    except (OSError, TypeError):
        return None   # no source (a REPL, a zip): nothing to check
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except SyntaxError:
        return None
    target = line - first + 1
    kinds = {ast.If: "an if", ast.While: "a while loop", ast.Try: "a try block"}
    for node in ast.walk(tree):
        if type(node) in kinds:
            inner = [*node.body, *getattr(node, "orelse", []), *getattr(node, "handlers", []),
                     *getattr(node, "finalbody", [])]
            if any(s.lineno <= target <= getattr(s, "end_lineno", s.lineno) for s in inner):
                return f"{kinds[type(node)]} (line {node.lineno + first - 1})"
    return None
