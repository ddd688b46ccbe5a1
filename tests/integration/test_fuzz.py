"""Fuzzed ports (issues 15, 26): random and mutated messages of every body kind to every ZeroMQ port of a local
cluster, from the executors' own keys (under identities the controller accepts), from the client's key, from no
key and from a key on no allow-list.

The generator is `bench/fuzz.py`'s (which runs 100k inputs); here hypothesis draws its choices, a short budget.
After each example a well-formed call must give the right result in time. At the end: no process exited, the
executors computed only those calls (nothing ran that the controller did not send), the fuzzed inputs reached
the handlers of the controller's control, heartbeat and store connections and of the executors' data ports,
none got past a command port's role check, memory grew by little, and a model trained on the cluster matches
eager training.
"""

from __future__ import annotations

import random
import shutil
import tempfile

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pathways_torch as pw
from bench.fuzz_inputs import RandomChooser, body
from bench.fuzz import Window, alive, hints_of, keys_kept, message, probe, send, status_kb, targets, trains_like_eager

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

EXAMPLES = 60
HANDLING_PORTS = ("controller control", "controller heartbeat", "controller store", "executor-0 data",
                  "executor-1 data")
MESSAGES_PER_EXAMPLE = 25


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
    save_dir = tempfile.mkdtemp(prefix="pathways-fuzz-")
    with keys_kept() as keys, pw.Context(num_executors=2, backend="eager") as ctx:
        mesh = ctx.mesh({"data": 2})
        add_one = pw.function(lambda x: x + 1, name="add_one")
        probe(ctx, mesh, add_one, 60)
        yield ctx, mesh, add_one, targets(ctx, zctx, keys), hints_of(ctx, save_dir)
    zctx.destroy(linger=0)
    shutil.rmtree(save_dir, ignore_errors=True)


def test_fuzzed_ports_keep_serving_and_run_nothing_unsent(cluster):
    ctx, mesh, add_one, fuzzed, hints = cluster
    before = {e: s["num_computations"] for e, s in ctx.stats()["executors"].items()}
    rss_before = {pid: status_kb(pid, "VmRSS") for pid in ctx.executor_pids}
    window, probes = Window(ctx), []

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.data_too_large])
    @given(st.data())
    def example(data):
        chooser = HypothesisChooser(data)
        window.open()
        for _ in range(MESSAGES_PER_EXAMPLE):
            target = chooser.choice(fuzzed)
            send(target, message(chooser, hints, target.kinds))
        # And one unmutated message of a kind the port handles (its fields seeded by the example's number), to each
        # handling port in turn: hypothesis's derandomized CI profile favours simple draws, which can miss a port's
        # kinds entirely (not drawn from hypothesis: its draws must not depend on the example's number).
        seeded = RandomChooser(random.Random(len(probes)))
        port = HANDLING_PORTS[len(probes) % len(HANDLING_PORTS)]
        target = seeded.choice([t for t in fuzzed if t.admitted and t.port == port])
        send(target, [body(seeded, hints, seeded.choice(target.kinds)).SerializeToString()])
        window.close(settle_s=0.05)
        probe(ctx, mesh, add_one, 30)        # raises TimeoutError on a hang, AssertionError on a wrong result
        probes.append(1)

    example()
    assert alive(ctx) == []
    stats = ctx.stats()
    computed = {e: s["num_computations"] - before[e] for e, s in stats["executors"].items()}
    assert computed == {e: len(probes) for e in before}, computed   # only the well-formed calls ran
    reached = window.reached
    sent = {port: sum(t.sent for t in fuzzed if t.port == port and t.admitted) for port in {t.port for t in fuzzed}}
    for port in ["controller control", "controller heartbeat", "controller store",
                 *(f"{e} data" for e in ctx.executor_ids)]:
        assert 0 < reached[port] <= sent[port], (port, reached[port], sent[port])   # past the gates, to handlers
    for executor_id in ctx.executor_ids:
        assert reached[f"{executor_id} command"] == 0, reached   # only the controller's key gets past the role
    assert all(s["dropped_messages"] > 0 for s in stats["executors"].values())
    for pid, rss in rss_before.items():
        grown_mb = (status_kb(pid, "VmRSS") - rss) / 1024
        assert grown_mb < 64, f"executor {pid} grew {grown_mb:.0f} MB under fuzzing"
    assert trains_like_eager(ctx, mesh) < 1e-9
