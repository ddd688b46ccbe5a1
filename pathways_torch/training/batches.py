"""Batches as the ecosystem writes them, and losses as models return them.

A batch may be:

- a tuple or list ``(*inputs, target)``: ``loss_fn(model(*inputs), target)``, or
  ``model(*batch)`` when ``loss_fn`` is None;
- a dict (any ``Mapping``, e.g. a Hugging Face ``BatchEncoding``) passed as keywords:
  ``model(**batch)``, then ``loss_fn(output, batch)`` or the model's own loss;
- a dataclass instance, passed as keywords by field like a dict;
- a single tensor: ``model(batch)`` (its own loss), or ``loss_fn(model(), batch)``.

Tensor leaves (nested lists and dicts are walked) are split on dim 0 over the data axis;
other leaves (int, float, bool, str, None) are static: part of the compile key. Without
``loss_fn`` the model's output is its loss: a 0-d tensor, an object with ``.loss``
(``transformers``' outputs), a mapping with ``"loss"``, or a tuple holding exactly one
0-d floating tensor (nanoGPT's ``(logits, loss)``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from ..errors import CaptureError, PlacementError

__all__ = ["BatchForm", "split_batch", "forward_loss", "forward_output", "loss_from_output"]

_STATIC_TYPES = (int, float, bool, str, type(None))


@dataclasses.dataclass(frozen=True)
class BatchForm:
    """How a batch was built: rebuilt inside the captured step from its tensor leaves."""

    kind: str                  # "tensor", "args" or "kwargs"
    treespec: Any              # torch.utils._pytree.TreeSpec of the leaves
    statics: tuple             # (leaf index, value) of every non-tensor leaf
    key: str                   # printable and hashable: the form in the compile key

    def rebuild(self, tensors: list):
        """The batch's content with ``tensors`` at its tensor leaves: a list (args), a dict (kwargs) or a tensor."""
        from torch.utils._pytree import tree_unflatten

        leaves, it, statics = [], iter(tensors), dict(self.statics)
        for index in range(self.treespec.num_leaves):
            leaves.append(statics[index] if index in statics else next(it))
        return tree_unflatten(leaves, self.treespec)


def split_batch(batch) -> tuple[BatchForm, list]:
    """The batch's form and its tensor leaves, in order."""
    import torch
    from torch.utils._pytree import tree_flatten

    if isinstance(batch, torch.Tensor):
        kind, content = "tensor", batch
    elif isinstance(batch, Mapping):
        kind, content = "kwargs", dict(batch)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        kind, content = "kwargs", {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    elif isinstance(batch, (tuple, list)):
        kind, content = "args", list(batch)
    else:
        raise PlacementError(f"trainer.step: expected a batch as a tuple (*inputs, target), a dict of keyword "
                             f"arguments, a dataclass or a tensor, got {type(batch).__name__}")
    leaves, treespec = tree_flatten(content)
    tensors, statics = [], []
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
        elif isinstance(leaf, _STATIC_TYPES):
            statics.append((index, leaf))
        else:
            raise PlacementError(f"trainer.step: batch leaf {index} is a {type(leaf).__name__}; expected tensors "
                                 f"(split over the data axis) or static int/float/bool/str/None values")
    if not tensors:
        raise PlacementError(f"trainer.step: the batch ({type(batch).__name__}) holds no tensor")
    return BatchForm(kind, treespec, tuple(statics), f"{kind}:{treespec}:{statics!r}"), tensors


def forward_loss(functional_call, model, loss_fn: Callable | None, tensors: dict, form: BatchForm, leaves: list):
    """The loss of one shard's batch (see the module docstring for the forms)."""
    if loss_fn is None:
        return loss_from_output(forward_output(functional_call, model, tensors, form, leaves), model)
    content = form.rebuild(leaves)
    if form.kind == "kwargs":
        return loss_fn(functional_call(model, tensors, (), content), content)
    args = [content] if form.kind == "tensor" else content
    return loss_fn(functional_call(model, tensors, tuple(args[:-1])), args[-1])


def forward_output(functional_call, model, tensors: dict, form: BatchForm, leaves: list):
    """The model on the whole batch: ``model(**batch)``, ``model(*batch)`` or ``model(batch)``."""
    content = form.rebuild(leaves)
    if form.kind == "kwargs":
        return functional_call(model, tensors, (), content)
    return functional_call(model, tensors, (content,) if form.kind == "tensor" else tuple(content))


def loss_from_output(output, model):
    """The loss a model returned itself."""
    import torch

    if isinstance(output, torch.Tensor):
        candidates = [output] if output.dim() == 0 else []
    elif getattr(output, "loss", None) is not None:
        candidates = [output.loss]
    elif isinstance(output, Mapping) and output.get("loss") is not None:
        candidates = [output["loss"]]
    elif isinstance(output, (tuple, list)):
        candidates = [o for o in output if isinstance(o, torch.Tensor) and o.dim() == 0 and o.is_floating_point()]
    else:
        candidates = []
    if len(candidates) != 1:
        raise CaptureError(
            f"{type(model).__name__}: with loss_fn=None the model must return its loss (a 0-d tensor, an output "
            f"with .loss, a dict with 'loss', or a tuple with exactly one 0-d float tensor); it returned "
            f"{_describe(output)}. Fix: pass loss_fn=..., or labels the model computes its loss from")
    return candidates[0]


def _describe(output) -> str:
    import torch

    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {list(output.shape)}"
    if isinstance(output, (tuple, list)):
        return f"a {type(output).__name__} of {len(output)}"
    loss = getattr(output, "loss", "absent")
    return f"a {type(output).__name__}" + (" whose .loss is None" if loss is None else "")
