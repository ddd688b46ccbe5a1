"""Evaluation and inference on the parameters where they live: no gradient, no update, no round trip.

`make_forward` returns a per-shard function over the trainer's state arrays and a
batch, captured like the training step (once per batch shape and form):

    inputs : flat parameter buckets · module buffers · frozen parameters · rank · the batch's tensor leaves
    outputs: "loss" — the mean loss over the global batch (replicated), as the step computes it;
             "predict" — the model's output tensors, flattened (each sharded on dim 0 over the data axis)

The model runs in eval mode (``model.eval()`` while tracing, restored after): dropout
off, BatchNorm on its running statistics. A buffer the forward updates is not written
back (evaluation leaves the training state as it was).
"""

from __future__ import annotations

import contextlib
from typing import Callable

from ..collectives import all_reduce
from .batches import forward_loss, forward_output
from .step import batch_form, gathered_params

__all__ = ["make_forward", "eval_mode"]


@contextlib.contextmanager
def eval_mode(model):
    """``model.eval()`` within, each module's own mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.train(training)


def make_forward(model, loss_fn: Callable | None, layout, plan, num_shards: int, kind: str, batch_forms: dict,
                 output_specs: dict, tensor=None) -> Callable:
    """The per-shard forward (``kind`` "loss" or "predict"); see the module docstring. ``output_specs``
    receives, per batch form, the pytree spec of the model's output (for `predict` to rebuild it).
    ``tensor``: as `step.make_step` takes it (the model rank follows the rank)."""
    import torch
    from torch.func import functional_call
    from torch.utils._pytree import tree_flatten

    buckets = layout.buckets

    def forward(*tensors, static_key=None):
        it = iter(tensors)
        flats = [next(it) for _ in buckets]
        buffers = {name: next(it).clone() for name in layout.buffer_names}   # updates stay local
        frozen = {name: next(it) for name in layout.frozen_names}
        next(it)   # rank: the batch is this shard's already
        model_rank = next(it) if tensor is not None else None
        batch = list(it)
        form = batch_form(batch_forms, static_key, batch)
        state = {**gathered_params(buckets, flats, plan, num_shards), **frozen, **buffers}
        lowered = tensor.lowered(model, model_rank) if tensor is not None else contextlib.nullcontext()
        with torch.no_grad(), eval_mode(model), lowered:
            if kind == "loss":
                loss = forward_loss(functional_call, model, loss_fn, state, form, batch).detach()
                return all_reduce(loss, plan.axis, "mean") if num_shards > 1 else loss
            output = forward_output(functional_call, model, state, form, batch)
        leaves, spec = tree_flatten(output)
        # The spec and the non-tensor leaves (static in the trace), for the client to rebuild the output.
        output_specs[form.key] = (spec, [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves],
                                  [isinstance(leaf, torch.Tensor) for leaf in leaves])
        tensors_out = tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))
        if not tensors_out:
            raise TypeError(f"{type(model).__name__}: predict found no tensor in the model's output")
        return tensors_out

    forward.__name__ = f"{kind}[{type(model).__name__}]"
    return forward
