"""The controller's logic with a fake outbox and a fake clock: no sockets, no processes."""

from __future__ import annotations

import pytest

from controller import CallSpec, Controller, ControllerConfig
from pathways_torch.errors import ExecutorLostError, RemoteError
from pathways_torch.wire import pb

pytestmark = pytest.mark.timeout(30)


class FakeOutbox:
    def __init__(self):
        self.sent: list[tuple[str, str, pb.Envelope]] = []

    def to_executor(self, executor_id, envelope, payload=()):
        self.sent.append((executor_id, envelope.WhichOneof("body"), envelope))

    def of(self, kind):
        return [(e, env) for e, k, env in self.sent if k == kind]


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def setup():
    outbox, clock = FakeOutbox(), FakeClock()
    controller = Controller(outbox, ControllerConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0), clock=clock)
    for i in range(4):
        register = pb.Register(executor_id=f"e{i}", data_address=f"tcp://127.0.0.1:{7000 + i}", device="cpu",
                               backend="eager", pid=1000 + i)
        controller.on_message(f"e{i}", pb.Envelope(register=register), [])
    function_id = controller.call_dispatch.register_function("f", pb.Graph(), [])
    return controller, outbox, clock, function_id


def _done(controller, executor_id, call_id, ok=True, failure=None):
    done = pb.Done(call_id=call_id, ok=ok)
    if failure is not None:
        done.failure.CopyFrom(failure)
    controller.on_message(executor_id, pb.Envelope(done=done), [])


def test_registration_welcomes_each_executor_with_its_index(setup):
    controller, outbox, _, _ = setup
    welcomes = outbox.of("welcome")
    assert [(e, env.welcome.index) for e, env in welcomes] == [("e0", 0), ("e1", 1), ("e2", 2), ("e3", 3)]


def test_a_call_reaches_every_executor_of_its_mesh_with_one_sequence_number(setup):
    controller, outbox, _, function_id = setup
    mesh = controller.resources.allocate({"data": 2}, ["e1", "e2"])
    x = controller.lifetimes.new_array(mesh.executor_ids)
    [y] = controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=mesh, inputs=(x.array_id,),
                                                 num_outputs=1))
    runs = outbox.of("run")
    assert [e for e, _ in runs] == ["e1", "e2"]
    assert len({env.run.seq for _, env in runs}) == 1
    assert [env.run.inputs[0].shard for _, env in runs] == [0, 1]
    assert len(outbox.of("load_function")) == 2
    assert not y.event.is_set()
    for executor_id in ("e1", "e2"):
        _done(controller, executor_id, runs[0][1].run.call_id)
    assert y.state == "ready"
    [z] = controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=mesh, inputs=(y.array_id,),
                                                 num_outputs=1))
    assert len(outbox.of("load_function")) == 2           # loaded once per executor
    assert outbox.of("run")[-1][1].run.seq > runs[0][1].run.seq


def test_input_on_another_mesh_is_pushed_executor_to_executor(setup):
    controller, outbox, _, function_id = setup
    mesh_a = controller.resources.allocate({"data": 2}, ["e0", "e1"])
    mesh_b = controller.resources.allocate({"data": 2}, ["e2", "e3"])
    y = controller.lifetimes.new_array(mesh_a.executor_ids)
    controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=mesh_b, inputs=(y.array_id,),
                                           num_outputs=1))
    sends = outbox.of("send_shard")
    assert [(e, env.send_shard.to_address) for e, env in sends] == [
        ("e0", "tcp://127.0.0.1:7002"), ("e1", "tcp://127.0.0.1:7003")]
    call_id = outbox.of("run")[-1][1].run.call_id
    assert all(env.send_shard.as_ref.tag == call_id for _, env in sends)
    assert [env.run.inputs[0].tag for _, env in outbox.of("run")] == [call_id, call_id]


def test_failure_reaches_dependents_as_the_same_error_object(setup):
    controller, outbox, _, function_id = setup
    mesh = controller.resources.allocate({"data": 2}, ["e0", "e1"])
    x = controller.lifetimes.new_array(mesh.executor_ids)
    spec = dict(function_id=function_id, name="f", mesh=mesh, num_outputs=1, call_site="  File 'user.py', line 3\n")
    [y] = controller.call_dispatch.call(CallSpec(inputs=(x.array_id,), **spec))
    [z] = controller.call_dispatch.call(CallSpec(inputs=(y.array_id,), **spec))
    first, second = [env.run.call_id for _, env in outbox.of("run")][::2]
    failure = pb.RemoteFailure(type="IndexError", message="index 99 is out of bounds", traceback="Traceback...",
                               executor_id="e1", origin_call_id=first)
    _done(controller, "e1", first, ok=False, failure=failure)
    assert isinstance(y.error, RemoteError) and "user.py" in str(y.error) and "index 99" in str(y.error)
    _done(controller, "e1", second, ok=False, failure=failure)
    assert z.error is y.error


def test_release_frees_shards_only_after_put_landed(setup):
    controller, outbox, _, _ = setup
    mesh = controller.resources.allocate({"data": 2}, ["e0", "e1"])
    x = controller.lifetimes.new_array(mesh.executor_ids, landing=2)
    controller.lifetimes.release(x.array_id)
    assert outbox.of("free") == []
    controller.lifetimes.landed(x.array_id)
    controller.lifetimes.landed(x.array_id)
    assert len(controller.arrays) == 0
    assert outbox.of("free") == []                # waiting for a message to ride on
    controller.lifetimes.flush_frees()            # the client idles
    frees = outbox.of("free")
    assert [(e, env.free.shards[0].shard) for e, env in frees] == [("e0", 0), ("e1", 1)]


def test_frees_ride_on_the_next_message_to_their_executor(setup):
    controller, outbox, _, function_id = setup
    mesh = controller.resources.allocate({"data": 2}, ["e0", "e1"])
    x, y = controller.lifetimes.new_array(mesh.executor_ids), controller.lifetimes.new_array(mesh.executor_ids)
    controller.lifetimes.release(x.array_id)
    controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=mesh, inputs=(y.array_id,),
                                           num_outputs=1))
    assert outbox.of("free") == []
    carried = [(e, k, [(s.array_id, s.shard) for s in env.frees]) for e, k, env in outbox.sent if env.frees]
    # the first message to each executor after the release: its LoadFunction, then its Run
    assert carried == [("e0", "load_function", [(x.array_id, 0)]), ("e1", "load_function", [(x.array_id, 1)])]
    controller.lifetimes.flush_frees()
    assert outbox.of("free") == []                # nothing left to send


def test_silent_executor_is_lost_and_its_futures_fail(setup):
    controller, outbox, clock, function_id = setup
    mesh = controller.resources.allocate({"data": 2}, ["e0", "e1"])
    x = controller.lifetimes.new_array(mesh.executor_ids)
    [y] = controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=mesh, inputs=(x.array_id,),
                                                 num_outputs=1))
    for executor_id in ("e0", "e1", "e2", "e3"):   # each pinged once: from now on the timeout holds
        controller.members.heard_from(executor_id, 1)
    clock.now += 3
    for executor_id in ("e0", "e2", "e3"):
        controller.on_message(executor_id, pb.Envelope(heartbeat=pb.Heartbeat()), [])
    clock.now += 3      # e1 silent for 6 s > 5 s timeout
    controller.members.heartbeat()
    assert isinstance(y.error, ExecutorLostError) and y.error.executor_id == "e1"
    with pytest.raises(ExecutorLostError, match="e1"):
        controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=mesh, inputs=(x.array_id,),
                                               num_outputs=1))


def test_dependent_failure_arriving_first_still_carries_the_origin_error(setup):
    controller, outbox, _, function_id = setup
    mesh = controller.resources.allocate({"data": 2}, ["e0", "e1"])
    x = controller.lifetimes.new_array(mesh.executor_ids)
    spec = dict(function_id=function_id, mesh=mesh, num_outputs=1)
    [y] = controller.call_dispatch.call(CallSpec(name="origin", inputs=(x.array_id,), call_site="  origin line\n",
                                                 **spec))
    [z] = controller.call_dispatch.call(CallSpec(name="dependent", inputs=(y.array_id,),
                                                 call_site="  dependent line\n", **spec))
    first, second = [env.run.call_id for _, env in outbox.of("run")][::2]
    failure = pb.RemoteFailure(type="IndexError", message="boom", executor_id="e0", origin_call_id=first)
    _done(controller, "e0", second, ok=False, failure=failure)   # the dependent reports first
    assert z.error is y.error
    assert y.error.function == "origin" and "origin line" in y.error.call_site
    _done(controller, "e0", first, ok=False, failure=failure)
    assert z.error is y.error


def test_release_many_sends_one_free_per_executor_after_the_run_that_reads_them(setup):
    controller, outbox, _, function_id = setup
    mesh = controller.resources.allocate({"data": 2}, ["e0", "e1"])
    inputs = [controller.lifetimes.new_array(mesh.executor_ids) for _ in range(3)]
    controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=mesh,
                                           inputs=tuple(a.array_id for a in inputs), num_outputs=1))
    controller.lifetimes.release_many([a.array_id for a in inputs])
    kinds = [(e, k) for e, k, _ in outbox.sent if k in ("run", "free")]
    assert kinds == [("e0", "run"), ("e1", "run"), ("e0", "free"), ("e1", "free")]
    for executor_id, envelope in outbox.of("free"):
        position = mesh.executor_ids.index(executor_id)
        assert [(s.array_id, s.shard) for s in envelope.free.shards] == [(a.array_id, position) for a in inputs]
    controller.lifetimes.release(inputs[0].array_id)       # a second release of the same array: nothing more
    assert len(outbox.of("free")) == 2


def test_a_calls_push_requests_reach_every_executor_before_any_of_its_runs(setup):
    """An executor may start a run the moment it reads it (a collective then blocks on its compute
    thread): the pushes a call's inputs need must be asked for before any of the call's runs."""
    controller, outbox, _, function_id = setup
    y = controller.lifetimes.new_array(("e0", "e1"))
    swapped = controller.resources.allocate({"data": 2}, ["e1", "e0"])   # each shard is needed by the other
    controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=swapped, inputs=(y.array_id,),
                                           num_outputs=1, collective_axes=("data",)))
    order = "\n".join(f"{e} {kind}" for e, kind, _ in outbox.sent if kind in ("send_shard", "run"))
    assert order == "e0 send_shard\ne1 send_shard\ne1 run\ne0 run"


def test_an_executor_that_does_not_hold_a_program_is_lost_and_its_calls_fail(setup):
    """Its Done for the run says it does not hold the program: no call of the run can end there, so what
    needs the executor fails now (the other executors' work is not touched)."""
    controller, outbox, _, function_id = setup
    both = controller.resources.allocate({"data": 2}, ["e0", "e1"])
    other = controller.resources.allocate({"data": 1}, ["e2"])
    [pending] = controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=both, inputs=(),
                                                       num_outputs=1))
    [elsewhere] = controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=other, inputs=(),
                                                         num_outputs=1))
    failure = pb.RemoteFailure(type="ProgramRunRefused", executor_id="e1", message="does not hold program 3")
    _done(controller, "e1", 999, ok=False, failure=failure)
    assert controller.resources.executors["e1"].lost
    assert isinstance(pending.error, ExecutorLostError) and "does not hold program 3" in str(pending.error)
    assert elsewhere.state == "pending"


def test_a_forgotten_program_leaves_its_executors_only_when_its_run_in_flight_ends(setup):
    from bench.scale import chain_on_controller

    controller, outbox, _, function_id = setup
    lowered, x = chain_on_controller(controller, 2, ["e0", "e1"], function_id)
    controller.call_dispatch.run_program(lowered.program_id, [x.array_id])
    controller.call_dispatch.forget((), [lowered.program_id])
    assert outbox.of("forget") == []                      # its run is in flight: a report may still name its plan
    for call_id in sorted(controller.state.calls):
        for executor_id in ("e0", "e1"):
            _done(controller, executor_id, call_id)
    assert [(e, list(env.forget.program_ids)) for e, env in outbox.of("forget")] == [("e0", [lowered.program_id]),
                                                                                   ("e1", [lowered.program_id])]
    assert lowered.program_id not in controller.state.programs


def test_a_forgotten_function_leaves_its_executors_only_when_no_call_or_program_run_in_flight_runs_it(setup):
    from bench.scale import chain_on_controller

    controller, outbox, _, function_id = setup
    mesh = controller.resources.allocate({"data": 2}, ["e0", "e1"])
    controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=mesh, inputs=(), num_outputs=1))
    lowered, x = chain_on_controller(controller, 2, ["e0", "e1"], function_id)
    controller.call_dispatch.run_program(lowered.program_id, [x.array_id])
    controller.call_dispatch.forget([function_id], [lowered.program_id])
    assert outbox.of("forget") == []                      # a run still to come on an executor would not find it
    first, *rest = sorted(controller.state.calls)
    for executor_id in ("e0", "e1"):
        _done(controller, executor_id, first)
    assert outbox.of("forget") == []                      # the program's runs still run it
    for call_id in rest:
        for executor_id in ("e0", "e1"):
            _done(controller, executor_id, call_id)
    functions_forgotten = sorted((e, f) for e, env in outbox.of("forget") for f in env.forget.function_ids)
    assert functions_forgotten == [("e0", function_id), ("e1", function_id)]
    assert function_id not in controller.state.functions
    assert not controller.call_dispatch.forgetting.functions_after_calls


def test_a_done_whose_handling_raises_still_ends_its_call(setup, monkeypatch):
    from pathways_torch.errors import PathwaysError

    controller, _, _, function_id = setup
    mesh = controller.resources.allocate({"data": 1}, ["e0"])
    [out] = controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=mesh, inputs=(),
                                                   num_outputs=1, call_site="  File 'train.py', line 3\n"))
    call_id = max(controller.state.calls)

    def broken(call):
        raise ZeroDivisionError("a bug while completing")

    monkeypatch.setattr(controller.completion, "_complete", broken)
    _done(controller, "e0", call_id)
    assert out.state == "failed" and isinstance(out.error, PathwaysError)
    assert "a bug while completing" in str(out.error) and "train.py" in str(out.error)
    assert call_id not in controller.state.calls


@pytest.mark.parametrize("executors, budget, asked", [(16, 512.0, 0.5), (1024, 512.0, 2.0), (100_000, 512.0, 2.5),
                                                      (1024, 0.0, 0.5)])
def test_the_heartbeat_interval_asked_for_keeps_all_executors_within_the_budget_and_a_quarter_of_the_timeout(
        executors, budget, asked):
    config = ControllerConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=10.0, max_heartbeats_per_s=budget)
    assert config.asked_heartbeat_interval_s(executors) == asked


def test_a_negative_heartbeat_budget_is_refused_with_what_was_expected():
    with pytest.raises(ValueError, match="max_heartbeats_per_s: expected heartbeats per second >= 0"):
        ControllerConfig(max_heartbeats_per_s=-1)
