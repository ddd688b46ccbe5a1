"""Memory counted where it lands (issue 46, point 4: H2, H3): a `pathways-controller` of its own with a small
``--executor-memory-bytes``, and clients that each hold only their own key.

- H2: a put token binds (array, executor, shard, tag, bytes, client) and is good for one put: bob, holding the token
  of his own 8-byte array, cannot put 8 MiB with it, nor another shard, nor another tag, nor on another executor,
  nor twice; the executors store nothing of it, and count each refusal.
- H3: a client killed after asking for an 8 MiB array but before putting it leaves no record, budget or buffer: within
  the heartbeat bound alice's 8 MiB put fits where it did not while the killed client held the room, and the
  executors' stores are back to what they held before it came.
- The controller's budget is what executors store: bob's call declares 8 bytes for an output that is 8 MiB (his
  CallSpec lies); the executor stores a failure instead, bob reads why, the stores stay where they were, and
  alice's 8 MiB put, which the controller counts as fitting, still fits where it lands.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import signal
import subprocess
import sys
import time

import pytest
import torch

import pathways_torch as pw
from pathways_torch.errors import RemoteError
from pathways_torch.launch.health import get_status
from pathways_torch.wire import pb
from pathways_torch.wire.put_tokens import PUT_TOKEN_BYTES
from pathways_torch.wire.seam import Call
from tests.conftest import REPO_ROOT, wait_until
from tests.service import ControllerProcess, client_fixture
from tests.handles import client_of, data_client_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MIB = 1 << 20
LIMIT = 12 * MIB        # one 8 MiB array per executor fits, two do not
WAIT_S = 1.0            # --memory-wait-s
HEARTBEAT_TIMEOUT_S = 2.0

# A client that asks for an 8 MiB array on executor 0 and is killed before it puts it (its data client sends
# nothing): the controller holds the record and its budget until it notices the client is gone.
_KILLED_MID_PUT = """
import sys, time
import torch
import pathways_torch as pw
from tests.handles import data_client_of

with pw.Context(controller=sys.argv[1], keys=sys.argv[2], backend="eager", heartbeat_interval_s=0.2,
                heartbeat_timeout_s=2.0) as ctx:
    mesh = ctx.mesh({"data": 1}, executors=[0])
    landed = ctx.put(torch.ones(256, 1024), mesh, [pw.Replicate()])      # 1 MiB, stored on executor 0
    landed.result(timeout_s=60)
    data_client_of(ctx).put = lambda executor_id, shards, on_done: None   # from now on, puts never leave
    pending = ctx.put(torch.zeros(2 * 1024 * 1024), mesh, [pw.Replicate()])   # 8 MiB asked for, never sent
    print("READY", flush=True)
    time.sleep(300)
"""


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    process = ControllerProcess(str(tmp_path_factory.mktemp("tenant-memory") / "keys"), clients=("alice", "bob", "carol"),
                                num_executors=2, status_port=True,
                                args=["--executor-memory-bytes", str(LIMIT), "--memory-wait-s", str(WAIT_S),
                                      "--heartbeat-interval-s", "0.2", "--heartbeat-timeout-s",
                                      str(HEARTBEAT_TIMEOUT_S)])
    yield process
    process.stop()


alice = client_fixture("alice", "service", num_executors=2, backend="eager")
bob = client_fixture("bob", "service", num_executors=2, backend="eager")


def _store_bytes(service) -> int:
    return sum(e.store_bytes for e in get_status(service.status).executors)


def _store_bytes_now(ctx) -> int:
    """What the executors hold this moment, asked by a client (the status answers from a cache up to 1 s old)."""
    return sum(e["store_bytes"] for e in ctx.stats()["executors"].values())


def _clients(service) -> set:
    return {c.name for c in get_status(service.status, with_stats=False).clients}


def _stored(ctx) -> dict[str, int]:
    """Each executor's store bytes now, asked of the executors themselves (status answers from a cache)."""
    return {e: stats["store_bytes"] for e, stats in ctx.stats()["executors"].items()}


def _put(ctx, executor_id: str, ref: pb.ShardRef, tensor, tokens: bytes) -> BaseException | None:
    """A put straight to ``executor_id`` with ``tokens`` (the data client sends the one at ``ref.shard``); the error it
    ended with (None: it was kept)."""
    landed: concurrent.futures.Future = concurrent.futures.Future()
    data_client_of(ctx).put(executor_id, [(ref, tensor, tokens)], landed.set_result)
    return landed.result(timeout=30)


def test_a_put_token_puts_one_shard_of_the_bytes_counted_and_nothing_else(service, bob):
    mesh = bob.mesh({"data": 2})
    x = bob.put(torch.arange(4.0), mesh, [pw.Shard(0)])                 # 8 bytes on each executor
    torch.testing.assert_close(x.result(timeout_s=60), torch.arange(4.0))
    tokens = x._state.put_token
    first, second = tokens[:PUT_TOKEN_BYTES], tokens[PUT_TOKEN_BYTES:2 * PUT_TOKEN_BYTES]
    e0 = mesh.executor_ids[0]
    baseline = _store_bytes_now(bob)
    refused_before = bob.stats()["executors"][e0]["refused_data_messages"]
    shard = pb.ShardRef(array_id=x.array_id, shard=0)
    attempts = {   # what the executor says, for each put that does not match the token's
        "byte count 8, not 8388608": (shard, torch.zeros(2 * MIB), first),
        "for shard 0, not 1": (pb.ShardRef(array_id=x.array_id, shard=1), torch.zeros(2), first + first),
        "for tag 0, not 7": (pb.ShardRef(array_id=x.array_id, shard=0, tag=7), torch.zeros(2), first),
        "for another executor": (shard, torch.zeros(2), second),
        "used already": (shard, torch.full((2,), 666.0), first),
    }
    for expected, (ref, tensor, token) in attempts.items():
        error = _put(bob, e0, ref, tensor, token)
        assert isinstance(error, RemoteError) and expected in str(error), (expected, repr(error))
    assert bob.stats()["executors"][e0]["refused_data_messages"] == refused_before + len(attempts)
    assert _store_bytes_now(bob) == baseline                             # none of it stored
    torch.testing.assert_close(x.result(timeout_s=30), torch.arange(4.0))


def test_a_client_killed_mid_put_leaves_no_record_budget_or_buffer_within_the_heartbeat_bound(service, alice):
    mesh = alice.mesh({"data": 1}, [0])
    alice.put(torch.ones(4), mesh, [pw.Replicate()]).result(timeout_s=60)   # alice's data socket is open
    time.sleep(1.1)   # the status answers from a cache at most 1 s old
    baseline = _store_bytes(service)
    child = subprocess.Popen([sys.executable, "-c", _KILLED_MID_PUT, service.address, service.keys("carol")],
                             cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert child.stdout.readline().strip() == "READY"
        assert wait_until(lambda: _store_bytes(service) >= baseline + MIB, 5)
        with pytest.raises(pw.OutOfMemoryError):          # carol's 8 MiB are counted while she is there
            alice.put(torch.zeros(2 * MIB), mesh, [pw.Replicate()])
        child.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        assert wait_until(lambda: "carol" not in _clients(service), 10)
        assert wait_until(lambda: _store_bytes(service) <= baseline, 10)   # her landed MiB is freed too
        big = alice.put(torch.full((2 * MIB,), 3.0), mesh, [pw.Replicate()])   # her pending 8 MiB are given back
        assert big.result(timeout_s=30)[-1].item() == 3.0
        assert time.monotonic() - killed < 2 * HEARTBEAT_TIMEOUT_S + WAIT_S + 2
    finally:
        child.kill()
        child.wait()


grow = pw.function(lambda x: x.new_zeros(2 * MIB) + x.sum(), name="grow")   # 8 MiB of float32 from any input


def test_an_output_larger_than_its_call_declared_is_not_stored(service, alice, bob, monkeypatch):
    mesh = bob.mesh({"data": 1}, [0])
    e0 = mesh.executor_ids[0]
    gc.collect()
    alice.stats()                             # her frees of earlier tests' arrays ride on it: the stores settle
    assert wait_until(lambda: _stored(bob)[e0] < MIB, 10)
    x = bob.put(torch.arange(2.0), mesh, [pw.Replicate()])
    assert x.wait(60)
    client = client_of(bob)            # bob's remote client: what goes on the wire from his key
    honest = client.request

    def lying(op):                            # what a hostile client sends: 8 bytes declared per output shard
        if isinstance(op, Call):
            op = dataclasses.replace(op, spec=dataclasses.replace(op.spec, output_shard_bytes=(8,)))
        return honest(op)

    monkeypatch.setattr(client, "request", lying)
    baseline = _stored(bob)
    refused_before = bob.stats()["executors"][e0]["outputs_over_budget"]
    y = grow(x)
    with pytest.raises(RemoteError) as caught:
        y.result(timeout_s=60)
    monkeypatch.undo()
    text = str(caught.value)
    assert caught.value.remote_type == "OutputOverBudget", text
    for part in ("output 0 of call", "'grow'", f"is {8 * MIB} bytes", "declared 8 bytes per shard",
                 "--executor-memory-bytes", "Fix:"):
        assert part in text, (part, text)
    assert _stored(bob) == baseline                                       # none of its 8 MiB stored
    assert bob.stats()["executors"][e0]["outputs_over_budget"] == refused_before + 1
    # Alice's 8 MiB put fits by the controller's count, and where it lands too: no executor holds past the limit.
    big = alice.put(torch.full((2 * MIB,), 3.0), alice.mesh({"data": 1}, [0]), [pw.Replicate()])
    assert big.result(timeout_s=30)[-1].item() == 3.0
    assert max(_stored(alice).values()) <= LIMIT
    del big, x, y
    gc.collect()
