"""The training step cut per gradient bucket: buckets from the last parameter to the first, segments that
together compute exactly what the whole step does, in the order the backward completes the buckets."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from pathways_torch.training.bucket_cut import cut_per_bucket
from pathways_torch.training.buckets import make_buckets, split_for_exchange

pytestmark = pytest.mark.timeout(60)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 2)).double()


def test_pieces_run_from_the_last_parameter_to_the_first_under_the_cap():
    model = _model()
    (bucket,), _ = make_buckets(model, torch.optim.SGD(model.parameters(), lr=0.1))
    pieces = split_for_exchange([bucket], cap_bytes=8 * 40, first_cap_bytes=8 * 20)
    # 3.weight (64 values) is over the cap: a piece of its own
    assert [[s.name for s in p.slots] for p in pieces] == [
        ["5.weight", "5.bias"], ["3.bias"], ["3.weight"], ["0.bias", "1.weight", "1.bias"], ["0.weight"]]
    assert all(p.slots[0].offset == 0 for p in pieces)
    assert sum(p.numel for p in pieces) == bucket.numel


def _joint(model, buckets):
    from torch.func import functional_call, grad_and_value

    from pathways_torch.training.buckets import flatten, unflatten

    names = [n for n, _ in model.named_buffers()]

    def joint(*tensors):
        flats, buffers, (x, y) = tensors[:len(buckets)], tensors[len(buckets):-2], tensors[-2:]
        params = {}
        for b, f in zip(buckets, flats):
            params.update(unflatten(b, f))

        def loss_of(params, buffers):
            buffers = {n: t.clone() for n, t in zip(names, buffers)}
            out = functional_call(model, {**params, **buffers}, (x,))
            return nn.functional.mse_loss(out, y), buffers

        grads, (loss, new) = grad_and_value(loss_of, has_aux=True)(params, list(buffers))
        return (loss, *[flatten(b, grads) for b in buckets], *[new[n] for n in names])

    return joint


def test_running_the_segments_in_order_gives_the_whole_step():
    model = _model().train()
    (bucket,), _ = make_buckets(model, torch.optim.SGD(model.parameters(), lr=0.1))
    buckets = split_for_exchange([bucket], cap_bytes=8 * 40, first_cap_bytes=8 * 20)
    named = dict(model.named_parameters())
    flats = [torch.cat([named[s.name].detach().reshape(-1) for s in b.slots]) for b in buckets]
    buffers = [b.clone() for b in model.buffers()]
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    inputs = [*flats, *buffers, x, y]
    joint = _joint(model, buckets)
    cut = cut_per_bucket(joint, inputs, len(buckets), {})
    assert cut.bucket_order == (0, 1, 2, 3, 4)
    text = str(cut).splitlines()
    assert [line.split(":")[0] for line in text] == [f"segment {k} (bucket {k})" for k in range(5)]
    assert "returns outputs [0, 1] and" in text[0] and "returns outputs [5, 6, 7, 8] and" in text[4]
    assert cut.segments[0].inputs[-2:] == (len(inputs) - 2, len(inputs) - 1)   # the forward reads the batch
    assert all(not s.inputs or max(s.inputs) < len(inputs) for s in cut.segments)
    carried, got = {}, {}
    for segment in cut.segments:
        values = segment.graph_module(*[inputs[i] for i in segment.inputs], *[carried[n] for n in segment.carried_in])
        carried.update(zip(segment.carried_out, values))
        got.update(zip(segment.outputs, values[len(segment.carried_out):]))
    expected = joint(*inputs)
    assert sorted(got) == list(range(len(expected)))
    for index, value in enumerate(expected):
        torch.testing.assert_close(got[index], value, rtol=0, atol=1e-12)
