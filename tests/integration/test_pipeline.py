"""Pipeline training (pw.Pipeline) on real executors, against single-process eager training.

The eager backend runs the whole matrix (S = 2 and 4, M = 4 and 8, every schedule, with and
without a data axis) in float64 at 1e-9; memory is read from the stores' high-water marks;
checkpoints cross between Pipeline and DataParallel; bad input is refused before anything
is sent and changes no stored parameter.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn as nn

import pathways_torch as pw
from tests.conftest import train_eagerly
from tests.handles import controller_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

WIDTH = 6


def _blocks(depth=8, width=WIDTH, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    layers = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]
    return nn.Sequential(*layers, nn.Linear(width, 3)).to(dtype)


def _batches(steps, rows, width=WIDTH, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, width, generator=g, dtype=dtype), torch.randn(rows, 3, generator=g, dtype=dtype))
            for _ in range(steps)]


def _adam(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _train(ctx, model, plan, batches, mesh_axes, executors=None):
    mesh = ctx.mesh(mesh_axes, executors=executors)
    trainer = ctx.wrap(model, optimizer=_adam(model), loss_fn=nn.MSELoss(), mesh=mesh, plan=plan)
    losses = [trainer.step(b) for b in batches]
    return trainer, [loss.result(240).item() for loss in losses]


def _max_difference(state: dict, model) -> float:
    return max((state[n] - p.detach()).abs().max().item() for n, p in model.state_dict().items())


@pytest.fixture(scope="module")
def ctx():
    with pw.Context(num_executors=8, backend="eager") as context:
        yield context


MATRIX = [(s, m, sched, d) for s in (2, 4) for m in (4, 8) for sched in ("gpipe", "1f1b", "interleaved")
          for d in (1, 2)]


@pytest.mark.parametrize("stages,microbatches,schedule,data", MATRIX,
                         ids=[f"S{s}-M{m}-{sched}-D{d}" for s, m, sched, d in MATRIX])
def test_matrix_equals_eager_float64(ctx, stages, microbatches, schedule, data):
    virtual = 2 if schedule == "interleaved" else 1
    batches = _batches(3, rows=microbatches * data * 2)
    model, reference = _blocks(), _blocks()
    expected = train_eagerly(reference, _adam(reference), batches, nn.MSELoss())
    axes = {"pipe": stages, "data": data} if data > 1 else {"pipe": stages}
    plan = pw.Pipeline(microbatches=microbatches, schedule=schedule, virtual_stages=virtual,
                       data=pw.DataParallel("data") if data > 1 else None)
    trainer, losses = _train(ctx, model, plan, batches, axes)
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-9, (losses, expected)
    assert _max_difference(trainer.state_dict()["model"], reference) < 1e-9


def test_one_message_per_executor_per_step_and_no_activation_through_the_client(ctx):
    batches = _batches(4, rows=16)
    model = _blocks()
    plan = pw.Pipeline(microbatches=8, schedule="1f1b", data=pw.DataParallel("data"))
    trainer, _ = _train(ctx, model, plan, batches[:1], {"pipe": 2, "data": 2})   # captured and registered
    before = ctx.stats()
    sent_before = dict(controller_of(ctx).messages_sent)
    for b in batches[1:]:
        trainer.step(b).result(120)
    after = ctx.stats()
    runs = controller_of(ctx).messages_sent.get("run_program", 0) - sent_before.get("run_program", 0)
    assert runs == 3 * 4, runs                  # one RunProgram per executor per step, nothing else
    assert controller_of(ctx).messages_sent.get("run", 0) == sent_before.get("run", 0)
    moved = after["hops"]["executor->executor"] - before["hops"]["executor->executor"]
    # Per step: 8 microbatches x 2 data shards send an activation (16 rows/16 x WIDTH floats) forward and
    # its gradient back.
    activation = 1 * WIDTH * 8
    assert moved >= 3 * 8 * 2 * 2 * activation, moved
    fetched = after["hops"]["executor->client"] - before["hops"]["executor->client"]
    assert fetched <= 3 * 8 * 2, fetched        # only the losses (a float64 from each of 2 shards) came back
    relayed = after["hops"]["controller relayed"] - before["hops"]["controller relayed"]
    assert relayed < 3 * 8 * 2 * activation, relayed   # no tensor passes through the controller


def test_schedule_and_stages_print(ctx):
    model = _blocks(depth=4)
    plan = pw.Pipeline(microbatches=2, schedule="gpipe")
    trainer, _ = _train(ctx, model, plan, _batches(1, rows=2), {"pipe": 2})
    assert trainer.runner.schedule.splitlines() == [
        "schedule gpipe: 2 ranks, 2 chunks, 2 microbatches",
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "rank 1: 1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1"]
    stages = trainer.runner.stages.splitlines()
    assert stages[0] == "2 chunks, cut at the blocks of the nn.Sequential"
    assert stages[1].startswith("chunk 0 (rank 0): 84 parameters; 0, 1; sends 1 value(s)"), stages
    assert stages[2].startswith("chunk 1 (rank 1): 105 parameters; 2, 3, 4 + loss"), stages


def test_user_schedule_text_is_used_and_a_broken_one_refused(ctx):
    text = ("rank 0: 0F0 0F1 0B0 0B1\n"
            "rank 1: 1F0 1B0 1F1 1B1\n")
    model, reference = _blocks(depth=4), _blocks(depth=4)
    batches = _batches(2, rows=4)
    expected = train_eagerly(reference, _adam(reference), batches, nn.MSELoss())
    trainer, losses = _train(ctx, model, pw.Pipeline(microbatches=2, schedule=text), batches, {"pipe": 2})
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-9
    assert "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1" in trainer.runner.schedule
    broken = "rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1B0 1F0 1F1 1B1\n"
    with pytest.raises(pw.PlacementError, match=r"rank 1: >>1B0<< 1F0 1F1 1B1"):
        ctx.wrap(_blocks(depth=4), optimizer=_adam(model), loss_fn=nn.MSELoss(), mesh=ctx.mesh({"pipe": 2}),
                 plan=pw.Pipeline(microbatches=2, schedule=broken))


def _narrow_input_blocks(depth, width):
    """Blocks whose input is 2 wide and activations ``width`` wide: the batch's own bytes (freed as each
    forward consumes them, at a time that varies) stay negligible next to the activations."""
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(2, width), nn.Tanh())
    rest = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth - 1)]
    return nn.Sequential(first, *rest, nn.Linear(width, 3))


def _activation_peaks(ctx, schedule, microbatches, stages, rows=256, width=32):
    """The first stage's peak stored bytes during one step less its bytes at rest: the activations its
    forwards keep for their backwards (and what passes through), in activations of one block boundary."""
    gc.collect()              # what earlier tests left is freed before this one measures
    ctx.flush_frees()
    model = _narrow_input_blocks(stages * 2, width)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(rows * microbatches, 2, generator=g), torch.randn(rows * microbatches, 3, generator=g))
               for _ in range(2)]
    mesh = ctx.mesh({"pipe": stages})
    trainer = ctx.wrap(model, optimizer=_adam(model), loss_fn=nn.MSELoss(), mesh=mesh,
                       plan=pw.Pipeline(microbatches=microbatches, schedule=schedule))
    trainer.step(batches[0]).result(120)        # captured; the state is in place
    trainer.state_dict()                         # every stage's update has run (the loss is ready earlier)
    gc.collect()
    ctx.flush_frees()                           # the state before that step is gone too
    first = mesh.executor_ids[0]
    resting = ctx.stats()["executors"][first]["store_bytes"]
    trainer.step(batches[1]).result(120)
    trainer.state_dict()                         # the first stage's last backwards and update are done
    peak = ctx.stats()["executors"][first]["store_bytes_high_water"]
    del trainer
    return (peak - resting) / (rows * width * 4)


def test_one_f_one_b_peak_activation_memory_below_gpipe_and_independent_of_microbatches(ctx):
    gpipe = _activation_peaks(ctx, "gpipe", 16, 2)
    ofob = _activation_peaks(ctx, "1f1b", 8, 2)
    ofob_more = _activation_peaks(ctx, "1f1b", 16, 2)
    ofob_deeper = _activation_peaks(ctx, "1f1b", 16, 8)
    # Each microbatch in flight keeps two block outputs on the first stage. GPipe runs every forward first:
    # all 16 microbatches at once; 1F1B at most S (plus copies in flight: a margin of a few activations).
    assert gpipe >= 16 * 2 - 1, gpipe
    assert ofob_more < gpipe / 2, (ofob_more, gpipe)
    assert abs(ofob_more - ofob) <= 2, (ofob, ofob_more)                 # grows with S, not with M
    assert ofob_deeper > ofob_more + 4, (ofob_more, ofob_deeper)         # 8 microbatches, not 2


def test_checkpoint_crosses_between_pipeline_and_data_parallel(ctx, tmp_path):
    batches = _batches(4, rows=8)
    reference = _blocks()
    expected = train_eagerly(reference, _adam(reference), batches, nn.MSELoss())
    model = _blocks()
    pipeline, first = _train(ctx, model, pw.Pipeline(microbatches=2, schedule="1f1b"), batches[:2], {"pipe": 2})
    path = pipeline.save(str(tmp_path / "pipe"))
    dp_model = _blocks(seed=5)
    dp = ctx.wrap(dp_model, optimizer=_adam(dp_model), loss_fn=nn.MSELoss(),
                  mesh=ctx.mesh({"data": 2}, executors=[2, 3]), plan=pw.DataParallel("data"))
    dp.load(path)
    third = dp.step(batches[2]).result(120).item()
    dp_path = dp.save(str(tmp_path / "dp"))
    back_model = _blocks(seed=6)
    back = ctx.wrap(back_model, optimizer=_adam(back_model), loss_fn=nn.MSELoss(),
                    mesh=ctx.mesh({"pipe": 2}, executors=[4, 5]), plan=pw.Pipeline(microbatches=2))
    back.load(dp_path)
    fourth = back.step(batches[3]).result(120).item()
    assert max(abs(a - b) for a, b in zip(first + [third, fourth], expected)) < 1e-9
    assert _max_difference(back.state_dict()["model"], reference) < 1e-9


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 3)

    def forward(self, x):
        x = self.a(x)
        if x.shape[0] > 0:
            pw.pipe_split()
        return self.b(x)


class _Marked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 3)

    def forward(self, x):
        x = torch.tanh(self.a(x))
        pw.pipe_split()
        x = torch.tanh(self.b(x))
        return self.c(x)


def test_pipe_split_markers_cut_where_written(ctx):
    torch.manual_seed(0)
    model = _Marked().double()
    reference = copy.deepcopy(model)
    batches = _batches(2, rows=4)
    expected = train_eagerly(reference, _adam(reference), batches, nn.MSELoss())
    trainer, losses = _train(ctx, model, pw.Pipeline(microbatches=2), batches, {"pipe": 2})
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-9
    assert trainer.runner.stages.splitlines()[0] == "2 chunks, cut at pipe_split markers"
    assert "chunk 0 (rank 0): 42 parameters; a;" in trainer.runner.stages


BAD = {
    "no pipe axis": (lambda ctx: ({"data": 2}, pw.Pipeline(microbatches=2), 4),
                     r"the mesh has axes \['data'\], no 'pipe' axis"),
    "stages unequal": (lambda ctx: ({"pipe": 2}, pw.Pipeline(stages=4, microbatches=2), 4),
                       r"stages=4 but the mesh's 'pipe' axis has size 2; use stages=2"),
    "microbatches do not divide": (lambda ctx: ({"pipe": 2}, pw.Pipeline(microbatches=3), 4),
                                   r"4 rows, not divisible by 3 microbatches x 1 data shards = 3"),
    "more chunks than blocks": (lambda ctx: ({"pipe": 4}, pw.Pipeline(microbatches=4, schedule="interleaved",
                                                                         virtual_stages=2), 8),
                                r"8 chunks need at least 8 blocks, the model has 5"),
    "more stages than executors": (lambda ctx: ({"pipe": 16}, pw.Pipeline(microbatches=2), 4),
                                   r"needs 16 executors, the cluster has 8 live"),
    "data axis without data plan": (lambda ctx: ({"pipe": 2, "data": 2}, pw.Pipeline(microbatches=2), 4),
                                    r"has no data=...; pass data=pw.DataParallel\('data'\)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_refused_before_anything_is_sent(ctx, case):
    build, message = BAD[case]
    axes, plan, rows = build(ctx)
    model = _blocks(depth=4)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(pw.PlacementError, match=message):
        trainer = ctx.wrap(model, optimizer=_adam(model), loss_fn=nn.MSELoss(), mesh=ctx.mesh(axes), plan=plan)
        trainer.step(_batches(1, rows=rows)[0])
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), initial[name])


def test_bad_input_leaves_the_stored_parameters_unchanged(ctx):
    model = _blocks(depth=4)
    trainer, _ = _train(ctx, model, pw.Pipeline(microbatches=2), _batches(1, rows=4), {"pipe": 2})
    before = trainer.state_dict()["model"]
    with pytest.raises(pw.PlacementError, match="not divisible by 2 microbatches"):
        trainer.step(_batches(1, rows=3)[0])
    after = trainer.state_dict()["model"]
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_pipe_split_inside_a_branch_is_refused(ctx):
    model = _Branchy().double()
    with pytest.raises(pw.CaptureError, match=r"pw.pipe_split\(\) at .* is inside an if \(line \d+\)"):
        _train(ctx, model, pw.Pipeline(microbatches=2), _batches(1, rows=4), {"pipe": 2})


def _train_eagerly_with_sample_keyed_dropout(model, optimizer, batches, seed=0):
    """The oracle with dropout: one process, the whole batch, masks keyed by (seed, step, global row)."""
    from pathways_torch.training.random import sample_keyed_rng

    losses = []
    for step, (x, y) in enumerate(batches, start=1):
        optimizer.zero_grad()
        with sample_keyed_rng(seed, torch.tensor(step), torch.tensor(0)):
            loss = nn.MSELoss()(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _dropout_blocks(seed=0):
    torch.manual_seed(seed)
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.3), nn.Tanh()) for _ in range(4)]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 3)).double()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_dropout_masks_keyed_by_sample_repeat_the_unpipelined_run(ctx, schedule):
    batches = _batches(3, rows=16)
    reference = _dropout_blocks()
    expected = _train_eagerly_with_sample_keyed_dropout(reference, _adam(reference), batches)
    without_dropout = train_eagerly(_blocks(depth=4), _adam(_blocks(depth=4)), batches, nn.MSELoss())
    model = _dropout_blocks()
    plan = pw.Pipeline(microbatches=4, schedule=schedule, data=pw.DataParallel("data"))
    trainer, losses = _train(ctx, model, plan, batches, {"pipe": 2, "data": 2})
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-9, (losses, expected)
    assert _max_difference(trainer.state_dict()["model"], reference) < 1e-9
    assert abs(losses[0] - without_dropout[0]) > 1e-3     # the masks did something


@pytest.mark.parametrize("variant", ["sharded-data", "recompute"])
def test_sharded_stages_and_recompute_equal_eager(ctx, variant):
    batches = _batches(3, rows=16)
    model, reference = _blocks(), _blocks()
    expected = train_eagerly(reference, _adam(reference), batches, nn.MSELoss())
    data = pw.ShardedDataParallel("data") if variant == "sharded-data" else pw.DataParallel("data")
    plan = pw.Pipeline(microbatches=4, schedule="1f1b", data=data, recompute=variant == "recompute")
    trainer, losses = _train(ctx, model, plan, batches, {"pipe": 2, "data": 2})
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-9, (losses, expected)
    assert _max_difference(trainer.state_dict()["model"], reference) < 1e-9
    saved = [p.autograd.saved_layouts for p in trainer.runner.train_plans()]
    if variant == "recompute":   # only each chunk's data inputs are kept: x; the activation and the target
        assert [len(s) for s in saved] == [1, 2], saved
    else:                        # each block's tanh output too; the head's output and the target
        assert [len(s) for s in saved] == [5, 7], saved


def test_timeline_draws_the_last_step_from_executor_timestamps(ctx, tmp_path):
    pytest.importorskip("matplotlib")
    import json

    from pathways_torch.observe.timeline import describe

    model = _blocks(depth=4)
    plan = pw.Pipeline(microbatches=4, schedule="1f1b", data=pw.DataParallel("data"))
    trainer, _ = _train(ctx, model, plan, _batches(2, rows=16), {"pipe": 2, "data": 2})
    path = trainer.runner.timeline(str(tmp_path / "step.png"), trace_path=str(tmp_path / "step.json"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    spans, *_ = trainer.runner.last_step_spans()
    rows = describe(spans).splitlines()
    assert len(rows) == 4
    # Each row is its schedule's order, then the update.
    rank0 = "F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3 U0"
    rank1 = "F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3 U1"
    assert sorted(r.split(": ")[1] for r in rows) == sorted([rank0, rank0, rank1, rank1]), rows
    step = json.load(open(tmp_path / "step.json"))
    computed = [e for e in step["traceEvents"] if e.get("ph") == "X" and e["name"].startswith("pipeline_")]
    # The window of that step: its 4 x 9 computations, and of the step before only what ran in that window on an
    # executor still behind (executors run ahead of each other: 1 such event here with host collectives)
    last_run = max(e["args"]["call_id"] for e in computed) - (trainer.runner.last_step_spans()[3] - 1)
    assert len([e for e in computed if e["args"]["call_id"] >= last_run]) == 4 * 9
    assert len(computed) < 2 * 4 * 9, len(computed)


def test_evaluate_is_the_eager_eval_loss_and_changes_nothing(ctx):
    batches = _batches(3, rows=16)
    model, reference = _dropout_blocks(), _dropout_blocks()
    _train_eagerly_with_sample_keyed_dropout(reference, _adam(reference), batches[:2])
    plan = pw.Pipeline(microbatches=4, schedule="1f1b", data=pw.DataParallel("data"))
    trainer, _ = _train(ctx, model, plan, batches[:2], {"pipe": 2, "data": 2})
    before = trainer.state_dict()["model"]
    loss = trainer.evaluate(batches[2]).result(120).item()
    reference.eval()
    with torch.no_grad():
        expected = nn.MSELoss()(reference(batches[2][0]), batches[2][1]).item()
    assert abs(loss - expected) < 1e-9, (loss, expected)
    after = trainer.state_dict()["model"]
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert model.training                      # the user's module is back in training mode
    with pytest.raises(pw.PlacementError, match="predict is not supported under pw.Pipeline"):
        trainer.predict(batches[2])


@pytest.mark.parametrize("data", ["dp", "sdp"])
def test_gradient_clipping_by_the_global_norm_across_stages(ctx, data):
    batches = _batches(3, rows=16)
    model, reference = _blocks(), _blocks()
    expected = train_eagerly(reference, _adam(reference), batches, nn.MSELoss(), max_grad_norm=0.05)
    unclipped = train_eagerly(_blocks(), _adam(_blocks()), batches, nn.MSELoss())
    plan = pw.Pipeline(microbatches=4, schedule="1f1b",
                       data=pw.DataParallel("data") if data == "dp" else pw.ShardedDataParallel("data"))
    trainer = ctx.wrap(model, optimizer=_adam(model), loss_fn=nn.MSELoss(), mesh=ctx.mesh({"pipe": 2, "data": 2}),
                       plan=plan, max_grad_norm=0.05)
    losses = [loss.result(120).item() for loss in [trainer.step(b) for b in batches]]
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-9, (losses, expected)
    assert _max_difference(trainer.state_dict()["model"], reference) < 1e-9
    assert abs(expected[-1] - unclipped[-1]) > 1e-6      # the clipping mattered


class _RoundStraightThrough(torch.autograd.Function):
    """Forward: round; backward: the gradient as it came (a straight-through estimator)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


_GRADIENTS_OFF = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
                  "set_grad_enabled": lambda: torch.set_grad_enabled(False)}


class _StoppedSquare(nn.Module):
    """A block whose output adds the square of its value, detached or computed where gradients are off: that
    term must pass no gradient back; or ("straight_through") its rounding, whose gradient is the Function's."""

    def __init__(self, how: str):
        super().__init__()
        self.fc, self.how = nn.Linear(4, 4), how

    def forward(self, x):
        y = self.fc(x)
        if self.how == "detach":
            return y + y.detach() ** 2
        if self.how == "straight_through":
            return y + _RoundStraightThrough.apply(3 * y) / 3
        with _GRADIENTS_OFF[self.how]():
            square = y ** 2
        return y + square


@pytest.mark.parametrize("how", ["detach", "no_grad", "inference_mode", "set_grad_enabled", "straight_through"])
def test_a_stopped_gradient_in_the_forward_stops_in_each_chunk_as_in_eager(ctx, how):
    def make():
        torch.manual_seed(0)
        return nn.Sequential(_StoppedSquare(how), _StoppedSquare(how)).double()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randn(4, 4, generator=g,
                                                                                dtype=torch.float64))
               for _ in range(3)]
    reference = make()
    expected = train_eagerly(reference, torch.optim.SGD(reference.parameters(), lr=0.1), batches, nn.MSELoss())
    model = make()
    trainer = ctx.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.MSELoss(),
                       mesh=ctx.mesh({"pipe": 2}, executors=ctx.executor_ids[:2]), plan=pw.Pipeline(microbatches=2))
    losses = [loss.result(120).item() for loss in [trainer.step(b) for b in batches]]
    # The gradient through the detached square would change the second loss by 3e-2 (measured before the fix).
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-12, (losses, expected)
    assert _max_difference(trainer.state_dict()["model"], reference) < 1e-12
