"""The simulated device: no torch in the executor, deadlines kept, 64 executors on a small machine."""

from __future__ import annotations

import time

import pytest
import torch

import pathways_torch as pw

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _imports_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def test_sim_executor_occupies_its_device_and_imports_no_torch():
    with pw.Context(num_executors=2, backend="sim") as ctx:
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


def test_64_sim_executors_fit_and_run_one_gang_step():
    with pw.Context(num_executors=64, backend="sim", start_timeout_s=180) as ctx:
        mesh = ctx.mesh({"data": 64})
        step = pw.function(lambda x: x + 1, name="step", sim_time_s=0.001)
        x = ctx.put(torch.zeros(64), mesh, [pw.Shard(0)])
        out = step(step(x))
        assert out.exception(timeout_s=60) is None
        stats = ctx.stats()["executors"]
        assert len(stats) == 64 and all(s["num_computations"] == 2 for s in stats.values())
