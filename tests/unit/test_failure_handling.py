"""Executor loss and hostile messages, in-process: the controller with a fake outbox, the executor core alone."""

from __future__ import annotations

import pytest

from controller import CallSpec, Controller, ControllerConfig
from pathways_torch.errors import ExecutorLostError
from pathways_torch.wire import pb
from pathways_torch.wire.tensors import tensor_to_frame
from tests.unit.test_controller import FakeClock, FakeOutbox
from tests.unit.test_executor_core import X, load, make_core, put, ref, run

pytestmark = pytest.mark.timeout(30)

KEYS = {f"e{i}": bytes([ord("a") + i]) * 40 for i in range(4)}


@pytest.fixture
def setup():
    outbox, clock = FakeOutbox(), FakeClock()
    controller = Controller(outbox, ControllerConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0), clock=clock)
    for executor_id, key in KEYS.items():
        register = pb.Register(executor_id=executor_id, data_address=f"tcp://127.0.0.1:{7000 + int(executor_id[1])}",
                               device="cpu", backend="eager", pid=1, public_key=key)
        controller.on_message(executor_id, pb.Envelope(register=register), [])
    return controller, outbox, clock, controller.call_dispatch.register_function("f", pb.Graph(), [])


def _call(controller, function_id, mesh, *inputs):
    [out] = controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=mesh,
                                                   inputs=tuple(r.array_id for r in inputs), num_outputs=1))
    return out


# ---------------------------------------------------------------- controller


def test_a_push_carries_the_receiver_key_and_registration_must_name_itself(setup):
    controller, outbox, _, function_id = setup
    a = controller.resources.allocate({"data": 1}, ["e0"])
    b = controller.resources.allocate({"data": 1}, ["e1"])
    _call(controller, function_id, b, controller.lifetimes.new_array(a.executor_ids))
    (_, send), = outbox.of("send_shard")
    assert send.send_shard.to_public_key == KEYS["e1"]
    dropped = controller.dropped_messages
    controller.on_message("e9", pb.Envelope(register=pb.Register(executor_id="e0", data_address="x")), [])
    assert "e9" not in controller.resources.executors and controller.dropped_messages == dropped + 1
    assert controller.resources.executors["e0"].data_address == "tcp://127.0.0.1:7000"


def test_an_array_passed_twice_is_pushed_once(setup):
    controller, outbox, _, function_id = setup
    a = controller.resources.allocate({"data": 1}, ["e0"])
    b = controller.resources.allocate({"data": 1}, ["e1"])
    y = controller.lifetimes.new_array(a.executor_ids)
    controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=b, inputs=(y.array_id, y.array_id),
                                           num_outputs=1))
    assert len(outbox.of("send_shard")) == 1
    (_, run), = outbox.of("run")
    assert run.run.inputs[0] == run.run.inputs[1]   # both read the one copy


def test_loss_fails_dependents_frees_waiting_consumers_and_spares_the_rest(setup):
    controller, outbox, _, function_id = setup
    on_e2, on_e0 = [controller.resources.allocate({"data": 1}, [e]) for e in ("e2", "e0")]
    pair = controller.resources.allocate({"data": 2}, ["e0", "e1"])
    ready_elsewhere = controller.lifetimes.new_array(pair.executor_ids)
    ready_on_victim = controller.lifetimes.new_array(on_e2.executor_ids)
    pending_on_victim = _call(controller, function_id, on_e2, ready_on_victim)
    consumer = _call(controller, function_id, on_e0, pending_on_victim)    # waits for a push from e2
    unrelated = _call(controller, function_id, pair, ready_elsewhere)
    lost = []
    controller.loss_listeners.append(lambda executor_id, error: lost.append((executor_id, error)))

    controller.members.declare_lost("e2", "its process was killed by SIGKILL")

    for record in (pending_on_victim, consumer, ready_on_victim):
        assert isinstance(record.error, ExecutorLostError) and record.error.executor_id == "e2"
        assert "SIGKILL" in str(record.error)
    assert ready_elsewhere.state == "ready" and unrelated.state == "pending"
    assert [e for e, _ in lost] == ["e2"]
    # e0 was told that the copy it waits for will never come, so its queue moves on.
    (executor_id, envelope), = outbox.of("transfer")
    assert executor_id == "e0" and envelope.transfer.failed
    assert envelope.transfer.failure.type == "ExecutorLostError" and envelope.transfer.failure.executor_id == "e2"
    assert envelope.transfer.shard.tag == outbox.of("run")[1][1].run.call_id
    # New work that needs e2 fails at once; work that does not, runs.
    with pytest.raises(ExecutorLostError, match="e2"):
        _call(controller, function_id, on_e2, controller.lifetimes.new_array(on_e0.executor_ids))
    with pytest.raises(ExecutorLostError, match="array .* has a shard on executor e2"):
        _call(controller, function_id, on_e0, ready_on_victim)
    with pytest.raises(ExecutorLostError, match="e2"):
        controller.lifetimes.new_array(on_e2.executor_ids, landing=1)
    assert _call(controller, function_id, on_e0, controller.lifetimes.new_array(on_e0.executor_ids)).state == "pending"


def test_heartbeats_decide_liveness_and_loss_is_declared_once(setup):
    controller, outbox, clock, _ = setup
    assert controller.members.heard_from("e1", 1) == ("live", [], 0)
    assert controller.members.heard_from("nobody")[0] == "unknown"
    clock.now += 4
    for executor_id in ("e0", "e2", "e3"):
        assert controller.members.heard_from(executor_id, 1)[0] == "live"
    clock.now += 2
    controller.members.heartbeat()
    assert controller.resources.executors["e1"].lost and controller.members.heard_from("e1", epoch=1)[0] == "lost"
    assert controller.members.heard_from("e1")[0] == "unknown"   # no epoch: not welcomed (a replacement on its way)
    # The survivors' answers name the lost incarnation: they abandon its process groups at once.
    assert controller.members.heard_from("e0", 1) == ("live", ["e1@1<1"], 1)   # no group made yet
    assert not any(controller.resources.executors[e].lost for e in ("e0", "e2", "e3"))
    assert outbox.of("heartbeat") == []     # executors ping; the controller only answers
    losses = []
    controller.loss_listeners.append(lambda *args: losses.append(args))
    controller.members.declare_lost("e1", "again")   # already lost: nothing happens twice
    controller.members.shutdown_executors("bye")
    controller.members.declare_lost("e0", "exited at shutdown")   # expected exits are no loss
    assert losses == [] and not controller.resources.executors["e0"].lost


def test_a_put_that_never_lands_fails_its_array(setup):
    controller, outbox, _, _ = setup
    mesh = controller.resources.allocate({"data": 2}, ["e0", "e1"])
    x = controller.lifetimes.new_array(mesh.executor_ids, landing=2)
    controller.lifetimes.landed(x.array_id)
    controller.lifetimes.landed(x.array_id, ExecutorLostError("e1 is gone", executor_id="e1"))
    assert x.state == "failed" and x.error.executor_id == "e1"
    controller.lifetimes.release(x.array_id)
    controller.lifetimes.flush_frees()
    assert len(controller.arrays) == 0 and len(outbox.of("free")) == 2


def test_done_for_an_unknown_call_and_messages_from_strangers_are_counted(setup):
    controller, outbox, _, _ = setup
    controller.on_message("e0", pb.Envelope(done=pb.Done(call_id=424242, ok=True)), [])
    controller.on_message("stranger", pb.Envelope(done=pb.Done(call_id=1, ok=True)), [])
    controller.on_message("e0", pb.Envelope(put=pb.Put()), [])
    assert controller.dropped_messages == 3


# ---------------------------------------------------------------- executor core


def _transfer(core, shard_ref, tensor=None, *, failed=False, channel="data"):
    msg = pb.Transfer(failed=failed)
    msg.shard.CopyFrom(shard_ref)
    frames = []
    if failed:
        msg.failure.CopyFrom(pb.RemoteFailure(type="ExecutorLostError", message="e9 lost", executor_id="e9"))
    else:
        frames = [bytes(memoryview(tensor_to_frame(tensor, msg.tensor, 1)))]
    if channel == "data":
        core.on_data(b"peer", pb.Envelope(transfer=msg), frames, role="e1")
    else:
        core.on_control(pb.Envelope(transfer=msg), frames)


def test_a_transfer_no_run_waits_for_is_refused_and_not_stored():
    core, outbox = make_core()
    load(core, 1, lambda x: x * 2, X)
    put(core, ref(1), X)
    run(core, seq=1, call_id=10, function_id=1, inputs=[ref(1)], outputs=[ref(2)])
    buffers = len(core.store)
    for late in (ref(1, tag=10), ref(7, tag=3), ref(8, tag=0)):   # its run is done / never wanted it / not a copy
        _transfer(core, late, X)
        _transfer(core, late, failed=True)
    assert len(core.store) == buffers and core.dropped_messages == 6


def test_a_copy_held_past_a_cut_and_delivered_after_its_loss_was_reported_is_refused():
    # Issue 47: a copy sent just before a cut could be delivered seconds later (seen once with compute-thread sends
    # over a relayed link). By then its sender reported it lost and the controller failed it here: the late copy
    # must neither replace that failure nor start the run with it, nor stay in the store.
    core, outbox = make_core()
    load(core, 1, lambda x: x * 2, X)
    copy = ref(5, tag=10)
    run(core, seq=1, call_id=10, function_id=1, inputs=[copy], outputs=[ref(6)])
    assert outbox.dones() == []                            # waits for the copy
    _transfer(core, copy, failed=True, channel="control")  # the controller's failed copy (the link lost it)
    [done] = outbox.dones()
    assert not done.ok
    buffers = len(core.store)
    _transfer(core, copy, X)                               # the held copy, late
    assert core.dropped_messages == 1 and len(core.store) == buffers and len(outbox.dones()) == 1


def test_a_transfer_ahead_of_its_run_is_kept_and_a_bogus_one_let_go():
    core, outbox = make_core()
    load(core, 1, lambda x: x * 2, X)
    _transfer(core, ref(1, tag=20), X)      # arrives before Run 20 (it came on another connection)
    _transfer(core, ref(5, tag=20), X)      # no Run will want this one
    assert len(core.store) == 2 and core.dropped_messages == 0
    run(core, seq=1, call_id=20, function_id=1, inputs=[ref(1, tag=20)], outputs=[ref(2)])
    assert outbox.dones()[0].ok
    assert len(core.store) == 1 and (2, 0, 0) in core.store   # both copies gone, the output stays


def test_the_controller_can_fail_a_copy_whose_sender_was_lost():
    core, outbox = make_core()
    load(core, 1, lambda x: x * 2, X)
    run(core, seq=1, call_id=30, function_id=1, inputs=[ref(1, tag=30)], outputs=[ref(2)])
    assert outbox.dones() == []
    _transfer(core, ref(1, tag=30), failed=True, channel="control")
    done, = outbox.dones()
    assert not done.ok and done.failure.type == "ExecutorLostError" and done.failure.executor_id == "e9"
    assert (1, 0, 30) not in core.store and core.dropped_messages == 0
    _transfer(core, ref(1, tag=30), failed=True, channel="control")   # late: dropped, not stored
    assert (1, 0, 30) not in core.store and core.dropped_messages == 1


def test_stats_report_drops_and_refused_connections():
    core, outbox = make_core()
    core.on_data(b"peer", pb.Envelope(done=pb.Done()), [], role="e1")
    core.counters["refused_connections"] = 4
    core.on_control(pb.Envelope(stats_request=pb.StatsRequest(request_id=1)), [])
    stats = outbox.controller[-1][0].stats
    assert stats.hop_bytes["dropped_messages"] == 1 and stats.hop_bytes["refused_connections"] == 4


def test_a_failure_reported_while_a_peer_is_dead_is_the_lost_executors_error():
    """A collective fails with "connection reset" on the survivor before any heartbeat: the
    launcher's liveness probe, asked first, turns it into ExecutorLostError naming the dead one."""
    patience = []

    def probe_of(controller):
        def probe(patience_s, then=None):
            patience.append(patience_s)
            controller.members.declare_lost("e1", "process exited (SIGKILL)")
            if then is not None:
                then()
        return probe

    controller, out = _two_member_collective(probe_of)
    assert isinstance(out.error, ExecutorLostError) and out.error.executor_id == "e1"
    assert not controller.state.calls
    # A peer's transport error gives the launcher a moment to see the exit (the killed process's sockets
    # close before it can be reaped); any other failure is reported at once.
    assert patience == [1.0]


def _two_member_collective(probe_of=None, deliver=lambda handle: handle()):
    """A collective on e0 and e1 (at 127.0.0.1 and 127.0.0.2) whose e0 reports "Connection closed by peer";
    ``probe_of(controller)``: the launcher's liveness probe, if there is a local launcher; ``deliver``: runs the
    handling of e0's Done (e.g. on an I/O loop)."""
    class Outbox:
        def to_executor(self, executor_id, envelope, payload=()):
            pass

    controller = Controller(Outbox(), ControllerConfig())
    for i in range(2):
        controller.on_message(f"e{i}", pb.Envelope(register=pb.Register(
            executor_id=f"e{i}", data_address=f"tcp://127.0.0.{i + 1}:7100", device="cpu", backend="eager")), [])
    function_id = controller.call_dispatch.register_function("step", pb.Graph(), [])
    mesh = controller.resources.allocate({"data": 2}, ["e0", "e1"])
    [out] = controller.call_dispatch.call(CallSpec(function_id=function_id, name="step", mesh=mesh, inputs=(),
                                                   num_outputs=1, collective_axes=("data",)))
    if probe_of is not None:
        controller.completion.liveness_probe = probe_of(controller)
    failure = pb.RemoteFailure(type="RuntimeError", message="gloo: Connection closed by peer", executor_id="e0")
    done = pb.Envelope(done=pb.Done(call_id=max(controller.state.calls), ok=False, failure=failure))
    deliver(lambda: controller.on_message("e0", done, []))
    return controller, out


@pytest.mark.parametrize("exits", [True, False])
def test_heartbeats_are_answered_while_the_launcher_is_asked_about_a_lost_peer(exits):
    """A survivor's "connection closed by peer" has the launcher looked at for up to 1 s (the killed process may
    not be reaped yet). The looking is on the I/O loop's timers, not a sleep under the controller's lock on its
    thread: a heartbeat sent meanwhile is answered while the probe still waits, at once."""
    import time

    from controller.exit_watch import watch_exits
    from pathways_torch.errors import RemoteError
    from pathways_torch.wire.loop import SocketLoop

    class Launcher:   # e1's exit shows 0.8 s after the failed Done, or never
        exits_at = time.monotonic() + 0.8 if exits else float("inf")

        def newly_exited(self):
            if time.monotonic() < self.exits_at:
                return []
            self.exits_at = float("inf")
            return [("e1", "process exited (SIGKILL)")]

    def probe_of(controller):
        controllers.append(controller)
        watch_exits(controller, loop, Launcher().newly_exited, interval_s=3600.0)
        return controller.completion.liveness_probe

    def heartbeat(sent):   # what the controller's server does with e0's heartbeat, on its I/O thread
        controller = controllers[0]
        pending = any(not call.failed for call in controller.state.calls.values())
        state, *_ = controller.members.heard_from("e0", controller.resources.executors["e0"].epoch)
        answers.append((time.monotonic() - sent, pending, state))

    def deliver(handle):   # the Done, then a heartbeat of e0 sent just after it, both on the I/O thread
        sent = time.monotonic()
        loop.call_soon(handle)
        loop.call_soon(lambda: heartbeat(sent))

    controllers, answers = [], []
    loop = SocketLoop("test-controller")
    loop.start()
    try:
        controller, out = _two_member_collective(probe_of, deliver)
        deadline = time.monotonic() + 10
        while (not answers or out.state == "pending") and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
    (waited_s, pending_then, answer), = answers
    assert answer == "live" and pending_then and waited_s < 0.5, answers
    if exits:   # the probe saw the exit: the failure is the lost executor's, named, and the call is over
        assert isinstance(out.error, ExecutorLostError) and out.error.executor_id == "e1"
        assert not controller.state.calls
    else:       # nothing exited within the patience: the survivor's own report (the call waits for e1's Done)
        assert isinstance(out.error, RemoteError) and "Connection closed by peer" in str(out.error)
        assert controller.state.calls[max(controller.state.calls)].waiting == {"e1"}


def test_without_a_local_launcher_a_peer_loss_waits_for_the_peer_to_be_lost_or_to_report():
    """Executors on other hosts (no process to reap): a survivor's "connection closed by peer" is held while the
    peer has not reported, so the failure is the peer's loss, named, once the heartbeat says so."""
    from pathways_torch.errors import RemoteError

    controller, out = _two_member_collective()
    assert out.state == "pending" and out.error is None
    controller.executor_labels["e1"] = "node 1 at 127.0.0.2"
    controller.members.declare_lost("e1", "silent for 10.2 s")
    assert isinstance(out.error, ExecutorLostError) and "executor e1 (node 1 at 127.0.0.2) lost" in str(out.error)

    controller, out = _two_member_collective()          # the peer is alive and reports: the held failure is it
    failure = pb.RemoteFailure(type="RuntimeError", message="gloo: timed out", executor_id="e1")
    controller.on_message("e1", pb.Envelope(done=pb.Done(call_id=max(controller.state.calls), ok=False,
                                                         failure=failure)), [])
    assert isinstance(out.error, RemoteError) and "Connection closed by peer" in str(out.error)


def test_an_ordinary_failure_asks_the_launcher_without_waiting():
    from controller import CallSpec, Controller, ControllerConfig
    from pathways_torch.errors import RemoteError
    from pathways_torch.wire import pb

    class Outbox:
        def to_executor(self, executor_id, envelope, payload=()):
            pass

    controller = Controller(Outbox(), ControllerConfig())
    controller.on_message("e0", pb.Envelope(register=pb.Register(
        executor_id="e0", data_address="tcp://127.0.0.1:7100", device="cpu", backend="eager")), [])
    function_id = controller.call_dispatch.register_function("step", pb.Graph(), [])
    mesh = controller.resources.allocate({"data": 1}, ["e0"])
    [out] = controller.call_dispatch.call(CallSpec(function_id=function_id, name="step", mesh=mesh, inputs=(),
                                                   num_outputs=1))
    patience = []
    controller.completion.liveness_probe = patience.append
    failure = pb.RemoteFailure(type="ValueError", message="shapes (2, 3) and (4, 5) do not match", executor_id="e0")
    controller.on_message("e0", pb.Envelope(done=pb.Done(call_id=max(controller.state.calls), ok=False,
                                                         failure=failure)), [])
    assert isinstance(out.error, RemoteError) and patience == [0.0]


def test_a_collective_with_no_group_bound_is_an_error_unless_a_dry_run_is_asked_for():
    """A missing binding used to return zeros silently (the warm-up's convenience): now only inside dry_runs()."""
    import torch

    from executor.collectives import CollectiveRuntime, dry_runs

    runtime = CollectiveRuntime()
    x = torch.ones(4, 2)
    with pytest.raises(RuntimeError, match="outside a bound computation"):
        runtime.run("all_reduce", x, "data", op="sum")
    with dry_runs():
        assert torch.equal(runtime.run("all_reduce", x, "data", op="sum"), torch.zeros(4, 2))
        assert runtime.run("all_gather", x, "data", size=3, dim=0).shape == (12, 2)
    with pytest.raises(RuntimeError, match="outside a bound computation"):   # the flag ends with the block
        runtime.run("reduce_scatter", x, "data", size=2, op="sum", dim=0)


def test_a_second_executor_under_a_live_ones_id_is_refused_naming_both_addresses():
    controller, _ = _two_member_collective()
    rival = pb.Register(executor_id="e1", data_address="tcp://127.0.0.9:7100")
    claim = controller.members.rival_claim("e1", rival)
    assert claim is not None and "tcp://127.0.0.9:7100 while e1 at tcp://127.0.0.2:7100 is alive" in claim
    assert "--node-rank" in claim
    assert controller.members.rival_claim("e1", pb.Register(executor_id="e1",
                                                            data_address="tcp://127.0.0.2:7100")) is None
    assert controller.members.rival_claim("e7", rival) is None
    controller.members.declare_lost("e1", "silent")
    assert controller.members.rival_claim("e1", rival) is None  # a replacement may take a lost one's place


@pytest.mark.timeout(10)
def test_a_failure_raised_again_keeps_no_frames_of_the_raises_before():
    # The controller keeps a failure for the run; were each raise's frames kept on it, their locals (arrays,
    # losses) would live as long as the run (the soak found one re-run loss kept per recovery).
    import gc
    import weakref

    from pathways_torch.dispatcher import explained

    class Held:
        pass

    error = RuntimeError("failed")

    def user_loop():
        held = Held()
        user_loop.held = weakref.ref(held)
        raise explained(error)

    with pytest.raises(RuntimeError):
        user_loop()
    explained(error)      # the next result() raising it
    gc.collect()
    assert user_loop.held() is None, "the first raise's frame (and its locals) is still held by the failure"
