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
The ``pathways::`` collectives have no autograd formula of their own: these Functions are theirs, and
call them under ``no_grad`` (in the backward too, which functorch runs with gradients recorded).
"""

from __future__ import annotations

import torch

from ..collectives import all_gather, all_reduce, reduce_scatter

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


class _Enter(torch.autograd.Function):
    """f: the identity forward; the gradient, a partial sum on each shard, all-reduced."""

    @staticmethod
    def forward(x, axis):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.axis = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        with torch.no_grad():
            return all_reduce(grad, ctx.axis, "sum"), None


class _Reduce(torch.autograd.Function):
    """g: the partial sums all-reduced forward; the (same on every shard) gradient passed through."""

    @staticmethod
    def forward(x, axis):
        with torch.no_grad():      # the op itself has no autograd formula: this Function is its formula
            return all_reduce(x, axis, "sum")

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Gather(torch.autograd.Function):
    """S(dim) → R: all-gather forward; this shard's slice of the gradient backward."""

    @staticmethod
    def forward(x, axis, dim, size, chunks, rank):
        with torch.no_grad():
            return gathered(x, axis, dim, size, chunks)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.axis, ctx.dim, ctx.size, ctx.chunks, rank = inputs
        ctx.save_for_backward(rank)

    @staticmethod
    def backward(ctx, grad):
        (rank,) = ctx.saved_tensors
        return local_slice(grad, ctx.dim, ctx.size, ctx.chunks, rank), None, None, None, None, None


class _Slice(torch.autograd.Function):
    """R → S(dim): this shard's slice forward; the gradient all-gathered backward."""

    @staticmethod
    def forward(x, axis, dim, size, chunks, rank):
        return local_slice(x, dim, size, chunks, rank)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.axis, ctx.dim, ctx.size, ctx.chunks, _ = inputs

    @staticmethod
    def backward(ctx, grad):
        with torch.no_grad():
            return gathered(grad, ctx.axis, ctx.dim, ctx.size, ctx.chunks), None, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    """P → S(dim): reduce-scatter forward; the gradient all-gathered backward."""

    @staticmethod
    def forward(x, axis, dim, size, chunks):
        with torch.no_grad():
            return _scattered(x, axis, dim, size, chunks)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.axis, ctx.dim, ctx.size, ctx.chunks = inputs

    @staticmethod
    def backward(ctx, grad):
        with torch.no_grad():
            return gathered(grad, ctx.axis, ctx.dim, ctx.size, ctx.chunks), None, None, None, None


def enter(x, axis: str):
    return _Enter.apply(x, axis)


def reduce(x, axis: str):
    return _Reduce.apply(x, axis)


def gather(x, axis: str, dim: int, size: int, rank, chunks: int = 1):
    return _Gather.apply(x, axis, dim, size, chunks, rank)


def take_slice(x, axis: str, dim: int, size: int, rank, chunks: int = 1):
    return _Slice.apply(x, axis, dim, size, chunks, rank)


def reduce_scatter_to(x, axis: str, dim: int, size: int, chunks: int = 1):
    return _ReduceScatter.apply(x, axis, dim, size, chunks)
