"""Paths where a message naming a call or a put used to be dropped, so its future waited forever (issue 15)."""

from __future__ import annotations

import pytest
import torch

import pathways_torch as pw
import pathways_torch.data_client as data_client

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
