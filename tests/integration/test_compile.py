"""Background compiles (XLA) do not stall other work; the inductor backend runs captured graphs."""

from __future__ import annotations

import json

import pytest
import torch

import pathways_torch as pw

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _deep(x):
    # Enough distinct ops that XLA needs a noticeable time to compile it.
    for i in range(40):
        x = torch.tanh(x @ x.T @ x + i)
    return x


def test_a_long_xla_compile_lets_ready_work_run(tmp_path):
    with pw.Context(num_executors=1, backend="xla") as ctx:
        mesh = ctx.mesh({"data": 1})
        small = pw.function(lambda a: a + 1, name="small")
        deep = pw.function(_deep, name="deep")
        x = ctx.put(torch.zeros(4, 4), mesh, [pw.Replicate()])
        big = ctx.put(torch.randn(32, 32) / 32, mesh, [pw.Replicate()])
        small(x).result(timeout_s=60)                  # compiled and warm
        slow = deep(big)                              # first call: compiles in the background
        chain, count = x, 0
        while not slow.done() and count < 5000:
            chain = small(chain)                      # queued after `slow`, ready at once
            chain.result(timeout_s=60)                # awaited: they keep coming while `deep` compiles
            count += 1
        torch.testing.assert_close(chain.result(timeout_s=120), torch.full((4, 4), float(count)))
        torch.testing.assert_close(slow.result(timeout_s=120), _deep(big.result()), rtol=1e-4, atol=1e-5)
        trace = ctx.trace(str(tmp_path / "trace.json"))
    events = trace["traceEvents"]
    compile_span = next(e for e in events if e.get("ph") == "X" and e.get("cat") == "compile" and e["name"] == "deep")
    begin, end = compile_span["ts"], compile_span["ts"] + compile_span["dur"]
    during = [e for e in events if e.get("ph") == "X" and e["name"] == "small" and begin < e["ts"] < end]
    assert during, f"no 'small' computation ran during the {compile_span['dur'] / 1e3:.0f} ms compile of 'deep'"
    deep_run = next(e for e in events if e.get("ph") == "X" and e.get("cat") == "compute" and e["name"] == "deep")
    assert deep_run["ts"] >= end
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]


def test_inductor_backend_matches_eager():
    with pw.Context(num_executors=1, backend="inductor") as ctx:
        mesh = ctx.mesh({"data": 1})

        @pw.function
        def block(a, b):
            return torch.softmax(torch.relu(a @ b), dim=-1), (a * 2).sum()

        a_host, b_host = torch.randn(8, 16), torch.randn(16, 4)
        probs, total = block(ctx.put(a_host, mesh, [pw.Replicate()]), ctx.put(b_host, mesh, [pw.Replicate()]))
        expected = block.fn(a_host, b_host)
        torch.testing.assert_close(probs.result(timeout_s=200), expected[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(total.result(timeout_s=200), expected[1], rtol=1e-5, atol=1e-4)
        stats = ctx.stats()["executors"]
        assert [s["num_compiles"] for s in stats.values()] == [1]


def test_compiled_executables_persist_across_runs(tmp_path, monkeypatch):
    """xla:torchax writes each executable to the persistent cache: a second run of the same program finds them
    all (no new entry) and compiles faster."""
    from pathways_torch.wire.backend_names import route_installed

    if not route_installed("xla:torchax"):
        pytest.skip("the persistent cache belongs to the xla:torchax route")
    cache = tmp_path / "cache"
    monkeypatch.setenv("PATHWAYS_CACHE_DIR", str(cache))   # executors inherit it

    def run_once() -> float:
        with pw.Context(num_executors=1, backend="xla:torchax") as ctx:
            deep = pw.function(_deep, name="deep")
            x = ctx.put(torch.randn(32, 32) / 32, ctx.mesh({"data": 1}), [pw.Replicate()])
            torch.testing.assert_close(deep(x).result(timeout_s=120), _deep(x.result()), rtol=1e-4, atol=1e-5)
            events = ctx.trace(str(tmp_path / "trace.json"))["traceEvents"]
        return next(e["dur"] for e in events if e.get("cat") == "compile" and e["name"] == "deep") / 1e6

    def entries() -> set:
        return {p.name for p in cache.rglob("*") if p.is_file()}

    cold = run_once()
    written = entries()
    assert written, "the first run wrote nothing to the persistent compile cache"
    warm = run_once()
    assert entries() == written          # every executable came from the cache
    assert warm < cold, (cold, warm)


def test_xla_writes_into_a_donated_input_and_copies_one_that_is_still_held():
    def update(state, grad):
        mean = pw.all_reduce(grad, "data", "mean")   # a cut: stages, and intermediates given to the last one
        return state - 0.5 * mean

    with pw.Context(num_executors=2, backend="xla") as ctx:
        mesh = ctx.mesh({"data": 2})
        step = pw.function(update, donate_argnums=(0,))
        state_host, grad_host = torch.randn(8, 4), torch.randn(8, 4)
        grad = ctx.put(grad_host, mesh, [pw.Shard(0)])
        mean = (grad_host[:4] + grad_host[4:]) / 2
        state = ctx.put(state_host, mesh, [pw.Shard(0)])
        for _ in range(3):
            state = step(state, grad)                 # each call's old state is XLA's to write over
        torch.testing.assert_close(state.result(timeout_s=120), state_host - 1.5 * torch.cat([mean, mean]))
        assert all(s["handed_over"] >= 3 for s in ctx.stats()["executors"].values())
        # Made by XLA (a put's buffer is torch's, which XLA never takes): a buffer XLA would write over.
        held = pw.function(lambda a: a * 1, name="copy")(ctx.put(state_host, mesh, [pw.Shard(0)]))
        held.hold()                                   # as a checkpoint being written holds its step's state
        plain = pw.function(lambda s, g: s - 0.5 * g, name="plain", donate_argnums=(0,))   # one stage: XLA
        out = plain(held, grad)                       # would write over `held`; not given up: it gets a copy
        torch.testing.assert_close(out.result(timeout_s=120), state_host - 0.5 * grad_host)
        torch.testing.assert_close(held.result(timeout_s=60), state_host)   # the stored array is intact
