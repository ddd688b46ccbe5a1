"""A tenant cannot freeze the stride scheduler with a cost (issue 46, H1): bob, with his own valid key, skips the
client library's check and registers a function whose simulated time is 1e308, infinite or NaN straight on the
seam; the controller refuses each with the bounds in the message, and alice's calls (and bob's honest ones) still
complete. On the old code the registration was taken, and bob's first call made every pass NaN: nobody was
admitted again."""

from __future__ import annotations

import pytest
import torch

import pathways_torch as pw
from pathways_torch.wire import pb
from pathways_torch.wire.seam import RegisterFunction
from tests.service import client_fixture
from tests.handles import client_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

inc = pw.function(lambda x: x + 1, name="inc")

alice = client_fixture("alice", "shared_service", num_executors=4, backend="eager")
bob = client_fixture("bob", "shared_service", num_executors=4, backend="eager")


@pytest.mark.timeout(120)
def test_bob_cannot_register_a_cost_that_would_freeze_the_islands_and_alices_calls_complete(alice, bob):
    for cost in (1e308, float("inf"), float("nan"), -1.0, 5e-324):
        with pytest.raises(ValueError) as refused:   # the raw request: what pw.function would have refused first
            client_of(bob).request(RegisterFunction("evil", pb.Graph(), [], cost))
        text = str(refused.value)
        assert "function 'evil': sim_time_s: expected a finite number in [1e-06, 1e+06]" in text, text
        assert "or 0 for none" in text
    host = torch.arange(8.0)
    x = alice.put(host, alice.mesh({"data": 4}), [pw.Shard(0)])
    for _ in range(5):
        x = inc(x)
    torch.testing.assert_close(x.result(timeout_s=60), host + 5)
    mine = inc(bob.put(torch.zeros(8), bob.mesh({"data": 4}), [pw.Shard(0)]))
    torch.testing.assert_close(mine.result(timeout_s=60), torch.ones(8))


@pytest.mark.timeout(120)
def test_bob_cannot_register_an_op_that_hurts_every_tenant_or_a_graph_past_the_caps(alice, bob):
    """Issue 46, M4 and M2: from his own key, straight on the seam (the client library would not stop him)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from pathways_torch.wire.graph_schema import encode_graph

    def asserts(x):
        torch.ops.aten._assert_async.msg(x.sum() > 0, "positive")
        return x + 1

    graph, constants = encode_graph(make_fx(asserts, tracing_mode="fake")(torch.ones(4)))
    with pytest.raises(ValueError, match=r"aten._assert_async.msg.*refused to a service client"):
        client_of(bob).request(RegisterFunction("asserts", graph, list(constants), 0.0))
    huge, constants = encode_graph(make_fx(lambda x: x + torch.zeros(1 << 20, 1 << 10), tracing_mode="fake")(
        torch.ones(1)))
    with pytest.raises(ValueError, match="max-graph-bytes"):
        client_of(bob).request(RegisterFunction("huge", huge, list(constants), 0.0))
    host = torch.arange(8.0)
    torch.testing.assert_close(inc(alice.put(host, alice.mesh({"data": 4}), [pw.Shard(0)])).result(timeout_s=60),
                               host + 1)
