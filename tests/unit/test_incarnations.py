"""Incarnations, in-process: a lost executor's replacement, what the controller resets for it, what survivors
cancel and abandon, and what an old incarnation may no longer do."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch

from controller import CallSpec, Controller, ControllerConfig
from controller.rendezvous import RendezvousStore
from executor.collectives import CollectiveRuntime, gloo_group_on
from pathways_torch.errors import ExecutorLostError
from pathways_torch.wire import pb
from tests.unit.test_controller import FakeClock, FakeOutbox
from tests.unit.test_executor_core import X, load, make_core, put, ref

pytestmark = pytest.mark.timeout(60)

KEYS = {f"e{i}": bytes([ord("a") + i]) * 40 for i in range(3)}


def _register(controller, executor_id, port_offset=0, key=None):
    register = pb.Register(executor_id=executor_id, data_address=f"tcp://127.0.0.1:{7000 + port_offset}",
                           device="cpu", backend="eager", pid=1 + port_offset, public_key=key or KEYS[executor_id])
    controller.on_message(executor_id, pb.Envelope(register=register), [])


@pytest.fixture
def setup():
    outbox, clock = FakeOutbox(), FakeClock()
    controller = Controller(outbox, ControllerConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0), clock=clock)
    for index, executor_id in enumerate(KEYS):
        _register(controller, executor_id, index)
    return controller, outbox, controller.call_dispatch.register_function("f", pb.Graph(), [])


def _collective_call(controller, function_id, mesh):
    [out] = controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=mesh, inputs=(),
                                                   num_outputs=1, collective_axes=("data",),
                                                   replicated_outputs=(True,)))
    return out


# ---------------------------------------------------------------- controller


def test_a_replacement_registers_with_the_next_epoch_and_starts_its_gang_order_afresh(setup):
    controller, outbox, function_id = setup
    mesh = controller.resources.allocate({"data": 3}, list(KEYS))
    first = _collective_call(controller, function_id, mesh)
    (_, form_before), *_ = outbox.of("form_group")
    assert list(form_before.form_group.members) == ["e0@1", "e1@1", "e2@1"]
    assert form_before.form_group.timeout_s == 20.0     # the loss bound (2 x 5 s), at least 20 s
    controller.members.declare_lost("e1", "killed")
    assert isinstance(first.error, ExecutorLostError)
    # The survivors are told which calls failed and which groups are gone; the lost one is told nothing.
    cancels = outbox.of("cancel")
    assert sorted(e for e, _ in cancels) == ["e0", "e2"]
    assert list(cancels[0][1].cancel.call_ids) == [first.producer_call]
    assert list(cancels[0][1].cancel.group_ids) == [form_before.form_group.group_id]
    assert cancels[0][1].cancel.lost_executor == "e1@1"
    assert controller.members.heard_from("e0", 1) == ("live", ["e1@1<2"], 1)   # groups made before the loss: 1
    # An executor that says it was told of that fault is not told again (every answer to every survivor would
    # carry every fault); one that says more than there are (another controller's count) is told them all.
    assert controller.members.heard_from("e0", 1, told=1) == ("live", [], 1)
    assert controller.members.heard_from("e0", 1, told=5) == ("live", ["e1@1<2"], 1)

    _register(controller, "e1", 7, key=b"z" * 40)
    info = controller.resources.executors["e1"]
    assert (info.epoch, info.lost, info.index, info.public_key) == (2, False, 1, b"z" * 40)
    welcome = [w for e, w in outbox.of("welcome") if e == "e1"][-1]
    assert welcome.welcome.epoch == 2
    outbox.sent.clear()
    _collective_call(controller, function_id, mesh)
    forms = {e: env.form_group for e, env in outbox.of("form_group")}
    assert set(forms) == {"e0", "e1", "e2"} and forms["e1"].group_id != form_before.form_group.group_id
    assert list(forms["e1"].members) == ["e0@1", "e1@2", "e2@1"]
    assert forms["e1"].prev_collective_seq == 0            # the new process starts its chain at 0 ...
    assert forms["e0"].prev_collective_seq > 0             # ... the survivors go on with theirs


def test_messages_of_a_replaced_incarnation_are_refused_by_their_epoch(setup):
    controller, outbox, function_id = setup
    controller.members.declare_lost("e2", "stopped")
    _register(controller, "e2", 9)
    assert controller.members.heard_from("e2", epoch=1) == ("stale", [], 0)
    assert controller.members.heard_from("e2", epoch=2)[0] == "live"
    mesh = controller.resources.allocate({"data": 1}, ["e2"])
    [out] = controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=mesh, inputs=(),
                                                   num_outputs=1))
    done = pb.Envelope(done=pb.Done(call_id=out.producer_call, ok=True), epoch=1)
    controller.on_message("e2", done, [])
    assert out.state == "pending" and controller.members.stale_messages == 2
    done.epoch = 2
    controller.on_message("e2", done, [])
    assert out.state == "ready"


def test_a_replicated_result_stays_readable_from_a_replica_left_and_lost_shards_are_refused_as_inputs(setup):
    controller, outbox, function_id = setup
    mesh = controller.resources.allocate({"data": 2}, ["e0", "e1"])
    replicated = _collective_call(controller, function_id, mesh)
    for executor_id in ("e0", "e1"):
        controller.on_message(executor_id, pb.Envelope(done=pb.Done(call_id=replicated.producer_call, ok=True)), [])
    sharded = controller.lifetimes.new_array(mesh.executor_ids)
    controller.members.declare_lost("e1", "killed")
    assert replicated.state == "ready" and replicated.lost_holders == {"e1"}
    assert sharded.state == "failed"
    _register(controller, "e1", 8)
    with pytest.raises(ExecutorLostError, match="has a shard on executor e1"):
        controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=mesh,
                                               inputs=(replicated.array_id,), num_outputs=1))


def test_the_rendezvous_fails_the_gets_waiting_for_a_lost_member():
    store = RendezvousStore()
    store.allow("group-1/epoch-0", ["e0", "e1"])
    store.allow("group-2/epoch-0", ["e0", "e2"])
    replies = []
    for prefix in ("group-1/epoch-0", "group-2/epoch-0"):
        store.handle("e0", pb.StoreRequest(request_id=len(replies) + 1, op="get", key=f"{prefix}/rank1"),
                     replies.append)
    assert replies == []
    store.fail_member("e1", "killed")
    assert len(replies) == 1 and "member e1 was lost" in replies[0].error
    store.handle("e0", pb.StoreRequest(request_id=9, op="get", key="group-1/epoch-0/x"), replies.append)
    assert "no member" in replies[-1].error            # the lost member's group is closed for good


# ---------------------------------------------------------------- executor core


def _collective_run(core, *, seq, call_id, prev, inputs, outputs):
    run = pb.Run(seq=seq, call_id=call_id, function_id=1, inputs=inputs, outputs=outputs, collective=True,
                 prev_collective_seq=prev)
    core.on_control(pb.Envelope(run=run), [])


def test_cancel_drops_the_failed_calls_queued_work_and_gang_order_steps_over_it():
    core, outbox = make_core()
    load(core, 1, lambda x: x + 1, X)
    # Call 1 waits for a copy that will never come (its sender was lost); call 2 comes after it in gang order.
    _collective_run(core, seq=1, call_id=1, prev=0, inputs=[ref(10, tag=1)], outputs=[ref(11)])
    put(core, ref(20), torch.ones(2, 3))
    _collective_run(core, seq=2, call_id=2, prev=1, inputs=[ref(20)], outputs=[ref(21)])
    assert outbox.dones() == []                      # 2 waits for 1's gang turn
    cancel = pb.Cancel(call_ids=[1], reason="executor e1 lost: killed", lost_executor="e1@1")
    core.on_control(pb.Envelope(cancel=cancel), [])
    dropped, done = outbox.dones()
    assert (dropped.call_id, dropped.ok, dropped.failure.type) == (1, False, "ExecutorLostError")   # the call ends
    assert done.call_id == 2 and done.ok             # 1's turn was skipped, 2 ran
    assert core.store.get((11, 0, 0)).failure.type == "ExecutorLostError"
    assert (10, 0, 1) not in core.store and core.cancelled == 1


def test_cancelled_runs_that_read_each_other_are_all_dropped_and_later_work_runs():
    core, outbox = make_core()
    load(core, 1, lambda x: x + 1, X)
    # A survivor's run-ahead: steps k+1, k+2, k+3, each reading the one before, all behind a copy that never comes.
    _collective_run(core, seq=1, call_id=1, prev=0, inputs=[ref(10, tag=1)], outputs=[ref(11)])
    _collective_run(core, seq=2, call_id=2, prev=1, inputs=[ref(11)], outputs=[ref(12)])
    _collective_run(core, seq=3, call_id=3, prev=2, inputs=[ref(12)], outputs=[ref(13)])
    core.on_control(pb.Envelope(cancel=pb.Cancel(call_ids=[1, 2, 3], lost_executor="e1@1")), [])
    assert len(core._queue) == 0 and core.cancelled == 3
    assert [(d.call_id, d.ok) for d in outbox.dones()] == [(1, False), (2, False), (3, False)]
    put(core, ref(20), torch.ones(2, 3))
    _collective_run(core, seq=4, call_id=4, prev=3, inputs=[ref(20)], outputs=[ref(21)])
    assert [(d.call_id, d.ok) for d in outbox.dones()][-1] == (4, True)


def test_cancel_abandons_queued_formations_of_the_lost_executors_groups():
    core, outbox = make_core()
    load(core, 1, lambda x: x + 1, X)
    core.on_control(pb.Envelope(form_group=pb.FormGroup(seq=1, prev_collective_seq=7, group_id=5)), [])
    put(core, ref(20), torch.ones(2, 3))
    _collective_run(core, seq=2, call_id=2, prev=1, inputs=[ref(20)], outputs=[ref(21)])
    core.on_control(pb.Envelope(cancel=pb.Cancel(group_ids=[5], lost_executor="e1@1")), [])
    assert outbox.dones() == [] and core.cancelled == 1   # the formation's predecessor (7) has not started
    core._last_collective_seq = 7
    core._pump()
    assert [d.call_id for d in outbox.dones()] == [2]


def test_a_run_binding_a_group_whose_formation_was_cancelled_or_made_before_a_fault_fails_as_abandoned():
    # CI saw "process group 3 ... was never formed" (a RuntimeError, which recovery does not undo) on a survivor
    # whose queued formation a Cancel had skipped while a run that bound the group stayed queued.
    from executor.collectives import CollectiveAbandoned

    core, _ = make_core()
    core.on_control(pb.Envelope(form_group=pb.FormGroup(seq=1, prev_collective_seq=7, group_id=5)), [])
    core.on_control(pb.Envelope(cancel=pb.Cancel(group_ids=[5], reason="executor e1 lost", lost_executor="e1@1")),
                    [])
    with pytest.raises(CollectiveAbandoned, match="group 5 .* the controller abandoned it \\(executor e1 lost\\)"):
        with core.collectives.bind({"data": 5}):
            core.collectives.run("all_reduce", torch.ones(2), "data", op="sum")
    runtime = _pair_of_runtimes()[0]
    runtime.abandon("transfer:7.0:a->b", "a link lost it", before_group=9)
    with pytest.raises(CollectiveAbandoned, match="group 8 .* made before a fault of its island and never formed"):
        with runtime.bind({"data": 8}):
            runtime.run("all_reduce", torch.ones(2), "data", op="sum")
    with pytest.raises(RuntimeError, match="group 9 .* it was never formed") as raised:   # after the fault: a bug
        with runtime.bind({"data": 9}):
            runtime.run("all_reduce", torch.ones(2), "data", op="sum")
    assert not isinstance(raised.value, CollectiveAbandoned)


def test_admit_key_reaches_the_gatekeeper_hook():
    core, _ = make_core()
    admitted = []
    core.admit_key = lambda role, key: admitted.append((role, key))
    core.on_control(pb.Envelope(admit_key=pb.AdmitKey(role="e1", public_key=b"k" * 40)), [])
    assert admitted == [("e1", b"k" * 40)]


# ---------------------------------------------------------------- collectives


def _pair_of_runtimes():
    import torch.distributed as dist

    store = dist.HashStore()
    runtimes = [CollectiveRuntime() for _ in range(2)]
    groups = [None, None]

    def join(rank):
        groups[rank] = gloo_group_on(dist.PrefixStore("g", store), rank, 2, timeout_s=3)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    from executor.collectives import _Group

    for rank, runtime in enumerate(runtimes):
        runtime._groups[1] = _Group(groups[rank], 2, frozenset({"a@1", "b@1"}))
    return runtimes


def test_abandoning_a_lost_peer_ends_a_collective_blocked_on_it_within_the_wait_slice():
    survivor, _ = _pair_of_runtimes()     # the peer never joins the all-reduce: as if stopped
    errors = []

    def reduce():
        try:
            with survivor.bind({"data": 1}):
                survivor.run("all_reduce", torch.ones(4), "data", op="sum")
        except RuntimeError as exc:
            errors.append((time.monotonic(), exc))

    thread = threading.Thread(target=reduce)
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive()                      # blocked in gloo (its own timeout is 3 s)
    abandoned_at = time.monotonic()
    assert survivor.abandon("b@1", "declared lost") == [1]
    thread.join(5)
    (ended_at, error), = errors
    assert ended_at - abandoned_at < 1.0 and "b@1 was lost" in str(error)
    with pytest.raises(RuntimeError, match="unusable: member b@1 was lost"):
        with survivor.bind({"data": 1}):
            survivor.run("all_reduce", torch.ones(4), "data", op="sum")
    assert survivor.abandon("c@1", "unrelated") == []


def test_a_collective_in_time_is_unchanged_by_the_sliced_wait():
    a, b = _pair_of_runtimes()
    out = {}

    def reduce(name, runtime, value):
        with runtime.bind({"data": 1}):
            out[name] = runtime.run("all_reduce", torch.full((3,), value), "data", op="sum")

    threads = [threading.Thread(target=reduce, args=("a", a, 1.0)),
               threading.Thread(target=reduce, args=("b", b, 2.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert torch.equal(out["a"], torch.full((3,), 3.0)) and torch.equal(out["b"], out["a"])
    assert datetime.timedelta(milliseconds=200) == __import__("executor.collectives").collectives._WAIT_SLICE


def test_a_replacements_key_folder_holds_its_own_pair_and_the_others_public_keys_and_the_old_key_is_revoked():
    import zmq

    from pathways_torch.wire.security import Gatekeeper, KeyDirectory

    first = KeyDirectory.create(["controller", "e1"])
    replacement = KeyDirectory.create(["e1"])
    context = zmq.Context()
    try:
        old_key = first.keypair("e1").public
        replacement.add_public("controller", first.keypair("controller").public)
        credentials = replacement.credentials("e1")
        assert credentials.public_key("controller") == first.keypair("controller").public
        assert credentials.keys.public != old_key
        gatekeeper = Gatekeeper(context, first.public_keys())
        assert gatekeeper.callback("pathways", old_key)
        gatekeeper.admit("e1", credentials.keys.public)
        assert gatekeeper.callback("pathways", credentials.keys.public)
        assert not gatekeeper.callback("pathways", old_key) and gatekeeper.refused == 1
        gatekeeper.stop()
    finally:
        first.remove()
        replacement.remove()
        context.term()


def test_a_transfer_is_acknowledged_and_one_not_acknowledged_in_time_is_reported_lost():
    core, outbox = make_core()
    put(core, ref(5), torch.ones(2, 3))
    for tag in (7, 8):
        send = pb.SendShard(to_address="tcp://peer:1", call_id=tag)
        send.shard.CopyFrom(ref(5))
        send.as_ref.CopyFrom(ref(5, tag=tag))
        core.on_control(pb.Envelope(send_shard=send), [])
    assert len(core._unacked) == 2
    core.on_peer_reply("tcp://peer:1", pb.Envelope(transfer_ack=pb.TransferAck(shard=ref(5, tag=7))))
    core.check_transfers(time.monotonic())                      # not due yet
    assert [env for env, _ in outbox.controller if env.HasField("transfer_lost")] == []
    core.check_transfers(time.monotonic() + core.transfer_timeout_s + 1)
    (lost,) = [env.transfer_lost for env, _ in outbox.controller if env.HasField("transfer_lost")]
    assert lost.shard.tag == 8 and lost.to_address == "tcp://peer:1" and lost.nbytes == 24
    assert core._unacked == {} and core.transfers_lost == 1


def test_a_lost_transfer_fails_the_waiting_run_on_the_receiver_and_its_call_alone(setup):
    controller, outbox, function_id = setup
    a = controller.resources.allocate({"data": 1}, ["e0"])
    b = controller.resources.allocate({"data": 1}, ["e1"])
    x = controller.lifetimes.new_array(a.executor_ids)
    [needs_copy] = controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=b,
                                                          inputs=(x.array_id,), num_outputs=1))
    [other] = controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=b, inputs=(),
                                                     num_outputs=1))
    (_, send), = outbox.of("send_shard")
    lost = pb.TransferLost(to_address=send.send_shard.to_address, waited_s=21, nbytes=24)
    lost.shard.CopyFrom(send.send_shard.as_ref)
    controller.on_message("e0", pb.Envelope(transfer_lost=lost), [])
    (to, failed), = outbox.of("transfer")           # the receiver is told its copy will not come ...
    assert to == "e1" and failed.transfer.failed and failed.transfer.shard == send.send_shard.as_ref
    assert needs_copy.state == "pending"            # ... but the copy may have arrived (its acknowledgement lost)
    # The receiver's run did lack it: its answer fails the call, and nothing else.
    controller.on_message("e1", pb.Envelope(transfer_lost=_missing(failed.transfer)), [])
    assert needs_copy.state == "failed" and needs_copy.error.remote_type == "TransferLost"
    assert "from e0 to e1" in str(needs_copy.error) and other.state == "pending"
    assert not any(info.lost for info in controller.resources.ordered())


def _missing(transfer: pb.Transfer) -> pb.TransferLost:
    """The receiver's answer to the controller's failed copy: a run here did lack it."""
    return pb.TransferLost(shard=transfer.shard, missing=True, failure=transfer.failure)


def test_the_receiver_answers_a_lost_copy_only_when_a_run_waits_for_it():
    core, outbox = make_core()
    failed = pb.Transfer(failed=True, shard=ref(5, tag=9),
                         failure=pb.RemoteFailure(type="TransferLost", executor_id="e1", origin_call_id=9))
    core.store.claim((5, 0, 9))                     # a run here waits for the copy
    core.on_control(pb.Envelope(transfer=failed), [])
    (answer,) = [env.transfer_lost for env, _ in outbox.controller if env.HasField("transfer_lost")]
    assert answer.missing and answer.shard == ref(5, tag=9) and answer.failure.executor_id == "e1"
    assert core.store.get((5, 0, 9)).failure.type == "TransferLost"
    outbox.controller.clear()
    core.store.fill((6, 0, 9), torch.ones(1))       # this copy arrived: only its acknowledgement was lost
    core.on_control(pb.Envelope(transfer=pb.Transfer(failed=True, shard=ref(6, tag=9), failure=failed.failure)), [])
    assert [env for env, _ in outbox.controller if env.HasField("transfer_lost")] == []
    assert core.store.get((6, 0, 9)).failure is None


def test_a_program_that_ran_on_a_replaced_executor_is_lowered_again_for_its_new_address_and_groups(setup):
    from controller.program import ProgramSpec

    controller, outbox, function_id = setup
    pair = controller.resources.allocate({"data": 2}, ["e1", "e2"])
    on_e0, on_e1 = (controller.resources.allocate({"data": 1}, [e]) for e in ("e0", "e1"))
    spec = ProgramSpec(name="p", input_values=(0,), input_meshes=(pair,), output_values=(3,), nodes=(
        CallSpec(name="reduce", function_id=function_id, mesh=pair, inputs=(0,), outputs=(1,),
                 collective_axes=("data",)),
        CallSpec(name="there", function_id=function_id, mesh=on_e0, inputs=(1,), outputs=(2,)),
        CallSpec(name="back", function_id=function_id, mesh=on_e1, inputs=(2,), outputs=(3,))))
    lowered = controller.call_dispatch.register_program(spec)
    controller.call_dispatch.run_program(lowered.program_id,
                                         [controller.lifetimes.new_array(pair.executor_ids).array_id])
    first = {e: env.register_program for e, env in outbox.of("register_program")}
    controller.members.declare_lost("e1", "killed")
    _register(controller, "e1", 11)          # a new process at a new address
    outbox.sent.clear()
    y = controller.lifetimes.new_array(pair.executor_ids)
    controller.call_dispatch.run_program(lowered.program_id, [y.array_id])
    again = {e: env.register_program for e, env in outbox.of("register_program")}
    assert set(again) == set(first) == {"e0", "e1", "e2"}      # every executor of the program, survivors too

    def send(plan):
        (action,) = [a.send for a in plan.actions if a.WhichOneof("kind") == "send"]
        return action.to_address, action.to_public_key

    assert send(first["e0"]) == ("tcp://127.0.0.1:7001", KEYS["e1"])
    assert send(again["e0"]) == ("tcp://127.0.0.1:7011", KEYS["e1"])   # the replacement's address

    def group(plan):
        return next(a.run.axis_groups["data"] for a in plan.actions if a.WhichOneof("kind") == "run")

    assert group(again["e2"]) != group(first["e2"]) and group(again["e1"]) == group(again["e2"])   # a new group
    assert sorted(e for e, _ in outbox.of("form_group")) == ["e1", "e2"]
    assert list(outbox.of("run_program")[0][1].run_program.input_array_ids) == [y.array_id]


def test_a_loss_abandons_the_islands_groups_made_before_it_and_spares_the_replacements():
    old = _pair_of_runtimes()[0]
    from executor.collectives import _Group

    old._groups[2] = _Group(object(), 2, frozenset({"a@1", "c@1"}))      # without the lost one: out of step too
    old._groups[5] = _Group(object(), 2, frozenset({"a@1", "b@2"}))      # formed with the replacement
    assert sorted(old.abandon("b@1", "declared lost", before_group=5)) == [1, 2]
    assert sorted(old._groups) == [5]


def test_an_abandoned_groups_collective_raises_collective_abandoned_which_recovery_can_undo():
    from executor.collectives import CollectiveAbandoned
    from pathways_torch.errors import RemoteError
    from pathways_torch.training.recovery import is_recoverable

    runtime = _pair_of_runtimes()[0]
    runtime.abandon("transfer:7.0:a->b", "a link lost it", before_group=2)
    with pytest.raises(CollectiveAbandoned, match="transfer:7.0:a->b was lost"):
        with runtime.bind({"data": 1}):
            runtime.run("all_reduce", torch.ones(4), "data", op="sum")
    assert runtime._abandoned_below == 2 and 1 in runtime._abandoned_ids
    assert is_recoverable(RemoteError("x", remote_type="CollectiveAbandoned"))
    assert is_recoverable(RemoteError("x", remote_type="TransferLost"))
    assert is_recoverable(ExecutorLostError("x"))
    assert not is_recoverable(RemoteError("x", remote_type="ValueError")) and not is_recoverable(None)


def _two_island_program():
    """Islands a (e0, e1) and b (e2, e3), and one run of a program reducing on a, then on b (a copy crosses)."""
    from controller.program import ProgramSpec

    outbox, clock = FakeOutbox(), FakeClock()
    controller = Controller(outbox, ControllerConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0), clock=clock)
    for index, (executor_id, island) in enumerate([("e0", "a"), ("e1", "a"), ("e2", "b"), ("e3", "b")]):
        controller.on_message(executor_id, pb.Envelope(register=pb.Register(
            executor_id=executor_id, data_address=f"tcp://127.0.0.1:{7000 + index}", device="cpu",
            backend="eager", pid=1 + index, public_key=bytes([97 + index]) * 40, island=island)), [])
    function_id = controller.call_dispatch.register_function("f", pb.Graph(), [])
    here, there = (controller.resources.allocate({"data": 2}, ids) for ids in (["e0", "e1"], ["e2", "e3"]))
    spec = ProgramSpec(name="p", input_values=(0,), input_meshes=(here,), output_values=(2,), nodes=(
        CallSpec(name="reduce", function_id=function_id, mesh=here, inputs=(0,), outputs=(1,),
                 collective_axes=("data",)),
        CallSpec(name="across", function_id=function_id, mesh=there, inputs=(1,), outputs=(2,),
                 collective_axes=("data",))))
    lowered = controller.call_dispatch.register_program(spec)
    [out] = controller.call_dispatch.run_program(lowered.program_id,
                                                 [controller.lifetimes.new_array(here.executor_ids).array_id])
    return controller, outbox, lowered, out


def test_a_loss_cancels_and_abandons_on_every_island_its_program_run_spans():
    # e3 (island b) is lost: island a's steps of the run would wait for nothing (or one executor of a would enter
    # a collective its peer skipped), so island a is told too.
    controller, outbox, lowered, out = _two_island_program()
    controller.members.declare_lost("e3", "killed")
    assert isinstance(out.error, ExecutorLostError)
    assert sorted(e for e, _ in outbox.of("cancel")) == ["e0", "e1", "e2"]
    assert controller.members.heard_from("e0", 1)[1] == controller.members.heard_from("e2", 1)[1] == ["e3@1<3"]
    assert controller.groups.by_members == {} and lowered.program_id in controller.state.stale_programs


def test_a_loss_lowers_again_only_the_programs_whose_collectives_name_the_islands_groups():
    from controller.program import ProgramSpec

    controller, _, with_collectives, _ = _two_island_program()
    here = controller.resources.allocate({"data": 1}, ["e2"])   # island b, where e3 is lost
    function_id = controller.call_dispatch.register_function("g", pb.Graph(), [])
    plain = controller.call_dispatch.register_program(ProgramSpec(
        name="plain", input_values=(0,), input_meshes=(here,), output_values=(1,),
        nodes=(CallSpec(name="g", function_id=function_id, mesh=here, inputs=(0,), outputs=(1,)),)))
    controller.members.declare_lost("e3", "killed")
    assert with_collectives.program_id in controller.state.stale_programs
    assert plain.program_id not in controller.state.stale_programs   # it names no group: its plans still hold


def test_a_lost_transfer_abandons_both_islands_groups_and_lowers_their_programs_again_but_a_late_report_does_not():
    controller, outbox, lowered, out = _two_island_program()
    (action,) = [a.send for a in outbox.of("register_program")[0][1].register_program.actions
                 if a.WhichOneof("kind") == "send"]
    lost = pb.TransferLost(to_address=action.to_address, waited_s=4, nbytes=16)
    lost.shard.CopyFrom(pb.ShardRef(array_id=99, shard=0, tag=out.producer_call))
    controller.on_message("e0", pb.Envelope(transfer_lost=lost), [])
    assert out.state == "pending" and controller.members.heard_from("e1", 1)[1] == []  # not before the receiver answers
    ((to, failed),) = outbox.of("transfer")
    controller.on_message(to, pb.Envelope(transfer_lost=_missing(failed.transfer)), [])
    assert out.state == "failed" and out.error.remote_type == "TransferLost"
    # Both islands' executors abandon the groups made so far; the program is lowered again with new ones.
    abandoned = ["transfer:99.0:e0->e2<3"]
    assert controller.members.heard_from("e1", 1)[1] == controller.members.heard_from("e3", 1)[1] == abandoned
    assert controller.groups.by_members == {} and lowered.program_id in controller.state.stale_programs
    assert (controller.completion.transfers_lost, controller.completion.calls_failed_by_lost_transfers) == (1, 1)
    # Another copy of the same cut (e1's to e3), answered late, for the run that failed already: the groups formed
    # since stay.
    plans = {e: env.register_program for e, env in outbox.of("register_program")}
    (other,) = [a.send for a in plans["e1"].actions if a.WhichOneof("kind") == "send"]
    late = pb.TransferLost(to_address=other.to_address, waited_s=4, nbytes=16)
    late.shard.CopyFrom(pb.ShardRef(array_id=99, shard=1, tag=out.producer_call))
    controller.on_message("e1", pb.Envelope(transfer_lost=late), [])
    ((to, failed),) = outbox.of("transfer")[1:]
    assert to == "e3"
    controller.on_message(to, pb.Envelope(transfer_lost=_missing(failed.transfer)), [])
    assert controller.members.heard_from("e1", 1)[1] == ["transfer:99.0:e0->e2<3"]
    assert (controller.completion.transfers_lost, controller.completion.calls_failed_by_lost_transfers) == (2, 1)


def test_a_group_queued_before_a_fault_and_formed_after_it_is_abandoned_as_it_forms(monkeypatch):
    import executor.collectives as collectives

    runtime = CollectiveRuntime()
    monkeypatch.setattr(runtime, "_rendezvous", lambda *args: None)
    monkeypatch.setattr(collectives, "gloo_group_on", lambda *args: object())
    monkeypatch.setattr(collectives, "form_host_group", lambda *args: None)
    runtime.abandon("transfer:7.0:a->b", "a link lost it", before_group=4)   # groups 1..3 were made before it
    runtime.form(3, rank=0, size=2, store_path="", timeout_s=1, members=("a@1", "b@1"))
    runtime.form(4, rank=0, size=2, store_path="", timeout_s=1, members=("a@1", "b@1"))
    assert sorted(runtime._groups) == [4] and runtime._abandoned_ids == {3}
    with pytest.raises(collectives.CollectiveAbandoned, match="made before a fault of its island"):
        with runtime.bind({"data": 3}):
            runtime.run("all_reduce", torch.ones(4), "data", op="sum")


def test_a_fault_during_recovery_recovers_again_but_a_replacement_that_never_registers_fails_at_once():
    from pathways_torch.training.recovery import MAX_ATTEMPTS, RecoveryFailed
    from pathways_torch.training.trainer import Trainer

    class Recovering(Trainer):
        def __init__(self, faults):
            self.recover, self.faults, self.errors = True, list(faults), []

        def _recover_once(self, error):
            self.errors.append(error)
            if self.faults:
                raise self.faults.pop(0)
            return True

    again = ExecutorLostError("executor-2 lost meanwhile")
    trainer = Recovering([again])
    assert trainer.recover_from(ExecutorLostError("executor-1 lost")) is True
    assert trainer.errors[1] is again                        # the second attempt recovers from the new fault
    never = RecoveryFailed("no replacement for executor-1 registered within 1 s", executor_id="executor-1")
    trainer = Recovering([never])
    with pytest.raises(RecoveryFailed):
        trainer.recover_from(ExecutorLostError("executor-1 lost"))
    assert len(trainer.errors) == 1 and isinstance(never, ExecutorLostError)   # not tried again
    trainer = Recovering([ExecutorLostError(f"lost {i}") for i in range(MAX_ATTEMPTS)])
    with pytest.raises(ExecutorLostError, match=f"lost {MAX_ATTEMPTS - 1}"):
        trainer.recover_from(ExecutorLostError("first"))
    assert len(trainer.errors) == MAX_ATTEMPTS


def test_pings_before_the_welcome_keep_alive_only_the_process_that_registered(setup):
    """A start-up of a thousand executors can take longer than the heartbeat bound to deliver every Welcome: the
    registered process's pings (epoch 0) count meanwhile; another process's do not (it must not keep a dead
    incarnation alive)."""
    controller, _, _ = setup
    info = controller.resources.executors["e0"]
    info.last_heard -= 100.0
    assert controller.members.heard_from("e0", 0) == ("unknown", [], 0)       # who sent it is not known
    assert controller.members.heard_from("e0", 0, awaiting_welcome=True)[0] == "live"
    assert controller.clock() - info.last_heard < 5.0
    controller.members.declare_lost("e0", "killed")
    assert controller.members.heard_from("e0", 0, awaiting_welcome=True)[0] == "lost"


def test_an_incarnation_never_pinged_gets_the_loss_bound_one_that_pinged_the_timeout(setup):
    """Its heartbeat connection may still be connecting (a thousand executors starting at once): lost after twice
    the timeout, not once; after its first ping, the timeout."""
    controller, _, _ = setup
    assert controller.members.heard_from("e1", 1)[0] == "live"
    controller.clock.now += 6.0                       # past the timeout (5 s), within the loss bound (10 s)
    controller.members.heartbeat()
    lost = {e for e, info in controller.resources.executors.items() if info.lost}
    assert lost == {"e1"}
    controller.clock.now += 4.5
    controller.members.heartbeat()
    lost = {e for e, info in controller.resources.executors.items() if info.lost}
    assert lost == {"e0", "e1", "e2"}
