"""ExecutorCore driven in-process: a recording outbox and a synchronous compute."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from executor.backends.torch_based import EagerBackend
from executor.core import ExecutorCore
from pathways_torch.wire import pb
from pathways_torch.wire.graph_schema import encode_graph
from pathways_torch.wire.tensors import frame_to_tensor, tensor_to_frame

pytestmark = pytest.mark.timeout(60)

CLIENT = b"client"


class FakeOutbox:
    def __init__(self):
        self.controller = []   # (envelope, payload)
        self.peers = []        # (address, envelope, payload)
        self.clients = []      # (identity, envelope, payload)

    def to_controller(self, envelope, payload=()):
        self.controller.append((envelope, list(payload)))

    def to_peer(self, address, envelope, payload=(), public_key=b"", direct=False, tag=None):
        self.peers.append((address, envelope, list(payload)))

    def to_client(self, identity, envelope, payload=()):
        self.clients.append((identity, envelope, list(payload)))

    def dones(self):
        return [e.done for e, _ in self.controller if e.WhichOneof("body") == "done"]

    def fetch_replies(self):
        return [(e.fetch_reply, p) for _, e, p in self.clients if e.WhichOneof("body") == "fetch_reply"]


def make_core():
    outbox = FakeOutbox()
    holder = {}

    def submit(job):
        core = holder["core"]
        core.finish(core.compute(job))

    core = ExecutorCore(executor_id="e0", backend=EagerBackend(), outbox=outbox, submit=submit)
    holder["core"] = core
    return core, outbox


def ref(array_id, shard=0, tag=0):
    return pb.ShardRef(array_id=array_id, shard=shard, tag=tag)


def load(core, function_id, fn, *example_inputs, name="f"):
    gm = make_fx(fn, tracing_mode="fake")(*example_inputs)
    graph, constants = encode_graph(gm)
    frames = [bytes(memoryview(c)) for c in constants]
    core.on_control(pb.Envelope(load_function=pb.LoadFunction(function_id=function_id, name=name, graph=graph)),
                    frames)


def put(core, shard_ref, tensor, request_id=1):
    msg = pb.Put(request_id=request_id)
    msg.shard.CopyFrom(shard_ref)
    frame = tensor_to_frame(tensor, msg.tensor, 1)
    core.on_data(CLIENT, pb.Envelope(put=msg), [bytes(memoryview(frame))], role="client")


def run(core, *, seq, call_id, function_id, inputs, outputs):
    msg = pb.Run(seq=seq, call_id=call_id, function_id=function_id, inputs=inputs, outputs=outputs)
    core.on_control(pb.Envelope(run=msg), [])


def fetch(core, outbox, shard_ref, request_id=100):
    before = len(outbox.fetch_replies())
    msg = pb.Fetch(request_id=request_id)
    msg.shard.CopyFrom(shard_ref)
    core.on_data(CLIENT, pb.Envelope(fetch=msg), [], role="client")
    replies = outbox.fetch_replies()
    assert len(replies) == before + 1, "no fetch reply"
    reply, payload = replies[-1]
    assert reply.request_id == request_id
    return reply, payload


def fetch_tensor(core, outbox, shard_ref, request_id=100):
    reply, payload = fetch(core, outbox, shard_ref, request_id)
    assert not reply.failed, reply.failure.message
    return frame_to_tensor(reply.tensor, [bytes(memoryview(p)) for p in payload])


def free(core, *refs):
    core.on_control(pb.Envelope(free=pb.Free(shards=list(refs))), [])


X = torch.arange(6, dtype=torch.float32).reshape(2, 3)
W = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 10


def matmul_relu(x, w):
    return torch.relu(x @ w - 1.0)


# ---------------------------------------------------------------- the happy path

def test_load_put_run_fetch():
    core, outbox = make_core()
    load(core, 1, matmul_relu, X, W)
    assert core.num_function_loads == 1 and 1 in core.functions
    put(core, ref(10), X, request_id=5)
    put(core, ref(11), W, request_id=6)
    acks = [e.put_ack for _, e, _ in outbox.clients if e.WhichOneof("body") == "put_ack"]
    assert [a.request_id for a in acks] == [5, 6]
    assert acks[0].shard.array_id == 10
    run(core, seq=1, call_id=42, function_id=1, inputs=[ref(10), ref(11)], outputs=[ref(12)])
    dones = outbox.dones()
    assert len(dones) == 1
    assert dones[0].ok and dones[0].call_id == 42 and dones[0].seq == 1
    assert core.num_computations == 1
    result = fetch_tensor(core, outbox, ref(12))
    assert torch.equal(result, matmul_relu(X, W))


def test_multiple_outputs():
    core, outbox = make_core()
    load(core, 1, lambda x: (x + 1, x.sum(dim=0)), X)
    put(core, ref(1), X)
    run(core, seq=1, call_id=1, function_id=1, inputs=[ref(1)], outputs=[ref(2), ref(3)])
    assert outbox.dones()[0].ok
    assert torch.equal(fetch_tensor(core, outbox, ref(2)), X + 1)
    assert torch.equal(fetch_tensor(core, outbox, ref(3), request_id=101), X.sum(dim=0))


def test_digest_outputs_reported():
    core, outbox = make_core()
    load(core, 1, lambda x: x * 2, X)
    put(core, ref(1), X)
    core.on_control(pb.Envelope(run=pb.Run(seq=1, call_id=1, function_id=1, inputs=[ref(1)],
                                           outputs=[ref(2)], digest_outputs=True)), [])
    done = outbox.dones()[0]
    assert done.ok and len(done.digests) == 1 and len(done.digests[0]) > 16


def test_run_before_put_waits_while_ready_runs_pass_it():
    core, outbox = make_core()
    load(core, 1, lambda x: x + 1, X)
    # seq 1 needs array 1 (not yet here); seq 2's input array 3 is here already, so it may pass seq 1
    # (no computation today waits on another executor once started, so passing cannot deadlock).
    put(core, ref(3), X * 10)
    run(core, seq=1, call_id=11, function_id=1, inputs=[ref(1)], outputs=[ref(2)])
    run(core, seq=2, call_id=12, function_id=1, inputs=[ref(3)], outputs=[ref(4)])
    # seq 3 consumes the output of seq 1.
    run(core, seq=3, call_id=13, function_id=1, inputs=[ref(2)], outputs=[ref(5)])
    assert [d.seq for d in outbox.dones()] == [2]
    assert core.num_computations == 1
    put(core, ref(1), X)
    dones = outbox.dones()
    # With a synchronous submit a run's outputs wake the next runs before its own Done is sent, so
    # Done order is not seq order; the controller matches Done by call_id.
    assert sorted(d.seq for d in dones) == [1, 2, 3]
    assert all(d.ok for d in dones)
    reply = pb.TraceReply()
    core.trace.fill(reply)
    assert [ev.seq for ev in reply.events if ev.kind == "start"] == [2, 1, 3]
    assert core.num_computations == 3
    assert torch.equal(fetch_tensor(core, outbox, ref(4)), X * 10 + 1)
    assert torch.equal(fetch_tensor(core, outbox, ref(5), request_id=2), X + 2)


def test_a_ready_run_on_an_idle_executor_starts_at_once_and_one_behind_a_queued_run_takes_the_queue():
    core, outbox = make_core()
    paths, submit = [], core._submit
    core._submit = lambda job: (paths.append(f"seq {job.seq} " + ("at once" if job.segment is None else "queued")),
                                submit(job))
    load(core, 1, lambda x: x + 1, X)
    put(core, ref(1), X)
    run(core, seq=1, call_id=1, function_id=1, inputs=[ref(1)], outputs=[ref(2)])
    run(core, seq=2, call_id=2, function_id=1, inputs=[ref(9)], outputs=[ref(3)])   # waits for array 9
    run(core, seq=3, call_id=3, function_id=1, inputs=[ref(2)], outputs=[ref(4)])   # ready, but seq 2 is queued
    put(core, ref(9), X * 10)
    assert paths == ["seq 1 at once", "seq 3 queued", "seq 2 queued"]
    assert sorted(d.call_id for d in outbox.dones() if d.ok) == [1, 2, 3]
    assert torch.equal(fetch_tensor(core, outbox, ref(4)), X + 2)
    assert torch.equal(fetch_tensor(core, outbox, ref(3), request_id=2), X * 10 + 1)
    assert core.store.get((1, 0, 0)).pins == 0   # the run started at once let its input go


def test_fetch_before_ready_waits():
    core, outbox = make_core()
    load(core, 1, lambda x: x - 1, X)
    run(core, seq=1, call_id=1, function_id=1, inputs=[ref(1)], outputs=[ref(2)])
    msg = pb.Fetch(request_id=7)
    msg.shard.CopyFrom(ref(2))
    core.on_data(CLIENT, pb.Envelope(fetch=msg), [], role="client")
    assert outbox.fetch_replies() == []
    put(core, ref(1), X)
    (reply, payload), = outbox.fetch_replies()
    assert reply.request_id == 7 and not reply.failed
    assert torch.equal(frame_to_tensor(reply.tensor, [bytes(memoryview(p)) for p in payload]), X - 1)


def test_fetch_unknown_shard_fails():
    core, outbox = make_core()
    reply, payload = fetch(core, outbox, ref(99, shard=2))
    assert reply.failed and payload == []
    assert reply.failure.type == "KeyError"
    assert "array 99" in reply.failure.message and "shard 2" in reply.failure.message


# ---------------------------------------------------------------- failures

def test_exception_in_function_reports_traceback_and_propagates_origin():
    core, outbox = make_core()
    load(core, 1, lambda x, index: x[index], X, torch.tensor([0, 1]))
    load(core, 2, lambda y: y * 2, torch.zeros(2, 3))
    put(core, ref(1), X)
    put(core, ref(2), torch.tensor([0, 5]))  # fits the signature; row 5 does not exist: a data-dependent error
    run(core, seq=1, call_id=21, function_id=1, inputs=[ref(1), ref(2)], outputs=[ref(3)])
    run(core, seq=2, call_id=22, function_id=2, inputs=[ref(3)], outputs=[ref(4)])
    first, second = outbox.dones()
    assert first.call_id == 21 and not first.ok
    assert first.failure.origin_call_id == 21
    assert first.failure.type == "IndexError"
    assert first.failure.executor_id == "e0"
    assert "Traceback" in first.failure.traceback and "out of bounds" in first.failure.traceback
    assert first.failure.message
    assert second.call_id == 22 and not second.ok
    assert second.failure.origin_call_id == 21
    assert second.failure.message == first.failure.message
    assert core.num_computations == 0
    # A fetch of the failed output replies with the failure.
    reply, payload = fetch(core, outbox, ref(4))
    assert reply.failed and reply.failure.origin_call_id == 21 and payload == []


def test_wrong_output_count_fails_the_call():
    core, outbox = make_core()
    load(core, 1, lambda x: x + 1, X)
    put(core, ref(1), X)
    run(core, seq=1, call_id=5, function_id=1, inputs=[ref(1)], outputs=[ref(2), ref(3)])
    done, = outbox.dones()
    assert not done.ok and "1 outputs" in done.failure.message and done.failure.origin_call_id == 5


def test_input_that_does_not_fit_the_signature_is_refused_before_running():
    core, outbox = make_core()
    load(core, 1, lambda x, w: x @ w, X, W)
    put(core, ref(1), X)
    put(core, ref(2), torch.zeros(5, 4))
    run(core, seq=1, call_id=31, function_id=1, inputs=[ref(1), ref(2)], outputs=[ref(3)])
    done, = outbox.dones()
    assert not done.ok and done.failure.type == "SignatureError"
    assert "input 1: expected float32[3, 4], got float32[5, 4]" in done.failure.message
    assert core.num_computations == 0


def test_run_of_unloaded_function_fails():
    core, outbox = make_core()
    put(core, ref(1), X)
    run(core, seq=1, call_id=8, function_id=123, inputs=[ref(1)], outputs=[ref(2)])
    done, = outbox.dones()
    assert not done.ok
    assert done.failure.type == "ProtocolError" and "123" in done.failure.message
    assert done.failure.origin_call_id == 8


def test_refused_function_load_fails_its_runs():
    core, outbox = make_core()
    graph = pb.Graph()
    graph.nodes.add(op="placeholder", name="x")
    graph.nodes.add(op="call_function", target="os.system.default", name="evil").args.add(node=0)
    graph.nodes.add(op="output", name="output").args.add(node=1)
    core.on_control(pb.Envelope(load_function=pb.LoadFunction(function_id=3, name="evil", graph=graph)), [])
    assert core.functions[3].failure is not None and core.functions[3].compiled is None
    put(core, ref(1), X)
    run(core, seq=1, call_id=9, function_id=3, inputs=[ref(1)], outputs=[ref(2)])
    done, = outbox.dones()
    assert not done.ok
    assert done.failure.type == "GraphSchemaError" and "os" in done.failure.message
    assert done.failure.origin_call_id == 9


# ---------------------------------------------------------------- transfers

def test_send_shard_pushes_transfer_once_ready():
    core, outbox = make_core()
    load(core, 1, lambda x: x * 3, X)
    send = pb.SendShard(to_address="tcp://peer:1", call_id=30)
    send.shard.CopyFrom(ref(2))
    send.as_ref.CopyFrom(ref(2, tag=30))
    run(core, seq=1, call_id=29, function_id=1, inputs=[ref(1)], outputs=[ref(2)])
    core.on_control(pb.Envelope(send_shard=send), [])
    assert outbox.peers == []
    put(core, ref(1), X)
    (address, envelope, payload), = outbox.peers
    assert address == "tcp://peer:1"
    transfer = envelope.transfer
    assert not transfer.failed
    assert (transfer.shard.array_id, transfer.shard.tag) == (2, 30)
    sent = frame_to_tensor(transfer.tensor, [bytes(memoryview(p)) for p in payload])
    assert torch.equal(sent, X * 3)
    assert core.hop_bytes["executor->executor"] == X.numel() * 4


def test_send_shard_of_failed_shard_pushes_failure():
    core, outbox = make_core()
    load(core, 1, lambda x, w: x @ w, X, W)
    put(core, ref(1), X)
    put(core, ref(2), torch.zeros(7, 4))
    run(core, seq=1, call_id=50, function_id=1, inputs=[ref(1), ref(2)], outputs=[ref(3)])
    send = pb.SendShard(to_address="tcp://peer:2", call_id=51)
    send.shard.CopyFrom(ref(3))
    send.as_ref.CopyFrom(ref(3, tag=51))
    core.on_control(pb.Envelope(send_shard=send), [])
    (_, envelope, payload), = outbox.peers
    assert envelope.transfer.failed and payload == []
    assert envelope.transfer.failure.origin_call_id == 50


def test_received_transfer_feeds_a_run():
    core, outbox = make_core()
    load(core, 1, lambda x: x.sum(), X)
    run(core, seq=1, call_id=60, function_id=1, inputs=[ref(1)], outputs=[ref(2)])
    transfer = pb.Transfer()
    transfer.shard.CopyFrom(ref(1))
    frame = tensor_to_frame(X, transfer.tensor, 1)
    core.on_data(b"peer", pb.Envelope(transfer=transfer), [bytes(memoryview(frame))], role="e1")
    assert outbox.dones()[0].ok
    assert fetch_tensor(core, outbox, ref(2)).item() == X.sum().item()


# ---------------------------------------------------------------- memory

def test_free_returns_store_bytes_to_zero():
    core, outbox = make_core()
    load(core, 1, matmul_relu, X, W)
    put(core, ref(1), X)
    put(core, ref(2), W)
    assert core.store.bytes == (6 + 12) * 4
    run(core, seq=1, call_id=1, function_id=1, inputs=[ref(1), ref(2)], outputs=[ref(3)])
    assert core.store.bytes == (6 + 12 + 8) * 4
    fetch_tensor(core, outbox, ref(3))
    free(core, ref(1), ref(2), ref(3))
    assert core.store.bytes == 0
    assert len(core.store) == 0


def test_frees_riding_on_a_run_are_applied_and_the_run_still_runs():
    core, outbox = make_core()
    load(core, 1, matmul_relu, X, W)
    put(core, ref(1), X)
    put(core, ref(2), W)
    put(core, ref(9), W)                       # dropped by the client before this Run was sent
    envelope = pb.Envelope(run=pb.Run(seq=1, call_id=1, function_id=1, inputs=[ref(1), ref(2)], outputs=[ref(3)]))
    envelope.frees.extend([ref(9)])
    core.on_control(envelope, [])
    assert ref(9).array_id not in {key[0] for key in core.store._entries}
    torch.testing.assert_close(fetch_tensor(core, outbox, ref(3)), matmul_relu(X, W))


def test_free_of_pending_send_waits_for_push():
    core, outbox = make_core()
    load(core, 1, lambda x: x + 1, X)
    run(core, seq=1, call_id=1, function_id=1, inputs=[ref(1)], outputs=[ref(2)])
    send = pb.SendShard(to_address="tcp://peer:3", call_id=2)
    send.shard.CopyFrom(ref(2))
    send.as_ref.CopyFrom(ref(2, tag=2))
    core.on_control(pb.Envelope(send_shard=send), [])
    free(core, ref(2))
    put(core, ref(1), X)
    assert len(outbox.peers) == 1
    free(core, ref(1))
    assert core.store.bytes == 0 and len(core.store) == 0


def test_stats_request_reports_store():
    core, outbox = make_core()
    put(core, ref(1), X)
    core.on_control(pb.Envelope(stats_request=pb.StatsRequest(request_id=4)), [])
    stats = outbox.controller[-1][0].stats
    assert stats.request_id == 4 and stats.executor_id == "e0"
    assert stats.store_bytes == 24 and stats.store_buffers == 1
    assert stats.hop_bytes["client->executor"] == 24


def test_transient_input_put_after_run_is_deleted_after_the_run():
    core, outbox = make_core()
    load(core, 1, lambda x: x * 2, X)
    transient = ref(1, tag=70)
    run(core, seq=1, call_id=70, function_id=1, inputs=[transient], outputs=[ref(2)])
    put(core, transient, X)
    assert outbox.dones()[0].ok
    assert (1, 0, 70) not in core.store
    assert core.store.bytes == X.numel() * 4  # only the output remains
    free(core, ref(2))
    assert core.store.bytes == 0 and len(core.store) == 0


def test_transient_input_put_before_run_is_deleted_after_the_run():
    core, outbox = make_core()
    load(core, 1, lambda x: x * 2, X)
    transient = ref(1, tag=71)
    put(core, transient, X)
    run(core, seq=1, call_id=71, function_id=1, inputs=[transient], outputs=[ref(2)])
    assert outbox.dones()[0].ok
    assert (1, 0, 71) not in core.store
    free(core, ref(2))
    assert core.store.bytes == 0 and len(core.store) == 0


def test_transient_input_that_arrives_failed_is_deleted():
    core, outbox = make_core()
    load(core, 1, lambda x: x * 2, X)
    transient = ref(1, tag=72)
    run(core, seq=1, call_id=72, function_id=1, inputs=[transient], outputs=[ref(2)])
    transfer = pb.Transfer(failed=True)
    transfer.shard.CopyFrom(transient)
    transfer.failure.CopyFrom(pb.RemoteFailure(type="ValueError", message="upstream", origin_call_id=60))
    core.on_data(b"peer", pb.Envelope(transfer=transfer), [], role="e1")
    done, = outbox.dones()
    assert not done.ok and done.failure.origin_call_id == 60
    assert (1, 0, 72) not in core.store


def test_transient_second_input_of_failed_run_leaves_no_placeholder():
    core, outbox = make_core()
    put(core, ref(1), X)
    put(core, ref(2, tag=9), X)
    # Function 77 was never loaded: the call fails at once, on the I/O thread, as it would in a real executor.
    run(core, seq=1, call_id=9, function_id=77, inputs=[ref(1), ref(2, tag=9)], outputs=[ref(3)])
    done, = outbox.dones()
    assert not done.ok and done.failure.origin_call_id == 9
    assert (2, 0, 9) not in core.store
    free(core, ref(1), ref(3))
    assert len(core.store) == 0


def test_transient_last_input_of_failed_run_is_deleted():
    core, outbox = make_core()
    put(core, ref(1), X)
    put(core, ref(2, tag=9), X)
    run(core, seq=1, call_id=9, function_id=77, inputs=[ref(2, tag=9), ref(1)], outputs=[ref(3)])
    assert not outbox.dones()[0].ok
    assert (2, 0, 9) not in core.store
    free(core, ref(1), ref(3))
    assert len(core.store) == 0 and core.store.bytes == 0


# ---------------------------------------------------------------- robustness

def test_unknown_message_kinds_are_dropped_and_core_keeps_working():
    core, outbox = make_core()
    assert core.dropped_messages == 0
    core.on_control(pb.Envelope(), [])                                   # no body
    core.on_control(pb.Envelope(register=pb.Register(executor_id="x")), [])  # not for executors
    core.on_control(pb.Envelope(put=pb.Put()), [])                       # data kind on the control socket
    core.on_data(CLIENT, pb.Envelope(run=pb.Run(call_id=1)), [], role="client")         # control kind on the data socket
    core.on_data(CLIENT, pb.Envelope(done=pb.Done()), [], role="client")
    assert core.dropped_messages == 5
    assert outbox.controller == [] and outbox.peers == []
    # Still works.
    load(core, 1, lambda x: x + 1, X)
    put(core, ref(1), X)
    run(core, seq=1, call_id=1, function_id=1, inputs=[ref(1)], outputs=[ref(2)])
    assert outbox.dones()[0].ok
    assert torch.equal(fetch_tensor(core, outbox, ref(2)), X + 1)
    assert core.dropped_messages == 5


def test_shutdown_and_trace_request():
    core, outbox = make_core()
    core.on_control(pb.Envelope(welcome=pb.Welcome(index=0)), [])
    core.on_control(pb.Envelope(heartbeat=pb.Heartbeat(sent_at=1.0)), [])
    core.on_control(pb.Envelope(trace_request=pb.TraceRequest(request_id=3)), [])
    reply = outbox.controller[-1][0].trace_reply
    assert reply.request_id == 3 and reply.executor_id == "e0"
    assert any(ev.kind == "receive" and ev.name == "welcome" for ev in reply.events)
    assert not core.stopped
    core.on_control(pb.Envelope(shutdown=pb.Shutdown(reason="test")), [])
    assert core.stopped
    assert core.dropped_messages == 0


def test_a_run_whose_handling_raises_fails_its_call_and_its_outputs(monkeypatch):
    """A bug in handling a Run must end the call (a failing Done with the traceback), not drop the message."""
    core, outbox = make_core()
    load(core, 1, lambda a: a + 1, torch.zeros(2))
    put(core, ref(10), torch.zeros(2))

    def broken(msg):
        raise ValueError("a bug while queueing")

    monkeypatch.setattr(core, "_start_now", broken)
    run(core, seq=1, call_id=5, function_id=1, inputs=[ref(10)], outputs=[ref(11)])
    done = outbox.dones()[-1]
    assert done.call_id == 5 and not done.ok
    assert done.failure.type == "ValueError" and "a bug while queueing" in done.failure.traceback
    assert core.store.get((11, 0, 0)).failure is not None      # a reader of the output fails too
    monkeypatch.undo()
    run(core, seq=2, call_id=6, function_id=1, inputs=[ref(11)], outputs=[ref(12)])
    assert outbox.dones()[-1].call_id == 6 and not outbox.dones()[-1].ok


def test_a_put_whose_frame_does_not_match_its_header_is_answered_with_a_failure():
    """The client's put must end: a failing PutAck naming the mismatch, not a dropped message."""
    core, outbox = make_core()
    msg = pb.Put(request_id=7)
    msg.shard.CopyFrom(ref(20))
    tensor_to_frame(torch.zeros(4), msg.tensor, 1)
    core.on_data(CLIENT, pb.Envelope(put=msg), [bytes(12)], role="client")        # 12 bytes where the header says 16
    acks = [e.put_ack for _, e, _ in outbox.clients if e.WhichOneof("body") == "put_ack"]
    assert len(acks) == 1 and acks[0].request_id == 7 and acks[0].failed
    assert "needs 16 bytes, frame has 12" in acks[0].failure.message
    assert (20, 0, 0) not in core.store


def test_an_early_transfer_refused_for_want_of_room_fails_its_run(monkeypatch):
    """Past the cap of early copies a copy cannot be kept: its Run fails at once, naming why, not waits forever."""
    import executor.data_plane as worker

    monkeypatch.setattr(worker, "_MAX_EARLY_TRANSFERS", 1)
    core, outbox = make_core()
    load(core, 1, lambda a: a + 1, torch.zeros(2))
    for call_id in (10, 11):     # both arrive before their Runs; only the first finds room
        msg = pb.Transfer()
        msg.shard.CopyFrom(ref(30 + call_id, tag=call_id))
        frame = tensor_to_frame(torch.ones(2), msg.tensor, 1)
        core.on_data(b"peer", pb.Envelope(transfer=msg), [bytes(memoryview(frame))], role="e1")
    run(core, seq=1, call_id=10, function_id=1, inputs=[ref(40, tag=10)], outputs=[ref(50)])
    run(core, seq=2, call_id=11, function_id=1, inputs=[ref(41, tag=11)], outputs=[ref(51)])
    first, second = outbox.dones()[-2:]
    assert first.call_id == 10 and first.ok
    assert second.call_id == 11 and not second.ok and second.failure.type == "TransferRefused"
    assert "early copies already kept" in second.failure.message


def test_a_run_of_a_program_the_executor_does_not_hold_is_reported_not_dropped():
    core, outbox = make_core()
    core.on_control(pb.Envelope(run_program=pb.RunProgram(program_id=9, base_seq=4, base_call_id=40)), [])
    done = outbox.dones()[-1]
    assert done.call_id == 40 and not done.ok and done.failure.type == "ProgramRunRefused"
    assert "program 9" in done.failure.message


def test_a_program_run_whose_handling_raises_is_reported(monkeypatch):
    core, outbox = make_core()
    core.programs[5] = (pb.RegisterProgram(program_id=5), [], [])

    def broken(plan, msg):
        raise KeyError("a bug while planning")

    import executor.run_queue as worker

    monkeypatch.setattr(worker, "_value_ids", broken)
    core.on_control(pb.Envelope(run_program=pb.RunProgram(program_id=5, base_seq=2, base_call_id=20)), [])
    done = outbox.dones()[-1]
    assert done.call_id == 20 and not done.ok and done.failure.type == "ProgramRunRefused"
    assert "a bug while planning" in done.failure.message


def test_the_controllers_heartbeat_settings_rule_once_welcomed():
    core, _ = make_core()
    core.on_control(pb.Envelope(welcome=pb.Welcome(index=0)), [])           # none sent: keep the command line's
    assert core.heartbeat_settings is None
    core.on_control(pb.Envelope(welcome=pb.Welcome(index=0, heartbeat_interval_s=0.2, heartbeat_timeout_s=3.0)), [])
    assert core.heartbeat_settings == (0.2, 3.0)
    core.on_control(pb.Envelope(welcome=pb.Welcome(index=0, heartbeat_interval_s=5.0, heartbeat_timeout_s=1.0)), [])
    assert core.heartbeat_settings == (0.2, 3.0)                             # nonsense is ignored
