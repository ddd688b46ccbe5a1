"""Launch trees on a real cluster (controller/launch_tree.py, executor/launch_tree.py): runs that go down a tree give
eager's results with calls, collectives and frees between them, and a loss in the tree fails what it must, holds
nothing else up, and the survivors run down a new tree. The trees are forced small here (a fanout of 2 from 2
executors on); by default only islands of 128 executors or more use one."""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest
import torch

import pathways_torch as pw

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TREE = {"launch_fanout": 2, "launch_tree_min_executors": 2}

scale = pw.function(lambda x: x * 0.5 + 1, name="scale")


@pw.function
def center(x):
    return x - pw.all_reduce(x.mean(), axis="data")


@pw.program(name="tree_step")
def tree_step(x):
    for _ in range(3):
        x = center(scale(x))
    return x


def _eager_step(shards: list[torch.Tensor]) -> list[torch.Tensor]:
    for _ in range(3):
        shards = [s * 0.5 + 1 for s in shards]
        total = sum(s.mean() for s in shards)
        shards = [s - total for s in shards]
    return shards


def _sim_chain(nodes: int, sim_time_s: float):
    """A simulated step, and a program of ``nodes`` of them one after another."""
    step = pw.function(lambda x: x + 1, name="step", sim_time_s=sim_time_s)

    @pw.program(name="chain")
    def chain(x):
        for _ in range(nodes):
            x = step(x)
        return x

    return step, chain


def test_runs_down_a_tree_match_eager_with_calls_collectives_and_frees_between_them():
    with pw.Context(num_executors=5, backend="eager", **TREE) as ctx:
        mesh = ctx.mesh({"data": 5})
        start = torch.arange(10, dtype=torch.float64)
        x = ctx.put(start, mesh, [pw.Shard(0)])
        oracle = list(start.chunk(5))
        for _ in range(30):
            x = tree_step(x)                  # down the tree
            x = center(x)                     # a collective sent to each executor, between two runs
            oracle = _eager_step(oracle)
            total = sum(s.mean() for s in oracle)
            oracle = [s - total for s in oracle]
        assert torch.allclose(x.result(timeout_s=60), torch.cat(oracle), rtol=1e-12, atol=1e-9)
        del x
        gc.collect()
        stats = ctx.stats()
        sent = stats["controller_messages"]
        assert sent.get("tree_launch") == 2 * 30 and "run_program" not in sent   # the controller's two children
        assert sent.get("launch_tree") == 5                                     # one tree, told once
        handled = stats["controller"]["handled_messages"]
        assert handled.get("control:done_batch") == 2 * 30 and stats["controller"]["dropped_messages"] == 0
        # The arrays dropped after each run were freed through the tree: nothing is left behind.
        buffers = {e: s["store_buffers"] for e, s in stats["executors"].items()}
        assert all(b <= 2 for b in buffers.values()), buffers


def test_a_parent_lost_before_forwarding_fails_the_run_holds_no_call_and_the_survivors_get_a_new_tree():
    """Sim executors, a process each. Executor 0 is the parent of 1 and 2; it is SIGKILLed and a run is sent at
    once, so 1 and 2 never get it: the run fails naming executor-0, a call on 1 and 2 sent after that launch
    (which they wait for) still runs, and runs on the survivors go down a new tree."""
    with pw.Context(num_executors=6, backend="sim", **TREE) as ctx:
        ids, pids = ctx.executor_ids, ctx.executor_pids
        step, chain = _sim_chain(4, 0.002)
        everyone = ctx.mesh({"data": 6})
        x = ctx.put(torch.zeros(6), everyone, [pw.Shard(0)])
        assert chain(x).exception(timeout_s=60) is None
        os.kill(pids[0], signal.SIGKILL)
        doomed = chain(x)                       # sent down the tree before the controller knows
        children = ctx.mesh({"data": 2}, ids[1:3])
        after = step(ctx.put(torch.zeros(2), children, [pw.Shard(0)]))   # numbered after the launch: it waits
        error = doomed.exception(timeout_s=60)
        assert isinstance(error, pw.ExecutorLostError) and "executor-0" in str(error), error
        assert after.exception(timeout_s=30) is None
        survivors = ctx.mesh({"data": 5}, ids[1:])
        y = ctx.put(torch.zeros(5), survivors, [pw.Shard(0)])
        began = time.monotonic()
        for _ in range(5):
            y = chain(y)
        assert y.exception(timeout_s=60) is None and time.monotonic() - began < 30
        sent = ctx.stats()["controller_messages"]
        assert sent.get("launch_tree") == 6 + 5   # the first tree, then one of the five survivors


def test_a_pipeline_down_a_tree_recovers_a_killed_executor_onto_a_replacement_with_the_losses_of_an_unbroken_run(
        tmp_path):
    """A 1F1B pipeline's steps (one program on all 4 executors) go down a tree; executor-3 is SIGKILLed after step 7
    of 12 (test_pipeline_recovery's run): it is replaced, its new process counts commands from zero, the survivors
    skip the gang places of the runs that failed, the last checkpoint is restored, the losses are those of an
    unbroken run, and the later steps go down a new tree."""
    from tests.integration.test_pipeline_recovery import HEARTBEAT_TIMEOUT_S, _recovers_exactly

    with pw.Context(num_executors=4, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, **TREE) as ctx:   # the default backend
        got, expected, stats = _recovers_exactly(ctx, tmp_path)
        sent = ctx.stats()["controller_messages"]
    assert got == expected
    assert stats["recoveries"] == 1, stats
    assert sent.get("tree_launch", 0) >= 2 * 12 and "run_program" not in sent, sent
    assert sent.get("launch_tree") == 2 * 4, sent   # the first tree, then one with the replacement


def test_sixty_four_simulated_executors_of_four_processes_take_runs_down_a_tree():
    with pw.Context(num_executors=64, backend="sim", sims_per_process=16, launch_fanout=8,
                    launch_tree_min_executors=64) as ctx:
        _, chain = _sim_chain(16, 0.001)
        x = ctx.put(torch.zeros(64), ctx.mesh({"data": 64}), [pw.Shard(0)])
        for _ in range(10):
            x = chain(x)
        assert x.exception(timeout_s=60) is None
        stats = ctx.stats()
        assert stats["controller_messages"].get("tree_launch") == 8 * 10
        assert stats["controller"]["handled_messages"].get("control:done_batch") == 8 * 10
        assert all(s["num_computations"] == 160 for s in stats["executors"].values())
