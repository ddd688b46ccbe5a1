"""What a closing context does to its futures: none waits forever (issue 15, "Exit")."""

from __future__ import annotations

import time

import pytest
import torch

import pathways_torch as pw

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _slow(ctx, seconds: float = 30.0):
    """A call that stays pending for ``seconds`` on simulated devices, and the line it was made on."""
    mesh = ctx.mesh({"data": 1})
    busy = pw.function(lambda x: x + 1, name="busy", sim_time_s=seconds)
    x = ctx.put(torch.zeros(2), mesh, [pw.Replicate()])
    return busy(x)   # the call site named by the error


def test_pending_futures_fail_at_exit_naming_their_call_site():
    with pw.Context(num_executors=1, backend="sim") as ctx:
        mesh = ctx.mesh({"data": 1})
        fetched = ctx.put(torch.ones(3), mesh, [pw.Replicate()])
        value = fetched.result(timeout_s=30)
        never_fetched = ctx.put(torch.ones(3), mesh, [pw.Replicate()])
        never_fetched.exception(timeout_s=30)
        pending = _slow(ctx)
        assert not pending.done()
    began = time.monotonic()
    with pytest.raises(pw.ContextClosedError) as caught:
        pending.result()                             # no timeout: it must not wait forever
    assert time.monotonic() - began < 1.0
    assert "'busy'" in str(caught.value) and "the context closed" in str(caught.value)
    assert "test_exit.py" in str(caught.value) and "return busy(x)" in str(caught.value)
    assert isinstance(pending.exception(), pw.ContextClosedError)
    # Fetched before the exit: still readable; computed but never fetched: gone, and it says so.
    assert torch.equal(fetched.result(), value)
    with pytest.raises(pw.ContextClosedError, match="never fetched"):
        never_fetched.result()


def test_an_exception_in_the_block_fails_pending_futures_at_once():
    with pytest.raises(KeyError):
        with pw.Context(num_executors=1, backend="sim") as ctx:
            pending = _slow(ctx)
            raise KeyError("the user's bug")
    with pytest.raises(pw.ContextClosedError, match="closed on KeyError"):
        pending.result(timeout_s=1)


def test_a_timeout_leaves_the_future_usable_and_timeout_is_accepted():
    with pw.Context(num_executors=1, backend="sim") as ctx:
        pending = _slow(ctx, seconds=1.0)
        with pytest.raises(TimeoutError):
            pending.result(timeout=0.05)            # the concurrent.futures spelling
        with pytest.raises(TimeoutError):
            pending.exception(timeout_s=0.05)
        assert pending.exception(timeout=30) is None
        assert pending.result(timeout=30).shape == (2,)
        with pytest.raises(TypeError, match="not both"):
            pending.result(timeout_s=1, timeout=2)
