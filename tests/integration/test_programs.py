"""Programs on a real cluster: results, constant messages per run, per-node sequence numbers,
parallel dispatch hiding control latency, and Python control flow refused."""

from __future__ import annotations

import gc
import time

import pytest
import torch

import pathways_torch as pw
from tests.conftest import wait_until
from tests.service import open_context

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def ctx(client_kind, service_if_remote):   # the embedded controller, then a remote one
    with open_context(client_kind, service_if_remote, num_executors=4, backend="eager") as context:
        yield context


inc = pw.function(lambda x: x + 1, name="inc")


@pw.function(out=pw.Replicate())
def total(x):
    return pw.all_reduce(x.sum(), axis="data")


def _chain(num_nodes: int):
    @pw.program(name=f"chain{num_nodes}")
    def chain(x):
        for _ in range(num_nodes):
            x = inc(x)
        return x

    return chain


def _run_messages(ctx) -> dict:
    # what the controller sent, the stats requests reading it aside
    return {k: v for k, v in ctx.stats()["controller_messages"].items() if k not in ("heartbeat", "stats_request")}


def test_program_across_meshes_matches_eager_and_prints(ctx):
    mesh_a, mesh_b = ctx.mesh({"data": 2}, executors=[0, 1]), ctx.mesh({"data": 2}, executors=[2, 3])

    @pw.program
    def pipeline(x):
        y = inc(x)
        z = inc.on(mesh_b)(y)
        return z, total(z)

    host = torch.randn(4, 3)
    x = ctx.put(host, mesh_a, [pw.Shard(0)])
    text = str(pipeline.graph(x))
    assert text.splitlines()[0].startswith("program pipeline(%0: float32[4, 3]")
    assert "%2 = inc(%1) @mesh" in text and "return %2, %3" in text
    z, t = pipeline(x)
    torch.testing.assert_close(z.result(timeout_s=60), host + 2)
    torch.testing.assert_close(t.result(timeout_s=60), (host + 2).sum())
    assert "(copy)" in ctx.lowered(pipeline, x)            # the hop between meshes is a push
    # ... sent from the compute thread that made the value, not handed to the I/O thread (executor/direct_peers.py)
    executors = ctx.stats()["executors"]
    assert sum(executors[e]["hop_bytes"].get("sent_from_compute", 0) for e in ctx.executor_ids[:2]) >= 2
    z2, t2 = pipeline(x)                                    # a second run reuses the registration
    assert pipeline.num_traces == 1
    torch.testing.assert_close(t2.result(timeout_s=60), (host + 2).sum())


@pytest.mark.parametrize("num_nodes", [8, 128])
def test_a_run_costs_one_message_per_executor_whatever_its_size(ctx, num_nodes):
    mesh = ctx.mesh({"data": 4})
    chain = _chain(num_nodes)
    x = ctx.put(torch.zeros(8), mesh, [pw.Shard(0)])
    chain(x).result(timeout_s=120)                          # first run: registers (LoadFunction etc.)
    before = _run_messages(ctx)
    out = chain(x)
    after = _run_messages(ctx)
    sent = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert sent == {"run_program": 4}                       # the same for 8 and 128 nodes
    torch.testing.assert_close(out.result(timeout_s=120), torch.full((8,), float(num_nodes)))


def test_every_node_keeps_its_own_sequence_number(ctx, tmp_path):
    mesh = ctx.mesh({"data": 4})
    chain = _chain(8)
    x = ctx.put(torch.zeros(8), mesh, [pw.Shard(0)])
    chain(x).result(timeout_s=60)
    trace = ctx.trace(str(tmp_path / "trace.json"))
    per_executor = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") == "compute" and e["name"] == "inc":
            per_executor.setdefault(e["pid"], []).append(e["args"]["seq"])
    for seqs in per_executor.values():
        last_run = sorted(seqs)[-8:]
        assert last_run == list(range(last_run[0], last_run[0] + 8))


def _programs_held(ctx) -> dict:
    return {executor_id: s["programs_held"] for executor_id, s in ctx.stats()["executors"].items()}


def test_a_dropped_program_is_forgotten_by_every_executor_once_its_run_in_flight_ends(ctx):
    mesh = ctx.mesh({"data": 4})
    x = ctx.put(torch.zeros(8), mesh, [pw.Shard(0)])
    gc.collect()
    inc(x).result(timeout_s=60)   # programs earlier tests dropped are forgotten with this call
    before = _programs_held(ctx)
    chain = _chain(3)
    out = chain(x)
    assert _programs_held(ctx) == {e: n + 1 for e, n in before.items()}
    del chain   # its run may still be in flight: the executors keep its plan until the run ends
    gc.collect()
    inc(x).result(timeout_s=60)
    assert torch.equal(out.result(timeout_s=60), torch.full((8,), 3.0))
    assert _programs_held(ctx) == before


def _functions_held(ctx) -> dict:
    return {executor_id: s["functions_held"] for executor_id, s in ctx.stats()["executors"].items()}


def test_a_dropped_function_is_forgotten_by_every_executor_once_its_calls_and_its_programs_runs_end(ctx):
    mesh = ctx.mesh({"data": 4})
    x = ctx.put(torch.ones(8), mesh, [pw.Shard(0)])
    gc.collect()
    inc(x).result(timeout_s=60)   # functions earlier tests dropped are forgotten with this call
    before = _functions_held(ctx)
    double = pw.function(lambda a: a * 2, name="double")

    @pw.program(name="double_twice")
    def twice(a):
        return double(double(a))

    direct, program = double(x), twice(x)
    assert _functions_held(ctx) == {e: n + 1 for e, n in before.items()}   # one version: the program's nodes too
    del double, twice    # their runs may still be in flight: the executors keep the function until they end
    gc.collect()
    inc(x).result(timeout_s=60)
    assert torch.equal(direct.result(timeout_s=60), torch.full((8,), 2.0))
    assert torch.equal(program.result(timeout_s=60), torch.full((8,), 4.0))
    inc(x).result(timeout_s=60)   # the forget rides on the next call once the runs ended
    assert wait_until(lambda: _functions_held(ctx) == before, 10), (before, _functions_held(ctx))


def test_python_control_flow_on_a_value_is_refused_at_the_line(ctx):
    mesh = ctx.mesh({"data": 4})

    @pw.program
    def branchy(x):
        y = inc(x)
        if y:                                               # needs a value: refused
            return inc(y)
        return y

    with pytest.raises(pw.CaptureError, match=r"if y:"):
        branchy(ctx.put(torch.zeros(4), mesh, [pw.Shard(0)]))


def test_parallel_dispatch_hides_control_latency():
    latency_s, num_nodes = 0.05, 6
    w = torch.randn(384, 384) / 20

    def heavy(x, w):
        for _ in range(6):
            x = torch.tanh(x @ w)
        return x

    with pw.Context(num_executors=2, backend="eager", inject_latency_s=latency_s) as ctx:
        meshes = [ctx.mesh({"data": 1}, executors=[0]), ctx.mesh({"data": 1}, executors=[1])]
        step = pw.function(heavy, name="heavy")
        ws = [ctx.put(w, m, [pw.Replicate()]) for m in meshes]
        x = ctx.put(torch.randn(384, 384), meshes[0], [pw.Replicate()])

        @pw.program
        def chain(x, w0, w1):
            for k in range(num_nodes):            # alternate executors: every hop crosses processes
                x = step.on(meshes[k % 2])(x, (w0, w1)[k % 2])
            return x

        chain(x, *ws).result(timeout_s=120)        # registration and warm-up
        began = time.perf_counter()
        step(x, ws[0]).result(timeout_s=60)
        compute_s = time.perf_counter() - began - latency_s   # one node, less its (one-way) control latency
        began = time.perf_counter()
        chain(x, *ws).result(timeout_s=120)
        program_s = time.perf_counter() - began
        trace = ctx.trace("/dev/null")
    # One latency for the run message, then the nodes back to back (plus transfers),
    # instead of one latency per node.
    sequential_s = num_nodes * (compute_s + latency_s)
    assert program_s < 0.8 * sequential_s, (program_s, compute_s)
    assert program_s < num_nodes * compute_s + 2 * latency_s + 0.02 * num_nodes, (program_s, compute_s)
    events = [e for e in trace["traceEvents"] if e.get("args", {}).get("seq")]
    last = max(e["args"]["seq"] for e in events)
    received = {e["args"]["seq"]: e["ts"] for e in events if e.get("cat") == "receive"}
    started = {e["args"]["seq"]: e["ts"] for e in events if e.get("cat") == "compute"}
    seqs = list(range(last - num_nodes + 1, last + 1))
    # The first node starts the moment its run message lands; from then on every node is
    # already waiting on its executor before its predecessor starts.
    for k, k_next in zip(seqs[1:], seqs[2:]):
        assert received[k_next] < started[k], f"node {k_next} was enqueued only after node {k} started"


def test_a_program_traced_in_one_context_is_traced_anew_in_the_next():
    chain = _chain(3)
    results = []
    for size in (1, 2):
        with pw.Context(num_executors=size, backend="eager") as ctx:
            mesh = ctx.mesh({"data": size})
            out = chain(ctx.put(torch.zeros(2 * size), mesh, [pw.Shard(0)]))
            results.append(out.result(timeout_s=60))
    assert chain.num_traces == 2
    torch.testing.assert_close(results[1], torch.full((4,), 3.0))


positive = pw.function(lambda x: x[x > 0], name="positive")
double = pw.function(lambda x: x * 2, name="double")


def test_a_data_dependent_output_size_is_learned_before_its_readers_are_dispatched(ctx):
    one = ctx.mesh({"data": 1}, executors=[0])
    host = torch.tensor([1.0, -3, 2, -0.5, 4, -1])
    x = ctx.put(host, one, [pw.Replicate()])
    y = positive(x)
    assert not y.shape_known and y.shape == (None,)        # returned at once; the size is not known yet
    z = double(y)                                           # waits for y's size, then traces and dispatches
    assert y.shape == (3,) and z.shape == (3,)
    torch.testing.assert_close(z.result(timeout_s=60), host[host > 0] * 2)
    events = ctx.trace("/dev/null")["traceEvents"]
    marked = [e for e in events if e.get("cat") == "compute" and e.get("name") == "positive"]
    assert marked and marked[-1]["args"]["detail"] == "data-dependent output shapes: sequential dispatch"


def test_a_program_with_a_data_dependent_node_falls_back_to_sequential_dispatch(ctx):
    @pw.program
    def masked(x):
        return double(positive(inc(inc(x))))

    one = ctx.mesh({"data": 1}, executors=[1])
    host = torch.tensor([1.0, -3, 2, -0.5, 4, -1])
    x = ctx.put(host, one, [pw.Replicate()])
    text = str(masked.graph(x))
    assert text.startswith("program masked: sequential dispatch — node 2 calls 'positive'"), text
    assert "nodes 0-1 run as one program, then the body runs call by call" in text
    lowered = ctx.lowered(masked, x)
    assert lowered.startswith(text) and "lowered masked[:2]: 2 nodes on 1 executors" in lowered
    expected = (host + 2)[host + 2 > 0] * 2
    for _ in range(2):                     # the fallback is remembered, and runs again
        before = dict(_run_messages(ctx))
        torch.testing.assert_close(masked(x).result(timeout_s=60), expected)
        sent = {k: v - before.get(k, 0) for k, v in _run_messages(ctx).items()}
        # the two static nodes as one RunProgram, then one Run each for positive and double
        assert sent.get("run_program") == 1 and sent.get("run") == 2, sent
    assert masked.num_traces == 1


def test_a_sequential_program_whose_body_calls_other_functions_when_replayed_is_refused(ctx):
    runs = []

    @pw.program
    def fickle(x):
        runs.append(1)
        y = inc(x) if len(runs) == 1 else double(x)    # traced with inc, replayed with double
        return positive(y)

    x = ctx.put(torch.tensor([1.0, -2.0]), ctx.mesh({"data": 1}, executors=[2]), [pw.Replicate()])
    with pytest.raises(pw.CaptureError, match="same functions in the same order"):
        fickle(x)


def test_shards_whose_data_dependent_sizes_differ_fail_with_both_shapes(ctx):
    two = ctx.mesh({"data": 2}, executors=[2, 3])
    x = ctx.put(torch.tensor([1.0, -3, 2, 4]), two, [pw.Shard(0)])   # 1 and 2 positives per shard
    error = positive(x).exception(timeout_s=60)
    assert isinstance(error, pw.PlacementError), error
    assert "different shapes" in str(error) and "[1]" in str(error) and "[2]" in str(error)
    with pytest.raises(pw.PlacementError, match="different shapes"):
        double(positive(x))                                 # a reader cannot be traced: it raises the cause
