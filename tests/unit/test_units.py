"""Units of a sharded step and its per-unit schedule (issue 29, point 2), in process: the units found or given,
the errors for bad ``units=``, the fallback, and the schedule of a traced step as text (no executors: the step is
traced on a mesh of 2 and the pass reorders its graph)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import pathways_torch as pw
from pathways_torch.capture import InputSpec, capture
from pathways_torch.collectives import tracing_mesh
from pathways_torch.errors import PlacementError
from pathways_torch.training.optimizers import DYNAMIC, read_optimizer
from pathways_torch.training.step import make_layout, make_step
from pathways_torch.training.unit_schedule import UnitSchedule, describe, gathered_high_water
from pathways_torch.training.units import plan_units

pytestmark = pytest.mark.timeout(60)

MB = 2**20


class _Gpt(nn.Module):
    """Embeddings, a block list (``self.h``), a final norm and a head: the rest lies before and after the units."""

    def __init__(self, width=8, depth=3):
        super().__init__()
        self.wte = nn.Embedding(16, width)
        self.h = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
                               for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, 16)

    def forward(self, x):
        x = self.wte(x)
        for block in self.h:
            x = block(x)
        return self.head(self.ln(x))


def _mlp(depth=3, width=8):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
                           for _ in range(depth)])


def _units(model, units=None, fallback=4 * MB):
    optimizer = torch.optim.AdamW(model.parameters())
    layout = make_layout(model, optimizer, read_optimizer(optimizer))
    return plan_units(model, list(layout.buckets), units, fallback)


def test_the_repeated_blocks_are_the_units_and_the_rest_keeps_its_order():
    units = _units(_Gpt())
    assert units.names == ("h.0", "h.1", "h.2")
    assert units.bucket_units == (None, 0, 1, 2)           # the rest (wte, ln, head) in one bucket, first
    assert str(units) == "\n".join([
        "3 units (the model's repeated blocks), 4 buckets:",
        "unit 0 'h.0': 4 parameters, 0.6 KiB in 1 bucket",
        "unit 1 'h.1': 4 parameters, 0.6 KiB in 1 bucket",
        "unit 2 'h.2': 4 parameters, 0.6 KiB in 1 bucket",
        "rest (wte.weight, ln.weight, ln.bias, head.weight and 1 more): 5 parameters, 1.1 KiB in 1 bucket"])


def test_small_blocks_join_into_units_of_a_least_the_minimum():
    units = _units_min(_Gpt(depth=5), 1100)           # each block 576 bytes: two make a unit, the fifth joins
    assert units.names == ("h.0 + h.1", "h.2 + h.3 + h.4")
    assert units.how == "the model's repeated blocks, joined into units of at least 1.1 KiB"
    assert units.bucket_units == (None, 0, 1)


def test_blocks_that_make_one_unit_make_the_whole_model_one():
    units = _units_min(_Gpt(depth=2), 1 * MB)
    assert units.names == ("(the whole model)",) and units.bucket_units == (0,)
    assert str(units).splitlines()[0] == "1 unit (its blocks make one unit of at least 1.0 MiB), 1 bucket:"


def _units_min(model, min_bytes):
    optimizer = torch.optim.AdamW(model.parameters())
    layout = make_layout(model, optimizer, read_optimizer(optimizer))
    return plan_units(model, list(layout.buckets), None, 4 * MB, min_bytes)


def test_units_given_by_name_cut_the_buckets_there():
    units = _units(_Gpt(), units=["h", "head"])
    assert units.names == ("h", "head") and units.bucket_units == (None, 0, 1)
    assert [s.name for s in units.buckets[1].slots][:2] == ["h.0.0.weight", "h.0.0.bias"]


@pytest.mark.parametrize("units, match", [
    (["h.7", "nope"], r"does not have: \['h.7', 'nope'\]"),
    (["h", "h.1"], r"'h' holds 'h.1'"),
    (["head", "head"], r"'head' twice"),
])
def test_units_that_are_no_module_or_overlap_are_refused_with_their_names(units, match):
    with pytest.raises(PlacementError, match=match):
        _units(_Gpt(), units=units)


def test_a_plan_refuses_units_that_are_not_a_list_of_names():
    with pytest.raises(ValueError, match="units= expected a list of module names"):
        pw.ShardedDataParallel("data", units="h")
    assert pw.ShardedDataParallel("data", units=["h", "head"]).units == ("h", "head")   # hashable, frozen


class _ThreeLayers(nn.Module):
    """Three layers held as attributes: no block list."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 8)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def test_a_model_without_repeated_blocks_falls_back_to_one_unit_per_bucket_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        units = _units(_ThreeLayers(), fallback=1 * MB)      # 1 MiB weights: each a piece of its own
    assert "_ThreeLayers has no repeated blocks" in caplog.text
    assert "one unit per bucket of at most 1 MB" in caplog.text
    assert len(units.buckets) >= 3 and units.bucket_units == tuple(range(len(units.buckets)))
    assert all(sum(s.numel for s in b.slots) * 4 <= 1 * MB + 2048 for b in units.buckets)
    assert units.how == "fallback: one per bucket of at most 1 MB"


def _schedule(model, schedule: UnitSchedule | None, n=2, rows=4):
    """The sharded step of ``model`` traced for one of ``n`` shards, reordered by ``schedule``."""
    optimizer = torch.optim.AdamW(model.parameters())
    spec = read_optimizer(optimizer)
    units = plan_units(model, list(make_layout(model, optimizer, spec).buckets), None, 4 * MB)
    layout = make_layout(model, optimizer, spec, lambda buckets: list(units.buckets))
    plan = pw.ShardedDataParallel("data")
    step = make_step(model, nn.functional.mse_loss, spec, layout, plan, n, 0, None,
                     mark_forward_end=schedule is not None)
    shards = [InputSpec((b.padded_numel(n) // n,), torch.float32) for b in layout.buckets]
    width = model[0][0].in_features
    specs = [*shards, *[s for s in shards for _ in spec.state_names],
             InputSpec((1 + layout.num_groups * len(DYNAMIC),), torch.float64), InputSpec((1,), torch.int64),
             InputSpec((rows // n, width), torch.float32), InputSpec((rows // n, width), torch.float32)]
    with tracing_mesh({"data": n}):
        return capture(step, "step", specs, lambda tensors: (tensors, {}), schedule).graph_module


def _collectives(text: str) -> list[str]:
    return [line.split(" ->")[0] for line in text.splitlines() if line.startswith(("all_", "reduce_"))]


def test_the_per_unit_schedule_gathers_each_unit_before_its_forward_and_again_before_its_backward():
    text = describe(_schedule(_mlp(), UnitSchedule()))
    assert _collectives(text) == [
        "all_gather(arg0_1)", "all_gather(arg1_1)", "all_gather(arg2_1)",          # forward, unit by unit
        "reduce_scatter(cat_2)",                                                   # backward, last unit first
        "all_gather(arg1_1)", "reduce_scatter(cat_1)",                             # (kept: read again at once),
        "all_gather(arg0_1)", "reduce_scatter(cat)", "all_reduce(alias)"]          # each gradient reduced as
                                                                                   # soon as it is made
    lines = text.splitlines()
    forward = [i for i, line in enumerate(lines) if line.startswith("all_gather")][:3]
    assert all(lines[i + 1].endswith(" ops") for i in forward)        # each unit computes between two gathers
    assert lines[-1] == "at most 1 gathered buffer alive at once (576 bytes)"


def test_the_older_step_holds_every_gathered_bucket_through_the_step():
    graph_module = _schedule(_mlp(), None)
    assert _collectives(describe(graph_module))[:3] == ["all_gather(arg0_1)", "all_gather(arg1_1)",
                                                        "all_gather(arg2_1)"]
    assert gathered_high_water(graph_module) == (3, 3 * 576)


@pytest.mark.parametrize("schedule, most", [(UnitSchedule(reshard_after_forward=False), 3),
                                            (UnitSchedule(prefetch=True), 2)])
def test_keeping_for_the_backward_or_prefetching_holds_more_gathered_units(schedule, most):
    graph_module = _schedule(_mlp(), schedule)
    gathers = [c for c in _collectives(describe(graph_module)) if c.startswith("all_gather")]
    assert len(gathers) == (3 if not schedule.reshard_after_forward else 5)
    assert gathered_high_water(graph_module)[0] == most


class _RecordingRuntime:
    """An in-process collective runtime for one member (a gather returns its input twice, a reduce-scatter its
    first half); records the order of issues and waits."""

    def __init__(self, log):
        self.log = log

    def run(self, name, x, axis, **kwargs):
        self.log.append(f"{name} now")
        if name == "all_gather":
            return torch.cat([x, x])
        return x.clone() if name == "all_reduce" else x[:x.shape[0] // 2].clone()

    def start(self, name, x, axis, size, dim):
        self.log.append(f"{name} issued")
        log, value = self.log, torch.cat([x, x])

        class Pending:
            def result(self):
                log.append(f"{name} waited")
                return value

        return Pending()


def test_an_executor_issues_a_prefetched_gather_ahead_and_waits_just_before_its_reader():
    from pathways_torch.wire import collective_ops

    graph_module = _schedule(_mlp(), UnitSchedule(prefetch=True))
    log = []
    for node in graph_module.graph.nodes:       # mark where each forward unit computes
        if node.target is torch.ops.aten.relu.default:
            node.target = lambda x, log=log: log.append("relu") or torch.relu(x)
    graph_module.recompile()
    collective_ops.call_runtime_directly(graph_module, issue_gathers_ahead=True)
    collective_ops.set_runtime(_RecordingRuntime(log))
    try:
        optimizer_inputs = [torch.zeros(s.shape, dtype=s.dtype) for s in _specs_of(graph_module)]
        graph_module(*optimizer_inputs)
    finally:
        collective_ops.set_runtime(collective_ops._NoRuntime())
    forward = log[:log.index("relu", log.index("relu") + 1) + 1]
    # Unit 1's gather is issued before unit 0's ops run and waited for after them.
    assert forward[:4] == ["all_gather now", "all_gather issued", "relu", "all_gather waited"], log


def _specs_of(graph_module):
    return [n.meta["val"] for n in graph_module.graph.nodes if n.op == "placeholder"]
