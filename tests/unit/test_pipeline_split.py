"""The model cut into chunks and each chunk's forward/backward graphs, in process: text of the split,
numerics of the partitioned graphs against autograd, what is saved, and the refusals."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

import pathways_torch as pw
from pathways_torch.pipeline.autograd import partition_chunk
from pathways_torch.pipeline.split import balanced_boundaries, find_blocks, split_model
from pathways_torch.training.batches import split_batch

pytestmark = pytest.mark.timeout(60)


def _mlp(depth=4, width=6):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)],
                         nn.Linear(width, 3)).double()


def _split(model, num_chunks, rows=4, loss_fn=nn.MSELoss()):
    x, y = torch.randn(rows, 6, dtype=torch.float64), torch.randn(rows, 3, dtype=torch.float64)
    form, leaves = split_batch((x, y))
    names = [n for n, _ in model.named_parameters()]
    return split_model(model, loss_fn, form, leaves, trained=names, constants=[], num_chunks=num_chunks), x, y


def test_balanced_boundaries_minimise_the_largest_chunk():
    assert balanced_boundaries([1, 1, 1, 1], 2) == [2]
    assert balanced_boundaries([5, 1, 1, 1, 1, 1], 2) == [1]
    assert balanced_boundaries([1, 1, 4, 1, 1], 3) == [2, 3]
    with pytest.raises(pw.PlacementError, match="4 chunks need at least 4 blocks, the model has 3"):
        balanced_boundaries([1, 1, 1], 4)


def test_the_block_list_is_found_where_models_keep_it():
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8,
                                                                n_layer=2, n_head=2))
    name, blocks = find_blocks(gpt2)
    assert name == "transformer.h" and len(blocks) == 2
    assert find_blocks(_mlp())[0] == ""
    with pytest.raises(pw.PlacementError, match="has no block list to split"):
        find_blocks(nn.Linear(2, 2))


def test_split_prints_which_module_went_where():
    model = _mlp()
    split, _, _ = _split(model, 2)
    numel = {n: p.numel() for n, p in model.named_parameters()}
    assert split.describe(numel).splitlines() == [
        "2 chunks, cut at the blocks of the nn.Sequential",
        "chunk 0 (rank 0): 84 parameters; 0, 1; sends 1 value(s)",
        "chunk 1 (rank 1): 105 parameters; 2, 3, 4 + loss; sends 0 value(s)"]
    first, last = split.chunks
    assert first.outgoing == last.incoming and first.batch_leaves == (0,) and last.batch_leaves == (1,)


def test_partitioned_forward_and_backward_equal_autograd():
    model = _mlp()
    split, x, y = _split(model, 2)
    expected = nn.MSELoss()(model(x), y)
    expected.backward()
    loss, grads = _chunked_loss_and_grads(split, model, x, y)
    assert torch.equal(loss, expected.detach())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-12, msg=name)


def _chunked_loss_and_grads(split, model, x, y):
    """The loss and every parameter's gradient, from each chunk's partitioned forward and backward in turn."""
    params = dict(model.named_parameters())
    grads, incoming = {}, []
    parts = []
    for chunk in split.chunks:
        inputs = [params[n].detach() for n in chunk.params] + [(x, y)[i] for i in chunk.batch_leaves] + incoming
        autograd = partition_chunk(chunk, inputs, set(range(len(chunk.params))), 1.0)
        out = autograd.forward(*inputs)
        parts.append((chunk, autograd, inputs, out))
        incoming = list(out[:len(chunk.outgoing)])
    loss = parts[-1][3][parts[-1][1].num_outputs - 1]
    grad_out = []
    for chunk, autograd, inputs, out in reversed(parts):
        seed = [torch.tensor(1.0, dtype=torch.float64)] if chunk.has_loss else []
        result = autograd.backward(*out[autograd.num_outputs:], *[inputs[i] for i in autograd.backward_params],
                                   *grad_out, *seed)
        by_input = dict(zip(autograd.differentiable, result))
        grads.update({n: by_input[i] for i, n in enumerate(chunk.params)})
        first_incoming = len(inputs) - len(chunk.incoming)
        grad_out = [by_input[i] for i in sorted(by_input) if i >= first_incoming]
    return loss, grads


class _RoundStraightThrough(torch.autograd.Function):
    """Forward: round; backward: the gradient as it came (a straight-through estimator), old-style."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ScaledRoundStraightThrough(torch.autograd.Function):
    """New-style (``setup_context``), with a non-tensor argument, a saved tensor and two outputs."""

    @staticmethod
    def forward(x, scale):
        return torch.round(x * scale), x.sum()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.scale = inputs[1]
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad, grad_sum):
        (x,) = ctx.saved_tensors
        return grad * ctx.scale + grad_sum * torch.cos(x), None


_GRADIENTS_OFF = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
                  "set_grad_enabled": lambda: torch.set_grad_enabled(False)}


class _EagerOnlyGradient(nn.Module):
    """A block whose gradient eager takes by a rule the forward's ops do not show: a user's autograd Function's
    backward, or none through a term computed where gradients are off."""

    def __init__(self, how: str):
        super().__init__()
        self.fc, self.how = nn.Linear(6, 6), how

    def forward(self, x):
        y = self.fc(x)
        if self.how == "straight_through":
            return y + _RoundStraightThrough.apply(y * 3)
        if self.how == "straight_through_setup_context":
            rounded, total = _ScaledRoundStraightThrough.apply(y, 3.0)
            return y + rounded + total
        with _GRADIENTS_OFF[self.how]():
            square = y ** 2
        return y + square


@pytest.mark.parametrize("how", ["straight_through", "straight_through_setup_context", "inference_mode",
                                 "set_grad_enabled", "no_grad"])
def test_each_chunk_differentiates_as_eager_does(how):
    torch.manual_seed(0)
    model = nn.Sequential(_EagerOnlyGradient(how), _EagerOnlyGradient(how), nn.Linear(6, 3)).double()
    split, x, y = _split(model, 2)
    nn.MSELoss()(model(x), y).backward()
    _, grads = _chunked_loss_and_grads(split, model, x, y)
    # Before: round's zero gradient instead of the identity, the square's gradient through inference_mode and
    # set_grad_enabled(False) (up to 7 apart).
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-12, msg=name)


class _Noisy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x + torch.rand_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_a_function_whose_forward_draws_random_numbers_is_refused_by_name():
    class Block(nn.Linear):
        def forward(self, x):
            return _Noisy.apply(super().forward(x))

    torch.manual_seed(0)
    model = nn.Sequential(Block(6, 6), Block(6, 3)).double()
    with pytest.raises(pw.CaptureError, match=r"autograd Function _Noisy draws random numbers .*rand_like.*"
                                              r"Fix: draw the random tensor outside the Function"):
        _split(model, 2)


@pytest.mark.parametrize("recompute,expected", [(False, [(4, 6)] * 3), (True, [(4, 6)])])
def test_the_forward_keeps_activations_only(recompute, expected):
    model = _mlp()
    split, x, y = _split(model, 2)
    params = dict(model.named_parameters())
    chunk = split.chunks[0]
    inputs = [params[n].detach() for n in chunk.params] + [x]
    autograd = partition_chunk(chunk, inputs, set(range(len(chunk.params))), 1.0, recompute=recompute)
    # Without recompute: x and the two tanh outputs, no weight (nor its transpose), nothing twice.
    assert [shape for shape, _ in autograd.saved_layouts] == expected


def test_a_forward_that_writes_a_buffer_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).double()
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    form, leaves = split_batch((x, y))
    with pytest.raises(pw.PlacementError, match=r"updates buffer '1\.\w+' in place"):
        split_model(model, nn.MSELoss(), form, leaves, trained=[n for n, _ in model.named_parameters()],
                    constants=[n for n, _ in model.named_buffers()], num_chunks=2)


class _Looped(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        for layer in self.layers[:-1]:    # a marker in a loop over the blocks: one per iteration
            x = torch.tanh(layer(x))
            pw.pipe_split()
        return self.head(torch.tanh(self.layers[-1](x)))


def test_markers_in_a_loop_over_the_blocks_cut_after_each():
    torch.manual_seed(0)
    split, _, _ = _split(_Looped().double(), 4)
    assert split.how == "pipe_split markers"
    assert [c.params for c in split.chunks] == [
        ("layers.0.weight", "layers.0.bias"), ("layers.1.weight", "layers.1.bias"),
        ("layers.2.weight", "layers.2.bias"), ("layers.3.weight", "layers.3.bias", "head.weight", "head.bias")]


class _SplitInBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        x = self.a(x)
        while False:
            pass
        try:
            pw.pipe_split()
        finally:
            pass
        return self.b(x)


def test_a_marker_count_that_does_not_match_is_refused():
    model = _mlp()
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)

    class TwoMarkers(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = model

        def forward(self, x):
            pw.pipe_split()
            x = self.body(x)
            pw.pipe_split()
            return x

    form, leaves = split_batch((x, y))
    wrapped = TwoMarkers()
    with pytest.raises(pw.PlacementError, match="expected 3 pipe_split\\(\\) markers for 4 chunks .* has 2"):
        split_model(wrapped, nn.MSELoss(), form, leaves, trained=[n for n, _ in wrapped.named_parameters()],
                    constants=[], num_chunks=4)


def test_a_marker_in_a_try_block_is_refused_with_its_line():
    model = _SplitInBranch().double()
    with pytest.raises(pw.CaptureError, match=r"is inside a try block \(line \d+\)"):
        _split(model, 2)


def test_the_plan_checks_the_mesh():
    mesh = types.SimpleNamespace(axes={"pipe": 2, "data": 2})
    assert pw.Pipeline(data=pw.DataParallel("data")).check(mesh) == (2, 2)
    with pytest.raises(pw.PlacementError, match="stages=4 but the mesh's 'pipe' axis has size 2"):
        pw.Pipeline(stages=4, data=pw.DataParallel("data")).check(mesh)
    with pytest.raises(pw.PlacementError, match="no 'pipe' axis"):
        pw.Pipeline().check(types.SimpleNamespace(axes={"data": 2}))
    with pytest.raises(pw.PlacementError, match="schedule must be one of"):
        pw.Pipeline(schedule="zigzag")
    with pytest.raises(pw.PlacementError, match="use schedule='interleaved'"):
        pw.Pipeline(schedule="1f1b", virtual_stages=2)
    with pytest.raises(pw.PlacementError, match="microbatches must be a positive int"):
        pw.Pipeline(microbatches=0)
