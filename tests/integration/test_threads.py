"""One context, several client threads (issue 15): every result checked.

Two threads call functions on one mesh, thousands of calls each, chained (a lost, doubled
or misrouted call changes the value); a loader thread puts (and reads back) batches
while the main thread steps a trainer, whose losses must equal those of the same run
with no other thread (to float64 rounding).
"""

from __future__ import annotations

import threading

import pytest
import torch

import pathways_torch as pw

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CALLS_PER_THREAD = 2000
CHECK_EVERY = 100


@pytest.fixture(scope="module")
def ctx():
    with pw.Context(num_executors=2, backend="eager") as ctx:
        yield ctx


def _run_threads(targets) -> list:
    errors = []

    def guarded(target):
        try:
            target()
        except BaseException as exc:   # reported by the test, not lost in a thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(240)
    assert not any(thread.is_alive() for thread in threads), "a client thread hung"
    return errors


def test_two_threads_calling_on_one_mesh_get_every_result(ctx):
    mesh = ctx.mesh({"data": 2})
    add_one = pw.function(lambda x: x + 1, name="add_one")
    scale = pw.function(lambda x: x * 1.0, name="scale")       # a second function: caches shared by both
    checks: dict[int, list] = {0: [], 1: []}

    def calls(thread: int):
        def run():
            start = float(thread * 1_000_000)
            x = ctx.put(torch.full((4,), start, dtype=torch.float64), mesh, [pw.Shard(0)])
            for i in range(CALLS_PER_THREAD):
                x = scale(add_one(x))
                if (i + 1) % CHECK_EVERY == 0:
                    checks[thread].append((start + i + 1, x))
        return run

    errors = _run_threads([calls(0), calls(1)])
    assert not errors, errors
    for thread, expected in checks.items():
        assert len(expected) == CALLS_PER_THREAD // CHECK_EVERY
        for value, array in expected:
            assert torch.equal(array.result(60), torch.full((4,), value, dtype=torch.float64)), (thread, value)
    assert add_one.num_traces == 1 and scale.num_traces == 1   # one capture each, though two threads asked


def _trainer(ctx, mesh):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    return ctx.wrap(model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
                    loss_fn=torch.nn.functional.mse_loss, mesh=mesh)


def test_a_loader_thread_puts_while_the_main_thread_steps(ctx):
    mesh = ctx.mesh({"data": 2})
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=generator, dtype=torch.float64),
                torch.randn(8, 1, generator=generator, dtype=torch.float64)) for _ in range(100)]
    alone = _trainer(ctx, mesh)
    expected = [alone.step(b).result(60).item() for b in batches]

    loaded = []

    def loader():
        for i in range(300):
            tensor = torch.arange(12, dtype=torch.float64) + i
            loaded.append((tensor, ctx.put(tensor, mesh, [pw.Shard(0)])))
            if i % 10 == 0:
                assert torch.equal(loaded[-1][1].result(60), tensor)

    losses = []

    def stepper():
        trainer = _trainer(ctx, mesh)
        futures = [trainer.step(b) for b in batches]
        losses.extend(f.result(60).item() for f in futures)

    errors = _run_threads([loader, stepper])
    assert not errors, errors
    # The same run (float64; the all-reduce may round the last bit differently between runs).
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-12, atol=0)
    assert len(loaded) == 300
    for tensor, array in loaded:
        assert torch.equal(array.result(60), tensor)
