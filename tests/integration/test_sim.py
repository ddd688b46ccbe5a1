"""The simulated device: no torch in the executor, deadlines kept, 64 executors on a small machine.

The tests run with executors as processes of their own (``None``) and with ``sims_per_process`` K = 16 (and the
first with K = 1: `executor.sim_host`, K simulated executors on one loop in one process).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import pathways_torch as pw
from pathways_torch.wire.seam import Executors
from tests.handles import client_of, server_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _imports_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


@pytest.mark.parametrize("per_process", [None, 1, 16])
def test_sim_executor_occupies_its_device_and_imports_no_torch(per_process):
    with pw.Context(num_executors=2, backend="sim", sims_per_process=per_process) as ctx:
        assert len(set(ctx.executor_pids)) == (1 if per_process == 16 else 2)
        mesh = ctx.mesh({"data": 2})
        busy = pw.function(lambda x: (x * 2).sum(0, keepdim=True), name="busy", sim_time_s=0.02)
        x = ctx.put(torch.ones(4, 3), mesh, [pw.Shard(0)])
        y = busy(x)
        assert y.shape == (2, 3)
        assert torch.equal(y.result(timeout_s=30), torch.zeros(2, 3))   # placeholders of the traced shape
        began = time.perf_counter()
        z = x
        for _ in range(10):
            z = busy.on(mesh)(ctx.put(torch.ones(4, 3), mesh, [pw.Shard(0)]))
        z.exception(timeout_s=30)
        elapsed = time.perf_counter() - began
        assert 0.2 <= elapsed < 0.6, elapsed          # 10 runs × 20 ms, back to back on each device
        assert not any(_imports_torch(pid) for pid in ctx.executor_pids)


@pytest.mark.parametrize("per_process", [None, 16])   # K = 1 is the test above's (64 hosts of 1 check no more)
def test_64_sim_executors_fit_and_run_one_gang_step(per_process):
    with pw.Context(num_executors=64, backend="sim", start_timeout_s=180, sims_per_process=per_process) as ctx:
        assert len(set(ctx.executor_pids)) == (4 if per_process else 64)
        if per_process == 16:   # the open files a host needs stay within what --sim-count checks for
            from executor.sim_host import FILES_PER_PROCESS, FILES_PER_SIM

            for pid in set(ctx.executor_pids):
                assert len(os.listdir(f"/proc/{pid}/fd")) <= FILES_PER_PROCESS + FILES_PER_SIM * 16
        mesh = ctx.mesh({"data": 64})
        step = pw.function(lambda x: x + 1, name="step", sim_time_s=0.001)
        x = ctx.put(torch.zeros(64), mesh, [pw.Shard(0)])
        out = step(step(x))
        assert out.exception(timeout_s=60) is None
        stats = ctx.stats()["executors"]
        assert len(stats) == 64 and all(s["num_computations"] == 2 for s in stats.values())


def test_executors_ping_less_often_when_together_they_would_pass_the_controllers_heartbeat_budget():
    """16 executors at 0.5 s would ping 32 times a second; with a budget of 8 a second the answers ask each for one
    every 2 s (16 / 8), and the controller hears about 8 a second, with work still running."""
    with pw.Context(num_executors=16, backend="sim", sims_per_process=16, max_heartbeats_per_s=8) as ctx:
        server = server_of(ctx)
        time.sleep(2.5)   # the first answers ask for the longer interval; the pings already sent still come
        before = server.handled_messages["heartbeat"]
        time.sleep(6.0)
        rate = (server.handled_messages["heartbeat"] - before) / 6.0
        assert 5.0 <= rate <= 11.0, rate
        mesh = ctx.mesh({"data": 16})
        step = pw.function(lambda x: x + 1, name="step", sim_time_s=0.001)
        assert step(ctx.put(torch.zeros(16), mesh, [pw.Shard(0)])).exception(timeout_s=30) is None


def test_a_killed_simulating_process_loses_its_executors_and_the_others_go_on(tmp_path):
    """Failure at scale, small: 32 executors in 2 processes; SIGKILL one. Its 16 are declared lost at once (the
    launcher sees the exit), a call that needs them fails naming one, and a Chained loop on the others goes on.
    Each survivor pings every 100 s here (a quarter of the timeout: a budget of 0.01 heartbeats a second for all),
    yet hears of the losses at once: the controller tells them on their heartbeat connections, unasked."""
    import signal

    with pw.Context(num_executors=32, backend="sim", sims_per_process=16, max_heartbeats_per_s=0.01,
                    heartbeat_timeout_s=400, log_dir=str(tmp_path)) as ctx:
        ids, pids = ctx.executor_ids, ctx.executor_pids
        victim = pids[-1]
        lost = [e for e, pid in zip(ids, pids) if pid == victim]
        alive = [e for e in ids if e not in lost]
        assert len(lost) == 16
        step = pw.function(lambda x: x + 1, name="step", sim_time_s=0.002)

        @pw.program(name="chain")
        def chain(x):
            for _ in range(8):
                x = step(x)
            return x

        survivors, doomed = ctx.mesh({"data": 16}, alive), ctx.mesh({"data": 16}, lost)
        x = ctx.put(torch.zeros(16), survivors, [pw.Shard(0)])
        y = ctx.put(torch.zeros(16), doomed, [pw.Shard(0)])
        assert chain(y).exception(timeout_s=60) is None
        pending = pw.function(lambda x: x + 1, name="long", sim_time_s=30)(y)
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        error = pending.exception(timeout_s=60)
        assert isinstance(error, pw.ExecutorLostError), error
        assert any(e in str(error) for e in lost), error
        while time.monotonic() - killed < ctx.config.heartbeat_timeout_s:   # the loss bound
            lost_now = {info.executor_id for info in client_of(ctx).request(Executors()) if info.lost}
            if lost_now == set(lost):
                break
            time.sleep(0.01)
        assert lost_now == set(lost)
        for _ in range(3):
            x = chain(x)
        assert torch.equal(x.result(timeout_s=60), torch.zeros(16))   # placeholders: the runs completed

        def told() -> set:   # the survivors that abandoned the lost executor-31's groups (their host logs it)
            logs = "".join(path.read_text(errors="replace") for path in tmp_path.glob("*.log"))
            return {e for e in alive if f"executor {e}: {lost[-1]}@1 lost; abandoned" in logs}

        while told() != set(alive) and time.monotonic() - killed < 4.0:
            time.sleep(0.1)
        assert told() == set(alive), sorted(set(alive) - told())   # long before their next pings
