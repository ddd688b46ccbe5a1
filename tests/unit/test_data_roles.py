"""Who may send what on an executor's data socket (executor/data_roles.py), and whose reply the client takes."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from executor.data_roles import DataGate, executor_of_role
from pathways_torch.wire import encode, pb
from pathways_torch.wire.tensors import tensor_to_frame
from tests.unit.test_executor_core import CLIENT, make_core, put, ref

pytestmark = pytest.mark.timeout(60)


def _transfer(core, array_id, tag, *, role, epoch=0, value=1.0, key=None):
    msg = pb.Transfer()
    msg.shard.CopyFrom(ref(array_id, tag=tag))
    frame = tensor_to_frame(torch.full((2,), value), msg.tensor, 1)
    core.on_data(b"peer", pb.Envelope(transfer=msg, epoch=epoch), [bytes(memoryview(frame))], role=role, key=key)


def test_puts_fetches_and_saves_from_an_executors_key_are_refused_counted_and_unanswered(tmp_path):
    core, outbox = make_core()
    put(core, ref(5), torch.ones(3))
    outbox.clients.clear()
    # An executor's key (and a spare of one, and the controller's) asks what only the client may.
    for role in ("e1", "e1.r1", "controller", None):
        msg = pb.Put(request_id=7)
        msg.shard.CopyFrom(ref(6))
        frame = tensor_to_frame(torch.zeros(3), msg.tensor, 1)
        core.on_data(b"x", pb.Envelope(put=msg), [bytes(memoryview(frame))], role=role)
        core.on_data(b"x", pb.Envelope(fetch=pb.Fetch(request_id=8, shard=ref(5))), [], role=role)
        save = pb.SaveShards(request_id=9, names=["w"], path=str(tmp_path / "w.safetensors"))
        save.shards.add().CopyFrom(ref(5))
        core.on_data(b"x", pb.Envelope(save_shards=save), [], role=role)
    assert core.dropped_messages == core.counters["refused_data_messages"] == 12
    assert (6, 0, 0) not in core.store and outbox.clients == [] and not list(tmp_path.iterdir())
    assert core.store.get((5, 0, 0)).pins == 0          # the refused fetch pinned nothing
    # The client's key may.
    core.on_data(CLIENT, pb.Envelope(fetch=pb.Fetch(request_id=8, shard=ref(5))), [], role="client")
    assert [e.fetch_reply.request_id for _, e, _ in outbox.clients] == [8]


def test_a_transfer_from_the_clients_key_or_without_a_role_is_refused():
    core, outbox = make_core()
    core.store.claim((5, 0, 9))                         # a run here waits for the copy
    for role in ("client", "controller", None):
        _transfer(core, 5, 9, role=role, value=666.0)
    assert core.dropped_messages == core.counters["refused_data_messages"] == 3
    assert not core.store.get((5, 0, 9)).ready and outbox.clients == []   # not filled, not acknowledged
    _transfer(core, 5, 9, role="e1", epoch=1)
    assert core.store.get((5, 0, 9)).value.tolist() == [1.0, 1.0]
    assert [e.WhichOneof("body") for _, e, _ in outbox.clients] == ["transfer_ack"]


def test_a_replaced_incarnations_transfer_is_refused():
    core, outbox = make_core()
    for key in ((5, 0, 9), (6, 0, 9), (7, 0, 9), (8, 0, 9)):
        core.store.claim(key)
    # The controller says e1@1 was lost (a Cancel; a heartbeat answer's lost peers does the same): its transfers
    # still on their way, on a connection it still holds, are refused. Epoch 0 (none said) is older still.
    core.on_control(pb.Envelope(cancel=pb.Cancel(lost_executor="e1@1", reason="killed")), [])
    _transfer(core, 5, 9, role="e1", epoch=1, value=666.0)
    _transfer(core, 5, 9, role="e1", epoch=0, value=666.0)
    assert not core.store.get((5, 0, 9)).ready and core.counters["refused_data_messages"] == 2
    _transfer(core, 5, 9, role="e1", epoch=2)               # its replacement's is taken
    assert core.store.get((5, 0, 9)).value.tolist() == [1.0, 1.0]
    # A revoked key (the old incarnation's, on a connection made before its replacement's key was admitted) is
    # refused whatever epoch it claims; a false high epoch shuts nobody out: only the controller raises the floor.
    admitted = {b"new-key-of-e2"}
    core.data_gate = DataGate(admitted.__contains__)
    _transfer(core, 7, 9, role="e2", epoch=2**32 - 1, key=b"old-key-of-e2", value=666.0)
    assert not core.store.get((7, 0, 9)).ready and core.counters["refused_data_messages"] == 3
    _transfer(core, 6, 9, role="e2", epoch=2, key=b"new-key-of-e2")
    assert core.store.get((6, 0, 9)).ready
    _transfer(core, 8, 9, role="e3", epoch=1)               # another executor's are not affected
    assert core.store.get((8, 0, 9)).ready


def test_the_gate_reads_roles_and_lost_incarnations():
    assert [executor_of_role(r) for r in ("executor-1", "executor-1.r2", "client", "controller", None, "")] == \
        ["executor-1", "executor-1", None, None, None, None]
    gate = DataGate()
    for entry in ("transfer:7.0:e0->e1", "e1@x", "@3", "e1"):   # a lost link, and garbage: no incarnation named
        gate.retire(entry)
    assert gate.floor("e1") == 0
    gate.retire("executor-1@2")
    gate.retire("executor-1@1")                                 # an older notice does not lower it
    assert gate.floor("executor-1") == 3
    transfer = pb.Envelope(transfer=pb.Transfer(), epoch=2)
    assert "expected incarnation 3 or later" in gate.refusal("executor-1.r1", transfer)
    assert gate.refusal("executor-1", pb.Envelope(run=pb.Run())) is None   # not a data kind: handled elsewhere


def test_the_client_takes_a_reply_only_from_the_executor_it_asked():
    import zmq

    from pathways_torch.data_client import DataClient, _Request

    context = zmq.Context()
    client = DataClient(context, credentials=None)
    try:
        future: concurrent.futures.Future = concurrent.futures.Future()
        request_id = client._register(_Request("executor-0", future=future))
        reply = pb.FetchReply(request_id=request_id)
        frame = tensor_to_frame(torch.full((2,), 666.0), reply.tensor, 1)
        # Another executor guesses the (sequential) request id and answers first: not taken.
        client._on_frames("executor-1", encode(pb.Envelope(fetch_reply=reply), [frame]))
        assert not future.done() and client.dropped_replies == 1
        reply = pb.FetchReply(request_id=request_id)
        frame = tensor_to_frame(torch.ones(2), reply.tensor, 1)
        client._on_frames("executor-0", encode(pb.Envelope(fetch_reply=reply), [frame]))
        assert future.result(timeout=5).tolist() == [1.0, 1.0]
    finally:
        client.close()
        context.destroy(linger=0)


def test_the_client_opens_an_executors_data_socket_at_its_first_request_not_when_it_registers():
    """1,024 executors registering must not be 1,024 data-socket handshakes during start-up (a run needs none)."""
    import zmq

    from pathways_torch.data_client import DataClient
    from pathways_torch.errors import ProtocolError
    from pathways_torch.wire.security import Credentials, KeyPair

    public, secret = zmq.curve_keypair()
    credentials = Credentials(role="client", keys=KeyPair(public=public, secret=secret), allowed={})
    context = zmq.Context()
    client = DataClient(context, credentials)
    try:
        client.connect("executor-0", "tcp://127.0.0.1:9", zmq.curve_keypair()[0])
        opened = concurrent.futures.Future()
        client.loop.call_soon(lambda: opened.set_result(client.loop.socket("executor-0") is not None))
        assert opened.result(timeout=5) is False
        pending = client.fetch("executor-0", pb.ShardRef(array_id=1))   # nobody listens: stays pending
        opened = concurrent.futures.Future()
        client.loop.call_soon(lambda: opened.set_result(client.loop.socket("executor-0") is not None))
        assert opened.result(timeout=5) is True and not pending.done()
        with pytest.raises(ProtocolError, match="executor-9"):
            client.fetch("executor-9", pb.ShardRef(array_id=1)).result(timeout=5)
    finally:
        client.close()
        context.destroy(linger=0)
