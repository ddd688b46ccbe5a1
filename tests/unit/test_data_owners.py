"""A client's arrays on an executor are its own (executor/data_roles.py, OwnerCheck): puts need the controller's
token for that array and that client, fetches and saves of another client's array are answered as of one never
held, and the embedded client's path is unchanged. The controller's half: the secret in Welcome, each put array's
token, each Run's and RunProgram's owner."""

from __future__ import annotations

import itertools

import pytest
import torch

from controller import CallSpec, Controller, ControllerConfig
from controller.program import ProgramSpec, lower
from controller.resources import MeshAllocation
from executor.data_roles import PutLedger
from pathways_torch.wire import pb
from pathways_torch.wire.put_tokens import PUT_TOKEN_BYTES, put_token, shard_put_token
from pathways_torch.wire.security import owner_role
from pathways_torch.wire.tensors import frame_to_tensor, tensor_to_frame
from tests.unit.test_executor_core import fetch_tensor, load, make_core, put, ref

pytestmark = pytest.mark.timeout(60)

SECRET = bytes(range(32))
ALICE, BOB = "client-alice", "client-bob"
V = torch.tensor([1.0, 2.0])


def _welcomed_core():
    core, outbox = make_core()
    core.on_control(pb.Envelope(welcome=pb.Welcome(index=0, epoch=1, put_secret=SECRET)), [])
    return core, outbox


def _put(core, role, shards, request_id=1):
    """A put from ``role`` of ``shards``: (array id, tensor, token) each, in one message; its ack."""
    msg = pb.Put(request_id=request_id)
    frames = []
    for index, (array_id, tensor, token) in enumerate(shards):
        item = msg if index == 0 else msg.more.add()
        item.shard.CopyFrom(ref(array_id))
        item.token = token
        frames.append(bytes(memoryview(tensor_to_frame(tensor, item.tensor, index + 1))))
    core.on_data(role.encode(), pb.Envelope(put=msg), frames, role=role)
    return core.outbox.clients[-1][1].put_ack


def _fetch(core, role, shard_ref, request_id=100):
    core.on_data(role.encode(), pb.Envelope(fetch=pb.Fetch(request_id=request_id, shard=shard_ref)), [], role=role)
    return core.outbox.clients[-1][1].fetch_reply


def _save(core, role, shard_ref, path, request_id=200):
    save = pb.SaveShards(request_id=request_id, names=["w"], path=str(path))
    save.shards.add().CopyFrom(shard_ref)
    core.on_data(role.encode(), pb.Envelope(save_shards=save), [], role=role)
    return core.outbox.clients[-1][1].save_reply


def _fetch_alice(core, array_id, request_id=300):
    reply = _fetch(core, ALICE, ref(array_id), request_id)
    assert not reply.failed, reply.failure.message
    return frame_to_tensor(reply.tensor, [bytes(memoryview(p)) for p in core.outbox.clients[-1][2]])


_SEQUENCES = itertools.count(1)


def _token(array_id, role, *, shard=0, nbytes=V.numel() * V.element_size(), executor_id="e0", epoch=1, tag=0,
           sequence=None):
    """The controller's token for one put of ``array_id``'s shard on this test's executor (e0, incarnation 1)."""
    return put_token(SECRET, sequence=next(_SEQUENCES) if sequence is None else sequence, array_id=array_id,
                     shard=shard, nbytes=nbytes, executor_id=executor_id, epoch=epoch, role=role, tag=tag)


# ---------------------------------------------------------------- puts

def test_a_service_clients_put_needs_the_controllers_token_for_that_array_and_that_client():
    core, outbox = _welcomed_core()
    for token in (b"", b"x" * 16, _token(5, BOB), _token(6, ALICE), _token(5, "client")):
        ack = _put(core, ALICE, [(5, V, token)])
        assert ack.failed and ack.failure.type == "PermissionError"
        assert "array 5 is not this client's" in ack.failure.message
    # One shard with a bad token: none of the message's shards is stored.
    ack = _put(core, ALICE, [(7, V, _token(7, ALICE)), (5, V, _token(5, BOB))])
    assert ack.failed and "array 5" in ack.failure.message
    assert (5, 0, 0) not in core.store and (7, 0, 0) not in core.store
    assert core.counters["refused_not_owner"] == 6
    ack = _put(core, ALICE, [(5, V, _token(5, ALICE)), (7, V * 2, _token(7, ALICE))])
    assert not ack.failed
    assert core.store.get((5, 0, 0)).owner == core.store.get((7, 0, 0)).owner == ALICE
    # What alice put is hers: bob's put with his own token for it would not match, nor does it overwrite.
    assert _put(core, BOB, [(5, V * 9, _token(5, BOB))]).failed
    assert _fetch_alice(core, 5).tolist() == V.tolist()


def test_a_service_clients_put_before_the_welcome_waits_for_it_and_is_then_checked():
    core, outbox = make_core()   # registered, no Welcome yet: a client that heard of this executor may put already
    acks_before = len(core.outbox.clients)
    msg = pb.Put(request_id=1)
    msg.shard.CopyFrom(ref(5))
    msg.token = _token(5, ALICE)
    frame = bytes(memoryview(tensor_to_frame(V, msg.tensor, 1)))
    core.on_data(ALICE.encode(), pb.Envelope(put=msg), [frame], role=ALICE)
    forged = pb.Put(request_id=2)
    forged.shard.CopyFrom(ref(6))
    forged.token = b"\0" * 16
    core.on_data(BOB.encode(), pb.Envelope(put=forged), [bytes(memoryview(tensor_to_frame(V, forged.tensor, 1)))],
                 role=BOB)
    assert len(core.outbox.clients) == acks_before and (5, 0, 0) not in core.store   # held, not refused
    core.on_control(pb.Envelope(welcome=pb.Welcome(index=0, epoch=1, put_secret=SECRET)), [])
    acks = {env.put_ack.request_id: env.put_ack for _, env, _ in core.outbox.clients[acks_before:]}
    assert not acks[1].failed and core.store.get((5, 0, 0)).owner == ALICE
    assert acks[2].failed and "not this client's" in acks[2].failure.message and (6, 0, 0) not in core.store


def test_the_embedded_clients_put_and_fetch_are_unchanged_and_record_no_owner():
    core, outbox = _welcomed_core()
    put(core, ref(5), V)                        # no token, as before
    assert core.store.get((5, 0, 0)).owner == ""
    assert fetch_tensor(core, outbox, ref(5)).tolist() == V.tolist()
    # ... but it may not put over a service client's array (the two never share an executor; still refused).
    _put(core, ALICE, [(6, V, _token(6, ALICE))])
    ack = _put(core, "client", [(6, V * 9, b"")])
    assert ack.failed and "array 6 is not this client's" in ack.failure.message
    assert _fetch_alice(core, 6).tolist() == V.tolist()


# ---------------------------------------------------------------- fetches and saves

def test_a_fetch_or_save_of_another_clients_array_is_answered_as_one_never_held(tmp_path):
    core, outbox = _welcomed_core()
    core.data.writer.checkpoint_root = str(tmp_path)   # each client's checkpoints under tmp_path/<name>/
    _put(core, ALICE, [(5, V, _token(5, ALICE))])
    refused = {role: _fetch(core, role, ref(5)) for role in (BOB, "client")}
    saved = _save(core, BOB, ref(5), "w.safetensors")
    assert core.store.get((5, 0, 0)).pins == 0 and not list(tmp_path.iterdir())   # nothing pinned, nothing written
    assert _fetch_alice(core, 5).tolist() == V.tolist()
    # The same answers as for an array this executor does not hold.
    core.on_control(pb.Envelope(free=pb.Free(shards=[ref(5)])), [])
    unknown = _fetch(core, ALICE, ref(5))
    unknown_save = _save(core, ALICE, ref(5), "w.safetensors")
    for reply in refused.values():
        assert reply.failed and (reply.failure.type, reply.failure.message) == (unknown.failure.type,
                                                                                 unknown.failure.message)
    assert "holds no shard 0 of array 5" in unknown.failure.message
    assert saved.failed and (saved.failure.type, saved.failure.message) == (unknown_save.failure.type,
                                                                            unknown_save.failure.message)


def test_runs_and_program_runs_give_what_they_make_to_the_announced_client():
    core, outbox = _welcomed_core()
    load(core, 1, lambda x: x + 1, V)
    _put(core, ALICE, [(5, V, _token(5, ALICE))])
    core.on_control(pb.Envelope(run=pb.Run(seq=1, call_id=1, function_id=1, inputs=[ref(5)], outputs=[ref(10)],
                                           owner=ALICE)), [])
    assert core.store.get((10, 0, 0)).owner == ALICE
    assert _fetch_alice(core, 10).tolist() == (V + 1).tolist()
    assert _fetch(core, BOB, ref(10)).failed
    # The embedded client's run records nothing (its role owns what no one else does).
    put(core, ref(6), V)
    core.on_control(pb.Envelope(run=pb.Run(seq=2, call_id=2, function_id=1, inputs=[ref(6)], outputs=[ref(11)],
                                           owner="client")), [])
    assert core.store.get((11, 0, 0)).owner == "" and fetch_tensor(core, outbox, ref(11)).tolist() == (V + 1).tolist()
    # A program run: its outputs, and the copy made for it, are its client's.
    e0, e1 = MeshAllocation(1, (("data", 1),), ("e0",)), MeshAllocation(2, (("data", 1),), ("e1",))
    spec = ProgramSpec(name="ab", input_values=(0, 1), input_meshes=(e0, e1), output_values=(3,), nodes=(
        CallSpec(name="A", function_id=1, mesh=e0, inputs=(0,), outputs=(2,)),
        CallSpec(name="B", function_id=2, mesh=e0, inputs=(2, 1), outputs=(3,))))
    load(core, 2, lambda a, b: a * b, V, V.clone(), name="B")
    core.on_control(pb.Envelope(register_program=lower(spec, 7, {"e0": "a", "e1": "b"}).plans["e0"]), [])
    _put(core, BOB, [(20, V, _token(20, BOB))])
    core.on_control(pb.Envelope(run_program=pb.RunProgram(
        program_id=7, base_seq=3, base_call_id=100, input_array_ids=[20, 21], output_array_ids=[30],
        first_intermediate_id=1000, owner=BOB)), [])
    assert core.store.get((30, 0, 0)).owner == core.store.get((21, 0, 101)).owner == BOB   # B waits for the copy
    transfer = pb.Transfer(shard=ref(21, tag=101))
    frame = tensor_to_frame(V * 3, transfer.tensor, 1)
    core.on_data(b"peer", pb.Envelope(transfer=transfer), [bytes(memoryview(frame))], role="e1")
    reply = _fetch(core, BOB, ref(30), request_id=400)
    assert not reply.failed and reply.request_id == 400
    assert _fetch(core, ALICE, ref(30)).failed and _fetch(core, "client", ref(30)).failed


def test_a_copy_that_came_before_its_run_is_its_runs_clients_once_the_run_says_so():
    core, outbox = _welcomed_core()
    transfer = pb.Transfer(shard=ref(5, tag=9))
    frame = tensor_to_frame(V, transfer.tensor, 1)
    core.on_data(b"peer", pb.Envelope(transfer=transfer), [bytes(memoryview(frame))], role="e1")
    assert core.store.get((5, 0, 9)).owner == ""                  # kept early; whose, not known yet
    assert _fetch(core, ALICE, ref(5, tag=9)).failed
    # Its run (which also waits for array 8, never put) names alice.
    core.on_control(pb.Envelope(run=pb.Run(seq=1, call_id=9, function_id=1, inputs=[ref(5, tag=9), ref(8)],
                                           outputs=[ref(10)], owner=ALICE)), [])
    assert core.store.get((5, 0, 9)).owner == ALICE
    assert not _fetch(core, ALICE, ref(5, tag=9)).failed and _fetch(core, BOB, ref(5, tag=9)).failed


# ---------------------------------------------------------------- lifetimes

def test_an_owner_lives_and_dies_with_its_store_entry():
    core, outbox = _welcomed_core()
    _put(core, ALICE, [(5, V, _token(5, ALICE))])
    load(core, 1, lambda x: x + 1, V)
    core.store.claim((5, 0, 9))   # a copy for call 9 on its way; the run names alice
    run = pb.Run(seq=1, call_id=9, function_id=99, inputs=[ref(5, tag=9)], outputs=[ref(10)], owner=ALICE)
    core.on_control(pb.Envelope(run=run), [])           # function 99 is not loaded: the run waits
    assert core.store.get((5, 0, 9)).owner == core.store.get((10, 0, 0)).owner == ALICE
    assert _fetch(core, BOB, ref(5, tag=9)).failed
    core.on_control(pb.Envelope(free=pb.Free(shards=[ref(5), ref(10)])), [])
    assert (5, 0, 0) not in core.store
    # The embedded client's put of a freed id starts afresh: no owner left behind.
    put(core, ref(5), V * 2)
    assert core.store.get((5, 0, 0)).owner == ""


# ---------------------------------------------------------------- the controller's half

class _Outbox:
    def __init__(self):
        self.sent = []

    def to_executor(self, executor_id, envelope, payload=()):
        self.sent.append((executor_id, envelope))

    def bodies(self, kind):
        return [(e, getattr(env, kind)) for e, env in self.sent if env.WhichOneof("body") == kind]


def test_the_controller_gives_its_secret_in_welcome_a_token_with_each_put_array_and_an_owner_with_each_run():
    outbox = _Outbox()
    controller = Controller(outbox, ControllerConfig())
    for i in range(2):
        controller.on_message(f"e{i}", pb.Envelope(register=pb.Register(
            executor_id=f"e{i}", data_address=f"tcp://127.0.0.1:{7100 + i}", device="cpu", backend="eager")), [])
    secrets = {bytes(w.put_secret) for _, w in outbox.bodies("welcome")}
    assert len(secrets) == 1 and len(secret := secrets.pop()) == 32
    assert Controller(_Outbox(), ControllerConfig()).lifetimes.put_secret != secret   # random per controller
    mine = controller.lifetimes.new_array(("e0", "e1"), landing=2, owner="alice", shard_bytes=8)
    assert len(mine.put_token) == 2 * PUT_TOKEN_BYTES   # one per (executor, shard), each for 8 bytes, one put
    assert [shard_put_token(mine.put_token, p) for p in (0, 1)] == [
        put_token(secret, sequence=1, array_id=mine.array_id, shard=p, nbytes=8, executor_id=e, epoch=1,
                  role="client-alice") for p, e in enumerate(("e0", "e1"))]
    assert controller.lifetimes.new_array(("e0",), landing=1).put_token == b""    # the embedded client's: none needed
    assert owner_role("") == "client" and owner_role("alice") == "client-alice"
    function_id = controller.call_dispatch.register_function("f", pb.Graph(), [])
    mesh = controller.resources.allocate({"data": 2}, ["e0", "e1"])
    controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=mesh, inputs=(), num_outputs=1),
                                  "alice")
    controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=mesh, inputs=(), num_outputs=1))
    assert [r.owner for _, r in outbox.bodies("run")] == ["client-alice"] * 2 + ["client"] * 2
    spec = ProgramSpec(name="p", input_values=(0,), input_meshes=(mesh,), output_values=(1,), nodes=(
        CallSpec(name="f", function_id=function_id, mesh=mesh, inputs=(0,), outputs=(1,)),))
    program_id = controller.call_dispatch.register_program(spec).program_id
    controller.call_dispatch.run_program(program_id, [mine.array_id], "alice")
    assert [r.owner for _, r in outbox.bodies("run_program")] == ["client-alice"] * 2


# ---------------------------------------------------------------- one token, one put, exactly what it names (#46: H2)

def _refusal(ack):
    assert ack.failed and ack.failure.type == "PermissionError", ack
    return ack.failure.message


def test_a_put_token_is_good_for_one_put_of_exactly_the_shard_tag_bytes_and_executor_it_names():
    core, outbox = _welcomed_core()
    big = torch.zeros(2 << 20)                    # 8 MiB, for a token of 8 bytes
    token = _token(5, ALICE)
    refusals = {
        "byte count 8, not 8388608": _put(core, ALICE, [(5, big, token)]),
        "for shard 0, not 1": _put_ref(core, ALICE, ref(5, shard=1), V, token),
        "for tag 0, not 9": _put_ref(core, ALICE, ref(5, tag=9), V, token),
        "for another executor": _put(core, ALICE, [(5, V, _token(5, ALICE, executor_id="e1"))]),
        "for executor incarnation 2, not 1": _put(core, ALICE, [(5, V, _token(5, ALICE, epoch=2))]),
        "used twice in one message": _put(core, ALICE, [(5, V, token), (5, V, token)]),
    }
    for expected, ack in refusals.items():
        assert expected in _refusal(ack)
    assert len(core.store) == 0 and core.counters["refused_data_messages"] == len(refusals)
    assert not _put(core, ALICE, [(5, V, token)]).failed                # the put it names: taken, once
    core.on_control(pb.Envelope(free=pb.Free(shards=[ref(5)])), [])
    assert "used already" in _refusal(_put(core, ALICE, [(5, V, token)]))   # again, after its array was freed
    assert (5, 0, 0) not in core.store and core.store.bytes == 0


def test_a_token_the_controllers_free_spent_puts_nothing_when_its_shard_comes_late():
    core, outbox = _welcomed_core()
    token = _token(6, ALICE, sequence=40)
    free = pb.Free(shards=[ref(6)], spent_puts=[pb.SpentPut(role=ALICE, sequence=40)])
    core.on_control(pb.Envelope(free=free), [])       # the client left mid-put: its array is freed first
    assert "used already" in _refusal(_put(core, ALICE, [(6, V, token)]))
    assert (6, 0, 0) not in core.store and core.store.bytes == 0
    assert not _put(core, ALICE, [(7, V, _token(7, ALICE, sequence=41))]).failed   # its later tokens still put


def test_a_clients_put_ledger_stays_bounded_and_refuses_what_fell_behind_its_window():
    ledger = PutLedger(window=8)
    for sequence in range(1, 101):
        assert ledger.refusal(sequence) is None
        ledger.take(sequence)
    assert len(ledger.taken) <= 16                     # however long the client puts
    assert "used already" in ledger.refusal(100) and "too old" in ledger.refusal(50)
    assert ledger.refusal(95) is not None and ledger.refusal(101) is None
    ledger.take(103)                                   # out of order within the window: 102 may still come
    assert ledger.refusal(102) is None


def _put_ref(core, role, shard_ref, tensor, token):
    msg = pb.Put(request_id=1, shard=shard_ref, token=token)
    frame = bytes(memoryview(tensor_to_frame(tensor, msg.tensor, 1)))
    core.on_data(role.encode(), pb.Envelope(put=msg), [frame], role=role)
    return core.outbox.clients[-1][1].put_ack


def test_a_free_that_spends_puts_names_only_the_put_arrays_shards_never_a_computed_one_in_the_same_batch():
    # A Free with spent puts fails the runs still waiting for the shards it names (the put never came); a
    # computed array freed in the same batch, its run not begun yet, must ride in a Free of its own (CI at
    # 60baa03: `del y, x` failed z = layer(y, w) with PutAbandoned).
    outbox = _Outbox()
    controller = Controller(outbox, ControllerConfig())
    controller.on_message("e0", pb.Envelope(register=pb.Register(
        executor_id="e0", data_address="tcp://127.0.0.1:7100", device="cpu", backend="eager")), [])
    put_array = controller.lifetimes.new_array(("e0",), landing=1, owner="alice", shard_bytes=8)
    controller.lifetimes.landed(put_array.array_id)
    mesh = controller.resources.allocate({"data": 1}, ["e0"])
    function_id = controller.call_dispatch.register_function("f", pb.Graph(), [])
    [computed] = controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=mesh,
                                                        inputs=(put_array.array_id,), num_outputs=1), "alice")
    controller.lifetimes.release_many([computed.array_id, put_array.array_id])
    frees = [free for _, free in outbox.bodies("free")]
    assert sorted(([r.array_id for r in f.shards], len(f.spent_puts)) for f in frees) == sorted(
        [([computed.array_id], 0), ([put_array.array_id], 1)])
