"""Training pieces without processes: the optimizer rewrite vs torch.optim, buckets, counter-based
dropout, the captured step vs eager, and capture errors that point at the user's line."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import pathways_torch as pw
from pathways_torch.collectives import tracing_mesh
from pathways_torch.training.buckets import flatten, make_buckets, unflatten
from pathways_torch.training.optimizers import UnsupportedOptimizerError, apply_update, read_optimizer
from pathways_torch.training.random import counter_rng, uniform_from_counter
from pathways_torch.training.step import StepLayout, make_step

pytestmark = pytest.mark.timeout(60)

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-momentum-wd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd-dampening": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.8, dampening=0.3),
    "sgd-nesterov-maximize": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, maximize=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1),
    "adam-decoupled": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1, decoupled_weight_decay=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05),
}


SCHEDULES = {
    "none": lambda o: None,
    # OneCycleLR cycles momentum (SGD) or beta1 (Adam) along with the learning rate.
    "one-cycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=6),
    "warmup-cosine": lambda o: torch.optim.lr_scheduler.SequentialLR(o, [
        torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=2),
        torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4)], milestones=[2]),
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_update_matches_torch_optim_step_for_step(name, schedule):
    torch.manual_seed(0)
    param = nn.Parameter(torch.randn(7, dtype=torch.float64))
    optimizer = OPTIMIZERS[name]([param])
    scheduler = SCHEDULES[schedule](optimizer)
    structure = read_optimizer(optimizer).static_key()
    spec = read_optimizer(optimizer)
    ours, state = param.detach().clone(), tuple(torch.zeros_like(param) for _ in spec.state_names)
    for step in range(1, 6):
        grad = torch.randn(7, dtype=torch.float64)
        spec = read_optimizer(optimizer)          # as the trainer does before every step
        assert spec.static_key() == structure    # a schedule changes values, never the graph
        hyper = torch.tensor(spec.dynamic_values(), dtype=torch.float64)
        param.grad = grad.clone()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        ours, state = apply_update(spec, 0, ours, grad, state, torch.tensor(float(step), dtype=torch.float64), hyper)
        torch.testing.assert_close(ours, param.detach(), rtol=1e-12, atol=1e-12, msg=f"{name} step {step}")
    for state_name, value in zip(spec.state_names, state):
        torch.testing.assert_close(value, optimizer.state[param][state_name], rtol=1e-12, atol=1e-12)


def test_keys_the_update_does_not_read_are_carried():
    p = [nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.AdamW([{"params": p, "name": "decay", "initial_lr": 0.1, "max_lr": 1.0}], lr=0.1)
    spec = read_optimizer(optimizer)
    assert spec.groups[0].lr == 0.1 and len(spec.dynamic_values()) == 5


def test_unsupported_optimizer_options_are_refused_by_name():
    p = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(UnsupportedOptimizerError, match="amsgrad=True"):
        read_optimizer(torch.optim.AdamW(p, amsgrad=True))
    with pytest.raises(UnsupportedOptimizerError, match="RMSprop"):
        read_optimizer(torch.optim.RMSprop(p))
    assert isinstance(UnsupportedOptimizerError("x"), pw.CaptureError)


def test_buckets_group_by_param_group_and_dtype_and_round_trip():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[1].double()
    model[0].bias.requires_grad_(False)
    optimizer = torch.optim.SGD([{"params": [model[0].weight, model[0].bias]},
                                 {"params": model[1].parameters(), "lr": 0.5}], lr=0.1)
    buckets, frozen = make_buckets(model, optimizer)
    assert [b.describe() for b in buckets] == [
        "group 0 float32[12]: 0.weight", "group 1 float64[10]: 1.weight, 1.bias"]
    assert frozen == ["0.bias"]
    tensors = dict(model.named_parameters())
    flat = flatten(buckets[1], tensors, padded_numel=12)
    assert flat.shape == (12,) and flat[10:].abs().sum() == 0
    for name, value in unflatten(buckets[1], flat).items():
        assert torch.equal(value, tensors[name])
    assert buckets[1].padded_numel(4) == 12 and buckets[1].padded_numel(5) == 10


def test_counter_dropout_is_a_function_of_seed_step_rank_and_call():
    def masks(seed, step, rank):
        x = torch.ones(20000)
        with counter_rng(seed, torch.tensor(step), torch.tensor([rank])):
            return [nn.functional.dropout(x, 0.25, True), nn.functional.dropout(x, 0.25, True)]

    a, b = masks(0, 3, 0), masks(0, 3, 0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], a[1])                      # second call site, other mask
    assert not torch.equal(a[0], masks(0, 4, 0)[0])         # next step
    assert not torch.equal(a[0], masks(0, 3, 1)[0])         # other shard
    assert not torch.equal(a[0], masks(1, 3, 0)[0])         # other seed
    kept = (a[0] != 0).float().mean().item()
    assert 0.74 < kept < 0.76 and set(a[0].unique().tolist()) == {0.0, torch.tensor(1 / 0.75).item()}
    u = uniform_from_counter(torch.tensor(99), (4, 5000), torch.float64)
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean().item() - 0.5) < 0.01


def test_other_random_functions_are_refused_while_capturing():
    with counter_rng(0, torch.tensor(1), torch.tensor([0])):
        with pytest.raises(pw.CaptureError, match="'rand'"):
            torch.rand(3)


def test_attention_dropout_draws_the_step_counter_masks():
    """SDPA with dropout_p > 0 (transformers in train mode) runs as the reference math with counter dropout."""
    q, k, v = (torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))

    def sdpa(step):
        with counter_rng(0, torch.tensor(step), torch.tensor([0])):
            return nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True)

    def by_hand(step):
        with counter_rng(0, torch.tensor(step), torch.tensor([0])):
            weights = (q @ k.transpose(-2, -1)) / 2.0
            weights = weights.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
            return nn.functional.dropout(torch.softmax(weights, -1), 0.25) @ v

    assert torch.equal(sdpa(1), sdpa(1)) and not torch.equal(sdpa(1), sdpa(2))   # keyed by the step
    torch.testing.assert_close(sdpa(1), by_hand(1))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3))
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        self.calls.add_(1)   # a buffer the forward updates in place
        return self.body(x)


def test_captured_step_on_one_shard_matches_eager_training():
    torch.manual_seed(0)
    model = _Net().double()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    spec = read_optimizer(optimizer)
    buckets, frozen = make_buckets(model, optimizer)
    layout = StepLayout(buckets=tuple(buckets), state_names=spec.state_names, buffer_names=("calls",),
                        frozen_names=tuple(frozen), num_groups=1)
    step = make_step(model, nn.functional.cross_entropy, spec, layout, pw.DataParallel("data"), 1, 0, 0.5)
    flat = flatten(buckets[0], dict(model.named_parameters())).detach()
    state = [torch.zeros_like(flat), torch.zeros_like(flat)]
    calls = torch.zeros((), dtype=torch.float64)
    with tracing_mesh({"data": 1}):
        for k in range(1, 4):
            x, y = torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
            scalars = torch.tensor([k, *spec.dynamic_values()], dtype=torch.float64)
            loss, flat, *state, calls = step(flat, *state, calls, scalars, torch.tensor([0]), x, y)
            ref_loss = nn.functional.cross_entropy(reference(x), y)
            ref_optimizer.zero_grad()
            ref_loss.backward()
            nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
            ref_optimizer.step()
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(flat, flatten(buckets[0], dict(reference.named_parameters())).detach(),
                               rtol=1e-10, atol=1e-12)
    assert calls.item() == 3 == reference.calls.item()
    assert "bucket 0: group 0 float64[" in layout.describe() and "buffers: ['calls']" in layout.describe()


def test_device_choice_is_checked_before_any_process_starts():
    from pathways_torch.context import ContextConfig

    assert ContextConfig(num_executors=2).executor_devices() == ["cpu", "cpu"]
    with pytest.raises(ValueError, match="the XLA routes run on CPU and TPU hosts"):
        ContextConfig(device="cuda", backend="xla")
    with pytest.raises(ValueError, match="expected one of"):
        ContextConfig(backend="xla:tpu")
    # The defaults: XLA on CPU (resolved to the installed route), inductor on CUDA.
    assert ContextConfig().resolved_backend in ("xla:torchax", "xla:torch_xla")
    assert ContextConfig(device="cuda").resolved_backend == "inductor"
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        ContextConfig(device="tpu")
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="64 executors need as many CUDA devices"):
            ContextConfig(num_executors=64, device="cuda", backend="inductor").executor_devices()
