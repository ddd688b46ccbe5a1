"""Copies between executors of one host go through shared-memory rings (executor/shm_ring.py,
executor/host_rings.py): the same values as eager, and as copies over ZeroMQ (``PATHWAYS_SHM_RINGS=0``); sizes
from one byte to several times the ring (chunked); nothing left in ``/dev/shm``; a writer killed mid-stream fails
the call that waited for it, naming the executor, and the other executor serves on."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import pathways_torch as pw
from bench.cpu_per_call import increment, hops_program
from tests.conftest import dev_shm_names
from tests.handles import cluster_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SIZES = (1, 16 * 1024, 3 * (8 << 20) // 4 + 5)   # a byte; a 64 KB hop; 24 MiB (float32): chunked through an 8 MiB ring


def _hops(ctx, nodes: int = 6):
    return hops_program(ctx, nodes)


def _ring_counts(ctx) -> tuple[int, int]:
    executors = ctx.stats()["executors"]
    sent = sum(executors[e]["hop_bytes"].get("ring_copies_sent", 0) for e in ctx.executor_ids)
    received = sum(executors[e]["hop_bytes"].get("ring_copies_received", 0) for e in ctx.executor_ids)
    return sent, received


def _run_every_size(ctx) -> list[torch.Tensor]:
    hops, first = _hops(ctx)
    results = []
    for size in SIZES:
        host = torch.arange(size, dtype=torch.float32)
        for _ in range(2):   # the first copies to a peer carry the invite over ZeroMQ; then the ring
            out = hops(ctx.put(host, first, [pw.Replicate()])).result(timeout_s=120)
        torch.testing.assert_close(out, host + 6)
        results.append(out)
    return results


def test_copies_inside_a_host_go_through_rings_with_the_values_of_copies_over_zeromq(monkeypatch):
    before = dev_shm_names()
    with pw.Context(num_executors=2, backend="eager") as ctx:
        through_rings = _run_every_size(ctx)
        sent, received = _ring_counts(ctx)
    assert sent >= 2 * len(SIZES) and received == sent, (sent, received)
    assert dev_shm_names() == before                       # memfds and abstract sockets: nothing named is left
    monkeypatch.setenv("PATHWAYS_SHM_RINGS", "0")     # the executors started now copy over ZeroMQ
    with pw.Context(num_executors=2, backend="eager") as ctx:
        over_zeromq = _run_every_size(ctx)
        assert _ring_counts(ctx) == (0, 0)
    for a, b in zip(through_rings, over_zeromq):
        assert torch.equal(a, b)


def test_a_writer_killed_mid_stream_fails_the_waiting_call_naming_it_and_the_reader_serves_on():
    with pw.Context(num_executors=2, backend="eager", heartbeat_timeout_s=2.0) as ctx:
        hops, first = _hops(ctx)
        x = ctx.put(torch.ones(16 * 1024), first, [pw.Replicate()])
        hops(x).result(timeout_s=60)
        hops(x).result(timeout_s=60)
        assert _ring_counts(ctx)[0] > 0
        big = ctx.put(torch.ones(6 << 20), first, [pw.Replicate()])   # 24 MiB: chunks while the writer dies
        pending = [hops(big) for _ in range(3)]
        os.kill(cluster_of(ctx).processes[1].pid, signal.SIGKILL)
        with pytest.raises(pw.ExecutorLostError, match="executor-1"):
            for future in pending:
                future.result(timeout_s=60)
        alone = ctx.mesh({"data": 1}, executors=[0])
        torch.testing.assert_close(increment.on(alone)(ctx.put(torch.zeros(4), alone, [pw.Replicate()]))
                                   .result(timeout_s=60), torch.ones(4))
