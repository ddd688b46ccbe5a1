"""The runtime core on a real local cluster: 4 executor processes on loopback, shared by the module; each test runs
against the embedded controller and a remote one (`pathways-controller`, tests/service.py)."""

from __future__ import annotations

import gc
import json

import pytest
import torch

import pathways_torch as pw
from executor.allocator import DEFAULT_MMAP_THRESHOLD_MB
from tests.conftest import wait_until
from tests.service import open_context

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def ctx(client_kind, service_if_remote):
    # eager: data-dependent errors raise
    with open_context(client_kind, service_if_remote, num_executors=4, backend="eager") as context:
        yield context


@pytest.fixture(scope="module")
def mesh(ctx):
    return ctx.mesh({"data": 4})


def _store_bytes(ctx) -> dict:
    return {e: s["store_bytes"] for e, s in ctx.stats()["executors"].items()}


def test_quickstart_matches_eager_and_metadata_is_known_before_running(ctx, mesh):
    x_host, w_host, v_host = torch.randn(64, 32), torch.randn(32, 16), torch.randn(16, 16)
    x = ctx.put(x_host, mesh, [pw.Shard(0)])
    w = ctx.put(w_host, mesh, [pw.Replicate()])
    v = ctx.put(v_host, mesh, [pw.Replicate()])

    @pw.function
    def layer(a, b):
        return torch.relu(a @ b)

    y = layer(x, w)
    z = layer(y, v)
    assert z.shape == (64, 16) and z.dtype == torch.float32
    assert z.sharding.placements == (pw.Shard(0),)
    assert z.block_shape == (16, 16)
    torch.testing.assert_close(z.result(timeout_s=60), torch.relu(torch.relu(x_host @ w_host) @ v_host))
    assert z.done() and z.exception() is None
    torch.testing.assert_close(w.result(timeout_s=30), w_host)


def test_new_signature_traces_a_new_version_and_same_one_is_cached(ctx, mesh):
    @pw.function
    def double(a):
        return a * 2

    a = ctx.put(torch.ones(8, 4), mesh, [pw.Shard(0)])
    outs = [double(a) for _ in range(5)]
    assert double.num_traces == 1
    b = ctx.put(torch.ones(8, 6), mesh, [pw.Shard(0)])
    out_b = double(b)
    assert double.num_traces == 2
    torch.testing.assert_close(outs[-1].result(timeout_s=30), torch.full((8, 4), 2.0))
    torch.testing.assert_close(out_b.result(timeout_s=30), torch.full((8, 6), 2.0))


def test_bad_shapes_fail_on_the_client_before_dispatch(ctx, mesh):
    @pw.function
    def matmul(a, b):
        return a @ b

    a = ctx.put(torch.ones(8, 3), mesh, [pw.Shard(0)])
    b = ctx.put(torch.ones(5, 2), mesh, [pw.Replicate()])
    runs_before = ctx.stats()["controller_messages"]["run"]
    with pytest.raises(pw.CaptureError) as info:
        matmul(a, b)
    assert "float32[2, 3]" in str(info.value) and "float32[5, 2]" in str(info.value)
    assert ctx.stats()["controller_messages"]["run"] == runs_before
    torch.testing.assert_close(a.result(timeout_s=30), torch.ones(8, 3))  # nothing stored was lost


def test_per_shard_sum_gives_one_sum_per_shard(ctx, mesh):
    host = torch.arange(32, dtype=torch.float64).reshape(8, 4)
    x = ctx.put(host, mesh, [pw.Shard(0)])

    @pw.function
    def total(a):
        return a.sum()

    sums = total(x)
    assert sums.shape == (4,)
    torch.testing.assert_close(sums.result(timeout_s=30), host.reshape(4, 8).sum(1))


def test_cross_mesh_bytes_go_executor_to_executor(ctx):
    mesh_a = ctx.mesh({"data": 2}, executors=[0, 1])
    mesh_b = ctx.mesh({"data": 2}, executors=[2, 3])
    before = ctx.stats()
    host = torch.randn(16, 8)
    x = ctx.put(host, mesh_a, [pw.Shard(0)])

    @pw.function
    def square(a):
        return a * a

    y = square(x)                 # on mesh A
    z = square.on(mesh_b)(y)      # consumes A's output on B
    assert z.mesh is mesh_b
    # The same call site again, now with B's array: it runs where its input lives (a call
    # repeated with the same signature on another mesh of the same shape is not confused).
    for array, mesh in ((y, mesh_a), (z, mesh_b)):
        assert square(array).mesh is mesh
    torch.testing.assert_close(z.result(timeout_s=60), host ** 4)
    after = ctx.stats()
    moved = after["hops"]["executor->executor"] - before["hops"]["executor->executor"]
    assert moved == host.numel() * 4  # each of y's two blocks crossed once
    assert after["hops"]["controller relayed"] == 0
    # The put went only to A's executors; the fetch came only from B's.
    for executor_id in mesh_b.executor_ids:
        b0, b1 = before["executors"][executor_id]["hop_bytes"], after["executors"][executor_id]["hop_bytes"]
        assert b1.get("client->executor", 0) == b0.get("client->executor", 0)
    for executor_id in mesh_a.executor_ids:
        b0, b1 = before["executors"][executor_id]["hop_bytes"], after["executors"][executor_id]["hop_bytes"]
        assert b1.get("executor->client", 0) == b0.get("executor->client", 0)
        assert b1["client->executor"] - b0.get("client->executor", 0) == host.numel() * 4 // 2


def test_del_while_pending_then_store_returns_to_baseline(ctx, mesh):
    gc.collect()
    assert wait_until(lambda: all(v == 0 for v in _store_bytes(ctx).values()), 10), _store_bytes(ctx)

    @pw.function
    def layer(a, b):
        return torch.tanh(a @ b)

    x_host, w_host = torch.randn(32, 16), torch.randn(16, 16)
    x = ctx.put(x_host, mesh, [pw.Shard(0)])
    w = ctx.put(w_host, mesh, [pw.Replicate()])
    y = layer(x, w)
    z = layer(y, w)
    del y, x                      # still needed by z's pending computation
    gc.collect()
    torch.testing.assert_close(z.result(timeout_s=60), torch.tanh(torch.tanh(x_host @ w_host) @ w_host))
    del z, w
    gc.collect()
    assert wait_until(lambda: all(v == 0 for v in _store_bytes(ctx).values()), 10), _store_bytes(ctx)
    assert all(s["store_buffers"] == 0 for s in ctx.stats()["executors"].values())


def test_a_donated_input_is_freed_by_its_call_and_refused_afterwards(ctx, mesh):
    @pw.function(donate_argnums=(0,))
    def update(state, step):
        return state - 0.5 * step

    def handed_over():
        return sum(s["handed_over"] for s in ctx.stats()["executors"].values())

    before = handed_over()
    state_host, step_host = torch.randn(64, 8), torch.randn(64, 8)
    state = ctx.put(state_host, mesh, [pw.Shard(0)])
    step = ctx.put(step_host, mesh, [pw.Shard(0)])
    for _ in range(3):
        state = update(state, step)     # the old state is given up to the call that replaces it
    torch.testing.assert_close(state.result(timeout_s=60), state_host - 1.5 * step_host)
    assert handed_over() - before == 3 * mesh.size   # every executor freed each old state inside the call
    first = ctx.put(state_host, mesh, [pw.Shard(0)])
    again = update(first, step)
    with pytest.raises(pw.DonatedArrayError, match=f"array {first.array_id} was donated to a call of 'update'"):
        first.result(timeout_s=30)
    with pytest.raises(pw.DonatedArrayError, match="use that call's outputs"):
        update(first, step)
    torch.testing.assert_close(again.result(timeout_s=60), state_host - 0.5 * step_host)
    torch.testing.assert_close(step.result(timeout_s=30), step_host)   # not donated: kept


def test_a_function_that_writes_its_input_writes_a_copy_unless_the_input_was_given_up(ctx, mesh):
    def bump(state):
        state.add_(1)          # in place, as an optimizer's update is written
        return state

    kept, given = pw.function(bump), pw.function(bump, donate_argnums=(0,))
    x_host = torch.zeros(8, 4)
    x = ctx.put(x_host, mesh, [pw.Shard(0)])
    torch.testing.assert_close(kept(x).result(timeout_s=60), x_host + 1)
    torch.testing.assert_close(x.result(timeout_s=30), x_host)        # the stored array kept its value
    y = given(ctx.put(x_host, mesh, [pw.Shard(0)]))                    # written where it lies: no copy needed
    torch.testing.assert_close(given(y).result(timeout_s=60), x_host + 2)


def test_remote_error_reaches_every_dependent_and_spares_the_rest(ctx, mesh):
    @pw.function
    def gather_rows(a, index):
        return a[index]

    @pw.function
    def plus_one(a):
        return a + 1

    a = ctx.put(torch.randn(16, 4), mesh, [pw.Shard(0)])                   # local blocks of 4 rows
    good = ctx.put(torch.arange(4).repeat(4), mesh, [pw.Shard(0)])        # local blocks [0,1,2,3]
    bad = ctx.put(torch.tensor([0, 1, 2, 3] * 3 + [0, 0, 0, 99]), mesh, [pw.Shard(0)])  # 99 only on the last shard
    failed = gather_rows(a, bad)   # the failing line
    dependent = plus_one(failed)
    with pytest.raises(pw.RemoteError) as info:
        failed.result(timeout_s=30)
    error = info.value
    assert isinstance(error, pw.PathwaysError)
    assert "index" in error.remote_traceback.lower() and "Traceback" in error.remote_traceback
    assert "failed = gather_rows(a, bad)" in error.call_site
    assert error.executor_id == mesh.executor_ids[3]
    assert dependent.exception(timeout_s=30) is error
    with pytest.raises(pw.RemoteError):
        dependent.result(timeout_s=30)
    ok = gather_rows(a, good)
    assert ok.result(timeout_s=30).shape == (16, 4)
    assert a.result(timeout_s=30).shape == (16, 4)


def test_trace_has_compute_events_with_sequence_numbers(ctx, mesh, tmp_path):
    @pw.function
    def inc(a):
        return a + 1

    x = ctx.put(torch.zeros(4, 4), mesh, [pw.Shard(0)])
    inc(inc(x)).result(timeout_s=30)
    path = tmp_path / "trace.json"
    ctx.trace(str(path))
    trace = json.loads(path.read_text())
    computes = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "compute" and e["name"] == "inc"]
    assert len(computes) >= 8  # 2 calls × 4 executors
    assert {e["pid"] for e in computes} == {0, 1, 2, 3}
    seqs = sorted({e["args"]["seq"] for e in computes})
    assert len(seqs) >= 2 and all(s > 0 for s in seqs)
    kinds = {e.get("cat") for e in trace["traceEvents"]}
    assert {"receive", "compute"} <= kinds


def test_torch_tensor_argument_is_refused_with_a_fix(ctx, mesh):
    @pw.function
    def f(a, b):
        return a + b

    x = ctx.put(torch.zeros(4), mesh, [pw.Shard(0)])
    with pytest.raises(pw.PlacementError, match="ctx.put"):
        f(x, torch.zeros(1))
    with pytest.raises(pw.PlacementError, match="divisible"):
        ctx.put(torch.zeros(6), mesh, [pw.Shard(0)])


def test_executors_run_with_the_allocator_settings_that_return_freed_buffers(ctx):
    """executor/allocator.py: huge pages asked for by the launcher, the mmap threshold set by the executor (its
    effect is measured by tests/unit/test_allocator.py and bench/sharding.py)."""
    pids = ctx.executor_pids
    if not pids:
        pytest.skip("a remote service's executors are not this process's children")
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        assert b"glibc.malloc.hugetlb=1" in environ.get(b"GLIBC_TUNABLES", b""), pid
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        # The context's setting, or (a service's executors) the executor's own default: both 2 MiB.
        given = argv[argv.index(b"--mmap-threshold-mb") + 1] if b"--mmap-threshold-mb" in argv else None
        assert given in (b"2.0", None) and DEFAULT_MMAP_THRESHOLD_MB == 2.0, argv
