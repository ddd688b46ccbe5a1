"""A peer that stops reading (issue 15): SIGSTOP one executor while others work.

Executor 0 pushes 64 MB to the stopped executor (more than the sockets' buffers hold),
so its messages back up; meanwhile its I/O thread must keep serving (a fetch from it),
calls on a mesh without the stopped executor go on, heartbeats to the others go on
(only the stopped one is declared lost), and what depends on it fails.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import pathways_torch as pw

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

HEARTBEAT_TIMEOUT_S = 3.0


def test_a_stopped_executor_is_found_and_the_others_go_on():
    with pw.Context(num_executors=3, backend="eager", heartbeat_interval_s=0.2,
                    heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as ctx:
        pair, alone, stalled = (ctx.mesh({"data": 2}, executors=[0, 1]), ctx.mesh({"data": 1}, executors=[0]),
                                ctx.mesh({"data": 1}, executors=[2]))
        add_one = pw.function(lambda x: x + 1, name="add_one")
        big = torch.arange(2 * 1024 * 1024, dtype=torch.float32)       # 8 MB
        on_zero = ctx.put(big, alone, [pw.Replicate()])
        y = ctx.put(torch.zeros(4), pair, [pw.Shard(0)])
        add_one(y).result(60)
        add_one.on(stalled)(on_zero).result(60)                     # loaded there; the transfer path works
        # Index 2 in registration order (the order mesh indices use): not necessarily the one named executor-2.
        stopped_id, stopped_pid = ctx.executor_ids[2], ctx.executor_pids[2]
        os.kill(stopped_pid, signal.SIGSTOP)
        try:
            stopped_at = time.monotonic()
            # Executor 0 must push 8 x 8 MB to the stopped one: its sends back up.
            doomed = [add_one.on(stalled)(on_zero) for _ in range(8)]
            for _ in range(50):
                y = add_one(y)
            assert torch.equal(y.result(30), torch.full((4,), 50.0))      # a mesh without it goes on
            assert torch.equal(on_zero.result(30), big)                   # executor 0's I/O thread serves
            for future in doomed:
                with pytest.raises(pw.ExecutorLostError, match=stopped_id):
                    future.result(4 * HEARTBEAT_TIMEOUT_S + 10)
            found_after = time.monotonic() - stopped_at
            assert found_after < 2 * HEARTBEAT_TIMEOUT_S + 5, found_after
            stats = ctx.stats()
            assert stats["controller"]["lost_executors"] == [stopped_id]   # heartbeats to the others went on
            for _ in range(10):
                y = add_one(y)
            assert torch.equal(y.result(30), torch.full((4,), 60.0))
        finally:
            os.kill(stopped_pid, signal.SIGCONT)   # let it read its Shutdown and exit
