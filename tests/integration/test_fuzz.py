"""Fuzzed ports (issue 15): random and mutated messages to every ZeroMQ port of a local cluster.

The generator is `bench/fuzz.py`'s (which runs 100k inputs); here hypothesis draws its
choices, a short budget. From the client's key (authenticated), from no key and from a
key on no allow-list, to the controller and to each executor's data and command ports.
After each example a well-formed call must give the right result in time; at the end no
process has exited, the executors computed only those calls (nothing ran that the
controller did not send), and their memory grew by little.
"""

from __future__ import annotations

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pathways_torch as pw
from bench.fuzz import message, probe, send, status_kb, targets

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

EXAMPLES = 300
MESSAGES_PER_EXAMPLE = 10


class HypothesisChooser:
    """`bench.fuzz`'s choices drawn from hypothesis (so a failure shrinks to a small input)."""

    def __init__(self, data):
        self.data = data

    def integer(self, low: int, high: int) -> int:
        return self.data.draw(st.integers(low, high))

    def choice(self, options):
        return self.data.draw(st.sampled_from(list(options)))

    def raw(self, size: int) -> bytes:
        return self.data.draw(st.binary(min_size=size, max_size=size))


@pytest.fixture(scope="module")
def cluster():
    zctx = zmq.Context()
    with pw.Context(num_executors=2, backend="eager") as ctx:
        mesh = ctx.mesh({"data": 2})
        add_one = pw.function(lambda x: x + 1, name="add_one")
        probe(ctx, mesh, add_one, 60)
        yield ctx, mesh, add_one, targets(ctx, zctx)
    zctx.destroy(linger=0)


def test_fuzzed_ports_keep_serving_and_run_nothing_unsent(cluster):
    ctx, mesh, add_one, fuzzed = cluster
    before = {e: s["num_computations"] for e, s in ctx.stats()["executors"].items()}
    rss_before = {pid: status_kb(pid, "VmRSS") for pid in ctx.executor_pids}
    probes = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.data_too_large])
    @given(st.data())
    def example(data):
        chooser = HypothesisChooser(data)
        for _ in range(MESSAGES_PER_EXAMPLE):
            send(chooser.choice(fuzzed), message(chooser))
        probe(ctx, mesh, add_one, 30)        # raises TimeoutError on a hang, AssertionError on a wrong result
        probes.append(1)

    example()
    assert ctx._cluster.newly_exited() == []
    stats = ctx.stats()
    assert stats["controller"]["lost_executors"] == []
    computed = {e: s["num_computations"] - before[e] for e, s in stats["executors"].items()}
    assert computed == {e: len(probes) for e in before}, computed   # only the well-formed calls ran
    assert sum(t.sent for t in fuzzed) > EXAMPLES                    # inputs did reach the ports
    assert stats["controller"]["dropped_messages"] > 0
    assert all(s["dropped_messages"] > 0 for s in stats["executors"].values())
    for pid, rss in rss_before.items():
        grown_mb = (status_kb(pid, "VmRSS") - rss) / 1024
        assert grown_mb < 64, f"executor {pid} grew {grown_mb:.0f} MB under fuzzing"
