"""Collectives inside a ``@pw.function``: explicit communication along a mesh axis.

Per-shard semantics (DESIGN §3) mean a function sees only its local block;
``pw.all_reduce(x.sum(), axis="data")`` is how a global sum is written. The axis
must be one of the mesh's axes; it is checked while the function is traced.
"""

from __future__ import annotations

import contextlib
import contextvars

from .errors import CaptureError

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "tracing_mesh"]

_MESH_AXES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("pathways_mesh_axes", default=None)


@contextlib.contextmanager
def tracing_mesh(axes: dict[str, int]):
    """Make the mesh's axes known to collectives called while a function is traced."""
    token = _MESH_AXES.set(dict(axes))
    try:
        yield
    finally:
        _MESH_AXES.reset(token)


def _axis_size(axis: str, what: str) -> int:
    axes = _MESH_AXES.get()
    if axes is None:
        raise CaptureError(f"pw.{what} can only be called inside a @pw.function that runs on a mesh")
    if axis not in axes:
        raise CaptureError(f"pw.{what}: the mesh has axes {list(axes)}, not {axis!r}; "
                           f"name one of its axes")
    return axes[axis]


def _ops():
    from .wire import collective_ops

    return collective_ops


def all_reduce(x, axis: str, op: str = "sum"):
    """Reduce ``x`` over the executors along ``axis`` (``op``: "sum", "mean" or "max"); every one gets the result."""
    ops = _ops()
    if op not in ops.REDUCE_OPS:
        raise CaptureError(f"pw.all_reduce: op must be one of {ops.REDUCE_OPS}, got {op!r}")
    _axis_size(axis, "all_reduce")
    return ops.all_reduce(x, axis, op)


def all_gather(x, axis: str, dim: int = 0):
    """Concatenate the blocks of the executors along ``axis`` on dimension ``dim``."""
    size = _axis_size(axis, "all_gather")
    return _ops().all_gather(x, axis, size, dim)


def reduce_scatter(x, axis: str, op: str = "sum", dim: int = 0):
    """Reduce over ``axis`` and keep this executor's 1/size slice of dimension ``dim``."""
    ops = _ops()
    if op not in ops.REDUCE_OPS:
        raise CaptureError(f"pw.reduce_scatter: op must be one of {ops.REDUCE_OPS}, got {op!r}")
    size = _axis_size(axis, "reduce_scatter")
    if x.shape[dim] % size:
        raise CaptureError(f"pw.reduce_scatter: dim {dim} of shape {list(x.shape)} is not divisible by the "
                           f"{size} executors of axis {axis!r}")
    return ops.reduce_scatter(x, axis, size, op, dim)
