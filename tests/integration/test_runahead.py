"""Bounded run-ahead (issue 15): a client that never waits keeps memory and queues bounded.

20k unawaited tiny calls, then 1k training steps, on eager executors: the client's
RSS at the end is within 20 MB of its RSS at 10 % of the run, and no queue (unfinished
calls at the controller, runs queued or running on an executor, messages waiting for a
slow peer) ever holds more than ``max_inflight`` x the messages of one call.
"""

from __future__ import annotations

import time

import pytest
import torch

import pathways_torch as pw
from tests.handles import controller_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

CALLS = 20_000
STEPS = 1_000
MAX_INFLIGHT = 256


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.fixture(scope="module")
def ctx():
    with pw.Context(num_executors=2, backend="eager", max_inflight=MAX_INFLIGHT) as ctx:
        yield ctx


def test_unawaited_calls_and_steps_keep_memory_and_queues_bounded(ctx):
    mesh = ctx.mesh({"data": 2})
    add_one = pw.function(lambda x: x + 1, name="add_one")
    x = ctx.put(torch.zeros(4), mesh, [pw.Shard(0)])
    add_one(x).result(60)                       # captured and compiled once, before the clock starts
    began = time.monotonic()
    rss_at_tenth = None
    for i in range(CALLS):
        add_one(x)                              # dropped at once: never awaited
        if i == CALLS // 10:
            rss_at_tenth = _rss_mb()
    calls_s = time.monotonic() - began
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    trainer = ctx.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                       loss_fn=torch.nn.functional.mse_loss, mesh=mesh)
    batch = (torch.randn(8, 4), torch.randn(8, 1))
    loss = None
    for _ in range(STEPS):
        loss = trainer.step(batch)              # never awaited until the last
    assert torch.isfinite(loss.result(120))
    grown = _rss_mb() - rss_at_tenth
    stats = ctx.stats()
    print(f"\n{CALLS} calls in {calls_s:.1f} s; RSS grew {grown:.1f} MB after 10 %; "
          f"controller {stats['controller']}; executors "
          f"{ {e: (s['queue_high_water'], s['send_backlog_high_water']) for e, s in stats['executors'].items()} }")
    assert grown < 20, f"the client's RSS grew {grown:.1f} MB from 10 % of the run to its end"
    # One call is one Run per executor: no queue may hold more than the bound's worth of them.
    assert stats["controller"]["inflight_high_water"] <= MAX_INFLIGHT
    assert stats["controller"]["send_backlog_high_water"] <= MAX_INFLIGHT
    for executor_id, s in stats["executors"].items():
        assert 0 < s["queue_high_water"] <= MAX_INFLIGHT, (executor_id, s["queue_high_water"])
        assert s["send_backlog_high_water"] <= MAX_INFLIGHT, (executor_id, s["send_backlog_high_water"])
    # The client did wait at the bound (it would have run 50k calls ahead), and the trace shows it.
    assert len(controller_of(ctx).call_dispatch.run_ahead.waits) > 0


def test_max_inflight_is_checked():
    with pytest.raises(ValueError, match="max_inflight: expected a positive int, got 0"):
        pw.Context(num_executors=1, max_inflight=0)     # refused before anything starts
    with pytest.raises(ValueError, match="max_inflight_steps"):
        pw.Context(num_executors=1, max_inflight_steps=-1)
