"""Batch forms and model-returned losses (pathways_torch/training/batches.py), in process."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pathways_torch as pw
from pathways_torch.training.batches import forward_loss, loss_from_output, split_batch

pytestmark = pytest.mark.timeout(30)


@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    scale: float = 2.0


class Model(torch.nn.Module):
    def forward(self, input_ids, labels=None, scale=1.0):
        loss = (input_ids.float() * scale - labels.float()).pow(2).mean()
        return {"logits": input_ids.float(), "loss": loss}


def _call(module, tensors, args, kwargs=None):   # functional_call's signature, on the module as it is
    return module(*args, **(kwargs or {}))


def test_a_dataclass_is_passed_by_field_and_its_static_values_are_in_the_key():
    ids, labels = torch.arange(4).reshape(2, 2), torch.ones(2, 2)
    form, tensors = split_batch(Batch(ids, labels))
    assert form.kind == "kwargs" and [t is ids or t is labels for t in tensors] == [True, True]
    assert "2.0" in form.key and split_batch(Batch(ids, labels, scale=3.0))[0].key != form.key
    loss = forward_loss(_call, Model(), None, {}, form, tensors)
    assert loss == (ids.float() * 2.0 - labels).pow(2).mean()


def test_dicts_tuples_and_tensors_keep_their_forms():
    x, y = torch.zeros(2, 3), torch.ones(2)
    assert split_batch({"x": x, "y": y})[0].kind == "kwargs"
    assert split_batch((x, y))[0].kind == "args" and split_batch([x, y])[0].kind == "args"
    form, tensors = split_batch(x)
    assert form.kind == "tensor" and form.rebuild(tensors) is x
    nested, leaves = split_batch({"pair": [x, y], "flag": True})
    assert len(leaves) == 2 and nested.rebuild(leaves) == {"pair": [x, y], "flag": True}


def test_bad_batches_are_refused_with_what_was_expected():
    with pytest.raises(pw.PlacementError, match="holds no tensor"):
        split_batch({"flag": True})
    with pytest.raises(pw.PlacementError, match="batch leaf 0 is a object"):
        split_batch((object(),))
    with pytest.raises(pw.PlacementError, match="expected a batch as a tuple"):
        split_batch(7)


def test_the_loss_a_model_returns_is_found_in_the_usual_places():
    loss = torch.tensor(0.5)
    model = torch.nn.Identity()
    assert loss_from_output(loss, model) is loss
    assert loss_from_output({"loss": loss, "logits": torch.ones(2)}, model) is loss
    assert loss_from_output((torch.ones(2, 3), loss), model) is loss              # nanoGPT's (logits, loss)
    output = type("Out", (), {"loss": loss})()
    assert loss_from_output(output, model) is loss                              # transformers' .loss
    with pytest.raises(pw.CaptureError, match="must return its loss.*a tensor of shape \\[2, 3\\]"):
        loss_from_output(torch.ones(2, 3), model)
    with pytest.raises(pw.CaptureError, match="whose .loss is None"):
        loss_from_output(type("Out", (), {"loss": None})(), model)
