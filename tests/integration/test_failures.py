"""Heartbeats and executor loss on a real local cluster (4 executors, fast heartbeats).

Each test loses a different executor, so they share one cluster: executor-0 and
executor-1 stay healthy throughout; executor-2 is killed, executor-3 is hung.
"""

from __future__ import annotations

import gc
import math
import os
import signal
import time

import pytest
import torch

import pathways_torch as pw
from tests.conftest import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

INTERVAL_S, TIMEOUT_S = 0.2, 1.5
N = 2048   # one tanh(x @ w) step on N x N takes ~0.1-0.3 s on one CPU thread


@pytest.fixture(scope="module")
def ctx():
    with pw.Context(num_executors=4, backend="eager", heartbeat_interval_s=INTERVAL_S,
                    heartbeat_timeout_s=TIMEOUT_S) as context:
        yield context


def _chain(x, w, steps):
    for _ in range(steps):
        x = torch.tanh(x @ w)
    return x


chain = pw.function(_chain, name="chain")
add_one = pw.function(lambda a: a + 1, name="add_one")


def _mesh(ctx, *executor_ids):
    return ctx.mesh({"data": len(executor_ids)}, executors=list(executor_ids))


def _pid(ctx, executor_id: str) -> int:
    return ctx.executor_pids[ctx.executor_ids.index(executor_id)]   # as the executor registered it


@pytest.fixture(scope="module")
def steps_per_second(ctx):
    """How many chain steps executor-0 runs per second (measured, so the tests fit the machine)."""
    mesh = _mesh(ctx, "executor-0")
    x = ctx.put(torch.randn(N, N), mesh, [pw.Replicate()])
    w = ctx.put(torch.randn(N, N) / math.sqrt(N), mesh, [pw.Replicate()])
    assert chain(x, w, 1).exception(timeout_s=60) is None   # warm up: first load and run
    started = time.monotonic()
    assert chain(x, w, 3).exception(timeout_s=60) is None
    return 3 / (time.monotonic() - started)


def test_a_computation_three_times_the_heartbeat_timeout_is_not_death(ctx, steps_per_second):
    mesh = _mesh(ctx, "executor-0", "executor-1")
    x = ctx.put(torch.randn(2 * N, N), mesh, [pw.Shard(0)])
    w = ctx.put(torch.randn(N, N) / math.sqrt(N), mesh, [pw.Replicate()])
    steps = math.ceil(3.5 * TIMEOUT_S * steps_per_second) + 1
    for _ in range(3):   # the machine's speed drifts (other work): lengthen until it lasts long enough
        started = time.monotonic()
        y = chain(x, w, steps)
        assert y.exception(timeout_s=60) is None
        elapsed = time.monotonic() - started
        print(f"\ncomputation of {steps} steps lasted {elapsed:.2f} s = {elapsed / TIMEOUT_S:.1f}x the heartbeat timeout")
        if elapsed >= 3 * TIMEOUT_S:
            break
        steps = math.ceil(steps * 3.5 * TIMEOUT_S / elapsed)
    assert elapsed >= 3 * TIMEOUT_S, "too short to show anything; the calibration is off"
    assert ctx.stats()["controller"]["lost_executors"] == []
    assert y.result(timeout_s=30).isfinite().all()


def test_sigkill_fails_what_depends_on_the_executor_and_nothing_else(ctx, steps_per_second):
    victim = "executor-2"
    healthy, doomed = _mesh(ctx, "executor-0"), _mesh(ctx, victim)
    pair = _mesh(ctx, "executor-0", "executor-1")
    gc.collect()
    baseline = ctx.stats()["executors"]["executor-0"]["store_buffers"]
    kept = add_one(ctx.put(torch.arange(6.0), pair, [pw.Shard(0)]))          # computed on healthy executors
    kept.result(timeout_s=30)
    x_healthy = ctx.put(torch.arange(4.0), healthy, [pw.Replicate()])
    x_doomed = ctx.put(torch.randn(N, N), doomed, [pw.Replicate()])
    w_doomed = ctx.put(torch.randn(N, N) / math.sqrt(N), doomed, [pw.Replicate()])
    assert x_doomed.exception(timeout_s=30) is None
    y = chain(x_doomed, w_doomed, math.ceil(20 * steps_per_second))          # ~20 s: in flight when killed
    z = add_one.on(healthy)(y)                 # queued on executor-0, waiting for a push from the victim

    started = time.monotonic()
    os.kill(_pid(ctx, victim), signal.SIGKILL)
    error = y.exception(timeout_s=2 * TIMEOUT_S + 5)
    detected_s = time.monotonic() - started
    print(f"\nSIGKILL detected after {detected_s:.2f} s (bound {2 * TIMEOUT_S:.1f} s): {error}")
    assert isinstance(error, pw.ExecutorLostError) and error.executor_id == victim and victim in str(error)
    assert "SIGKILL" in str(error)
    assert detected_s <= 2 * TIMEOUT_S

    # Every future that depends on it fails with the same kind of error, naming it.
    for name, future in {"z": z, "x_doomed": x_doomed, "w_doomed": w_doomed}.items():
        dependent_error = future.exception(timeout_s=5)
        assert isinstance(dependent_error, pw.ExecutorLostError), (name, future, dependent_error)
        assert dependent_error.executor_id == victim
    with pytest.raises(pw.ExecutorLostError, match=victim):
        x_doomed.result(timeout_s=5)
    assert victim in ctx.stats()["controller"]["lost_executors"]

    # New work that needs it fails at once.
    for attempt in (lambda: add_one(x_doomed),                                     # a mesh that includes it
                    lambda: add_one.on(healthy)(x_doomed),                        # an input that lived on it
                    lambda: ctx.put(torch.ones(2), doomed, [pw.Replicate()])):    # a put onto it
        started = time.monotonic()
        with pytest.raises(pw.ExecutorLostError, match=victim):
            attempt()
        assert time.monotonic() - started < 0.5

    # What lives elsewhere is untouched, and the call that waited on executor-0 for the victim's push ended.
    torch.testing.assert_close(x_healthy.result(timeout_s=10), torch.arange(4.0))
    torch.testing.assert_close(kept.result(timeout_s=10), torch.arange(6.0) + 1)
    torch.testing.assert_close(add_one(x_healthy).result(timeout_s=10), torch.arange(4.0) + 1)
    del z, kept
    gc.collect()
    # Only x_healthy is left on executor-0: the stuck call's input copy and output were let go.
    assert wait_until(lambda: ctx.stats()["executors"]["executor-0"]["store_buffers"] == baseline + 1, 10), \
        ctx.stats()["executors"]["executor-0"]


def test_a_hung_executor_is_lost_by_its_heartbeat_within_twice_the_timeout(ctx):
    victim = "executor-3"
    mesh = _mesh(ctx, victim)
    x = ctx.put(torch.ones(3), mesh, [pw.Replicate()])
    assert x.exception(timeout_s=30) is None
    pid = _pid(ctx, victim)
    try:
        os.kill(pid, signal.SIGSTOP)   # alive but silent: only the heartbeat can tell
        started = time.monotonic()
        y = add_one(x)
        error = y.exception(timeout_s=2 * TIMEOUT_S + 5)
        detected_s = time.monotonic() - started
        print(f"\nhung executor declared lost after {detected_s:.2f} s "
              f"(timeout {TIMEOUT_S} s, bound {2 * TIMEOUT_S:.1f} s): {error}")
        assert isinstance(error, pw.ExecutorLostError) and error.executor_id == victim
        assert "silent for" in str(error)      # the heartbeat found it: the process is still there
        assert detected_s <= 2 * TIMEOUT_S
        assert isinstance(x.exception(), pw.ExecutorLostError)   # its data is gone with it
        assert ctx.is_lost(victim)
    finally:
        os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not _running(pid), 10)
    torch.testing.assert_close(add_one(ctx.put(torch.zeros(2), _mesh(ctx, "executor-1"), [pw.Replicate()]))
                               .result(timeout_s=10), torch.ones(2))


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
