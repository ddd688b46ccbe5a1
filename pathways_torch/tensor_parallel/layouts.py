"""Moving a local tensor between layouts on the model axis, with the gradient each move needs (Megatron's f and g).

Every shard computes the same loss, and the gradient it computes is of that one loss, so two rules hold
for every tensor of the forward, and every move below keeps them:

- a whole tensor (``R``) has the same gradient on every shard;
- a split tensor (``S(dim)``) has, on each shard, its own slice of the gradient.

Hence: entering a column-parallel module, a whole input's gradient is a partial sum there and is
all-reduced in the backward (`enter`, Megatron's f); a row-parallel module's partial output is
all-reduced in the forward and passed through in the backward (`reduce`, Megatron's g); gathering a
split tensor keeps this shard's slice of the gradient (`gather`), and slicing a whole one gathers it
(`take_slice`); a partial output reduce-scattered on ``dim`` gathers its gradient back (`reduce_scatter`).

A fused tensor (``chunks`` tensors side by side on ``dim``) moves chunk by chunk: each chunk is split on
its own. This shard's index on the axis is ``rank`` (an int64 tensor of one element): slicing by it is a
gather (``index_select``), which the capture keeps as a tensor op, not a number fixed at trace time.
The ``pathways::`` collectives have no autograd formula of their own: these moves' registered
gradients are theirs.
"""

from __future__ import annotations

import torch

from ..capture import DECOMPOSITIONS
from ..collectives import all_gather, all_reduce, reduce_scatter
from ..stop_gradient import differentiable

__all__ = ["enter", "reduce", "gather", "take_slice", "reduce_scatter_to", "local_slice", "gathered"]


def local_slice(x, dim: int, size: int, chunks: int, rank):
    """This shard's slice of the whole ``x`` on ``dim`` (of every chunk)."""
    dim = dim % x.dim()
    parts = x.unflatten(dim, (chunks, size, x.shape[dim] // (chunks * size)))
    return parts.index_select(dim + 1, rank).flatten(dim, dim + 2)


def gathered(x, axis: str, dim: int, size: int, chunks: int):
    """The whole of ``x`` from every shard's slice on ``dim`` (chunk by chunk)."""
    dim = dim % x.dim()
    if chunks == 1:
        return all_gather(x, axis, dim)
    parts = x.unflatten(dim, (chunks, x.shape[dim] // chunks))
    return all_gather(parts, axis, dim + 1).flatten(dim, dim + 1)


def _scattered(x, axis: str, dim: int, size: int, chunks: int):
    dim = dim % x.dim()
    if chunks == 1:
        return reduce_scatter(x, axis, "sum", dim)
    parts = x.unflatten(dim, (chunks, x.shape[dim] // chunks))
    return reduce_scatter(parts, axis, "sum", dim + 1).flatten(dim, dim + 1)


# The moves are ops of their own (``pathways_tp::``) with their gradients registered on the op, not
# autograd Functions: a pipeline traces the forward to aten first and derives each chunk's backward from
# that graph later (`pipeline.autograd`), so the gradient rule must travel with the op in the graph. A
# captured step holds none of them: `capture` decomposes each into its forward (`DECOMPOSITIONS`), the
# ``pathways::`` collectives and aten ops the executors run.

def _enter_forward(x, axis):
    return x.view_as(x)


def _reduce_forward(x, axis):
    return all_reduce(x, axis, "sum")


def _gather_forward(x, axis, dim, size, chunks, rank):
    return gathered(x, axis, dim, size, chunks)


def _slice_forward(x, axis, dim, size, chunks, rank):
    return local_slice(x, dim, size, chunks, rank)


def _scatter_forward(x, axis, dim, size, chunks, rank):
    return _scattered(x, axis, dim, size, chunks)


def _resized(x, dim: int, factor: float):
    shape = list(x.shape)
    shape[dim % x.dim()] = int(shape[dim % x.dim()] * factor)
    return x.new_empty(shape)


@torch.library.custom_op("pathways_tp::enter", mutates_args=())
def _enter_op(x: torch.Tensor, axis: str) -> torch.Tensor:
    """f: the identity forward; the gradient, a partial sum on each shard, all-reduced."""
    return _enter_forward(x, axis).clone()      # an op's output may not alias its input when run eagerly


@torch.library.custom_op("pathways_tp::reduce", mutates_args=())
def _reduce_op(x: torch.Tensor, axis: str) -> torch.Tensor:
    """g: the partial sums all-reduced forward; the (same on every shard) gradient passed through."""
    return _reduce_forward(x, axis)


@torch.library.custom_op("pathways_tp::gather", mutates_args=())
def _gather_op(x: torch.Tensor, axis: str, dim: int, size: int, chunks: int, rank: torch.Tensor) -> torch.Tensor:
    """S(dim) → R: all-gather forward; this shard's slice of the gradient backward."""
    return _gather_forward(x, axis, dim, size, chunks, rank)


@torch.library.custom_op("pathways_tp::slice", mutates_args=())
def _slice_op(x: torch.Tensor, axis: str, dim: int, size: int, chunks: int, rank: torch.Tensor) -> torch.Tensor:
    """R → S(dim): this shard's slice forward; the gradient all-gathered backward."""
    return _slice_forward(x, axis, dim, size, chunks, rank)


@torch.library.custom_op("pathways_tp::reduce_scatter", mutates_args=())
def _scatter_op(x: torch.Tensor, axis: str, dim: int, size: int, chunks: int, rank: torch.Tensor) -> torch.Tensor:
    """P → S(dim): reduce-scatter forward; the gradient all-gathered backward."""
    return _scatter_forward(x, axis, dim, size, chunks, rank)


_enter_op.register_fake(lambda x, axis: torch.empty_like(x))
_reduce_op.register_fake(lambda x, axis: torch.empty_like(x))
_gather_op.register_fake(lambda x, axis, dim, size, chunks, rank: _resized(x, dim, size))
_slice_op.register_fake(lambda x, axis, dim, size, chunks, rank: _resized(x, dim, 1 / size))
_scatter_op.register_fake(lambda x, axis, dim, size, chunks, rank: _resized(x, dim, 1 / size))


def _enter_backward(ctx, grad):
    return _reduce_op(grad, ctx.args[0]), None


def _reduce_backward(ctx, grad):
    return grad, None


def _gather_backward(ctx, grad):
    axis, dim, size, chunks, rank = ctx.args
    return local_slice(grad, dim, size, chunks, rank), None, None, None, None, None


def _gathered_backward(ctx, grad):
    """Slicing's and reduce-scattering's: the split gradient gathered whole."""
    axis, dim, size, chunks, rank = ctx.args
    return _gather_op(grad, axis, dim, size, chunks, rank), None, None, None, None, None


_MOVES = {op: differentiable(op, backward) for op, backward in (
    (_enter_op, _enter_backward), (_reduce_op, _reduce_backward), (_gather_op, _gather_backward),
    (_slice_op, _gathered_backward), (_scatter_op, _gathered_backward))}

DECOMPOSITIONS.update({
    torch.ops.pathways_tp.enter.default: _enter_forward,
    torch.ops.pathways_tp.reduce.default: _reduce_forward,
    torch.ops.pathways_tp.gather.default: _gather_forward,
    torch.ops.pathways_tp.slice.default: _slice_forward,
    torch.ops.pathways_tp.reduce_scatter.default: _scatter_forward,
})   # each move's forward as collectives and aten ops: what a captured step runs in its place


def enter(x, axis: str):
    return _MOVES[_enter_op].apply(x, axis)


def reduce(x, axis: str):
    return _MOVES[_reduce_op].apply(x, axis)


def gather(x, axis: str, dim: int, size: int, rank, chunks: int = 1):
    return _MOVES[_gather_op].apply(x, axis, dim, size, chunks, rank)


def take_slice(x, axis: str, dim: int, size: int, rank, chunks: int = 1):
    return _MOVES[_slice_op].apply(x, axis, dim, size, chunks, rank)


def reduce_scatter_to(x, axis: str, dim: int, size: int, rank, chunks: int = 1):
    return _MOVES[_scatter_op].apply(x, axis, dim, size, chunks, rank)
