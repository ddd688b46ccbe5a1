"""Paths where a message naming a call or a put used to be dropped, so its future waited forever (issue 15)."""

from __future__ import annotations

import pytest
import torch

import pathways_torch as pw
import pathways_torch.data_client as data_client
from tests.handles import server_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_a_put_the_executor_cannot_keep_fails_its_array(monkeypatch):
    real = data_client.tensor_to_frame

    def truncated(tensor, meta, index):
        return real(tensor, meta, index)[:-4]     # the header promises 4 bytes more than the frame holds

    with pw.Context(num_executors=1, backend="eager") as ctx:
        mesh = ctx.mesh({"data": 1})
        monkeypatch.setattr(data_client, "tensor_to_frame", truncated)
        bad = ctx.put(torch.ones(8), mesh, [pw.Replicate()])
        monkeypatch.undo()
        with pytest.raises(pw.RemoteError, match="could not keep the put.*needs 32 bytes, frame has 28"):
            bad.result(timeout_s=30)
        good = ctx.put(torch.ones(8), mesh, [pw.Replicate()])      # the executor goes on serving
        assert torch.equal(good.result(timeout_s=30), torch.ones(8))


def test_a_message_with_no_command_connection_fails_what_needs_the_executor():
    with pw.Context(num_executors=2, backend="eager") as ctx:
        mesh = ctx.mesh({"data": 2})
        x = ctx.put(torch.ones(4), mesh, [pw.Shard(0)])
        double = pw.function(lambda a: a * 2, name="double")
        double(x).result(timeout_s=60)                    # loaded and warm on both
        server = server_of(ctx)
        with server._commands_lock:                       # the connection to executor-1 is gone
            server._commands.pop("executor-1").close(linger=0)
        with pytest.raises(pw.ExecutorLostError, match="executor-1.*no command connection") as caught:
            double(x).result(timeout_s=30)
        assert caught.value.executor_id == "executor-1"
        alone = ctx.mesh({"data": 1}, executors=["executor-0"])     # work that does not need it goes on
        y = ctx.put(torch.ones(2), alone, [pw.Replicate()])
        assert torch.equal(double(y).result(timeout_s=30), torch.full((2,), 2.0))
