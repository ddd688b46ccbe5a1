"""Finite costs and a share that cannot be gamed (issue 46, points 3 and 7): weights and simulated times out of
bounds are refused where they enter, with the bounds in the message; the scheduler stays live at the extremes it
allows and refuses a non-finite pass; a call waits for its turn at most the admission timeout, and the error names
the island and who is ahead; a call waiting for executor memory holds no admission slot. In-process fakes only."""

from __future__ import annotations

import time
import types

import pytest

import pathways_torch as pw
from controller import CallSpec, Controller, ControllerConfig
from controller.admin import Admin
from controller.admission import MAX_CHARGE_S, Admission
from controller.shares import NonFinitePassError, ShareScheduler
from pathways_torch.launch.controller_main import parse_weights
from pathways_torch.wire import pb
from tests.threads import InThread, until

pytestmark = pytest.mark.timeout(60)

BOUNDS = "expected a finite number in [1e-06, 1e+06]"
ABSURD = (float("nan"), float("inf"), -float("inf"), 1e308, 5e-324, -1, 0)


def _until(condition, timeout_s: float = 10.0) -> None:
    until(condition, timeout_s)


# ---------------------------------------------------------------- refused where they enter

@pytest.mark.parametrize("weight", ABSURD)
def test_an_absurd_weight_is_refused_by_the_cli_the_operator_and_the_scheduler_naming_the_bounds(weight):
    with pytest.raises(ValueError, match=r"--weights: alice=.*" + BOUNDS.replace("[", r"\[").replace("+", r"\+")):
        parse_weights(f"alice={weight!r}", ["alice"])
    operator = types.SimpleNamespace(clients=None, controller=None)   # the bound is checked before anything else
    with pytest.raises(ValueError) as refused:
        Admin.set_weight(operator, "alice", weight)
    assert "set weight alice=" in str(refused.value) and BOUNDS in str(refused.value)
    sched = ShareScheduler("0", slots=1)
    for enter in (lambda: sched.add_client("alice", weight), lambda: Admission().add_client("alice", weight)):
        with pytest.raises(ValueError) as refused:
            enter()
        assert "client 'alice': weight" in str(refused.value) and BOUNDS in str(refused.value)
    sched.add_client("alice", 1)
    with pytest.raises(ValueError, match="client 'alice': weight"):
        sched.set_weight("alice", weight)
    assert parse_weights("alice=1e-6,bob=1e6", ["alice", "bob"]) == {"alice": 1e-6, "bob": 1e6}   # the bounds: taken


@pytest.mark.parametrize("sim_time_s", [t for t in ABSURD if t != 0])
def test_an_absurd_simulated_time_is_refused_by_the_api_and_by_the_controller(sim_time_s):
    with pytest.raises(ValueError) as refused:
        pw.function(lambda x: x, name="evil", sim_time_s=sim_time_s)
    assert "evil: sim_time_s" in str(refused.value) and BOUNDS in str(refused.value)
    controller = Controller(_Outbox())
    with pytest.raises(ValueError) as refused:   # the seam's register_function ends here (a client skipping pw)
        controller.call_dispatch.register_function("evil", pb.Graph(), [], sim_seconds=sim_time_s)
    assert "function 'evil': sim_time_s" in str(refused.value) and BOUNDS in str(refused.value)
    assert "or 0 for none" in str(refused.value)
    assert controller.call_dispatch.refused_costs == 1


def test_a_simulated_time_of_0_means_none_and_the_bounds_are_taken():
    controller = Controller(_Outbox())
    for seconds in (0, 0.0, 1e-6, 1e6):
        assert pw.function(lambda x: x, sim_time_s=seconds).sim_time_s == seconds
        assert controller.call_dispatch.register_function("f", pb.Graph(), [], sim_seconds=seconds) > 0


# ---------------------------------------------------------------- the scheduler stays live

def test_the_scheduler_stays_live_at_the_extremes_it_allows():
    """Weight 1e-6 with the longest cost against weight 1e6 with the shortest: every call is admitted, every pass
    finite; the one far ahead is admitted as soon as the other is idle."""
    sched = ShareScheduler("0", slots=1)
    sched.add_client("slow", 1e-6)
    sched.add_client("fast", 1e6)
    for _ in range(200):
        for client, seconds in (("slow", MAX_CHARGE_S), ("fast", 1e-6)):
            sched.finished(sched.admit(client, seconds, timeout_s=1), seconds)
    running = sched.admit("fast", 1e-6, timeout_s=1)
    waiting = InThread(lambda: sched.admit("slow", MAX_CHARGE_S, timeout_s=5))
    _until(lambda: sched.waiting["slow"] == 1)
    sched.finished(running, 1e-6)
    sched.finished(waiting.result(), 1e9)
    passes = [float(line.split()[2]) for line in sched.describe().splitlines()[2:]]
    assert len(passes) == 2 and all(p == p and abs(p) < float("inf") for p in passes), sched.describe()


def test_a_charge_that_would_make_a_pass_infinite_is_refused_loudly_and_the_island_goes_on(caplog):
    sched = ShareScheduler("0", slots=1)
    sched.add_client("evil", 1e-6)
    sched.add_client("alice", 1)
    with pytest.raises(NonFinitePassError, match=r"island '0': charging client 'evil' .* would make its pass inf"):
        sched.admit("evil", 1e303)          # finite, but 1e303 / 1e-6 is not
    assert "would make its pass inf" in caplog.text
    assert sched.waiting == {"alice": 0, "evil": 0} and sched.in_flight == 0
    sched.finished(sched.admit("alice", 0.01, timeout_s=1), 0.01)
    sched.finished(sched.admit("evil", 0.01, timeout_s=1), 0.01)


def test_measured_device_time_out_of_bounds_is_clamped_and_counted():
    admission = Admission(window=1)
    admission.enable(timeout_s=5)
    admission.add_client("alice", 1e-6)
    for device_s in (float("nan"), float("inf"), -3.0, 2 ** 64 / 1e9 * 1000):   # a uint64 of ns on 1000 executors
        admitted = admission.admit("alice", ["0"], ("function", 1), 1e6 * 1e5)    # an estimate past the bound too
        admission.node_ended(admitted, device_s)
    assert admission.clamped_charges == 6   # the four measures, and the estimate until a measure (inf: 1e10) set it
    line = admission.describe().splitlines()[2].split()
    assert line[0] == "alice" and 0 < float(line[2]) < float("inf"), admission.describe()


# ---------------------------------------------------------------- admission never waits forever

def test_admission_times_out_naming_the_island_and_who_is_ahead():
    admission = Admission(window=2)
    admission.enable(timeout_s=10)
    for client in ("alice", "bob", "carol"):
        admission.add_client(client, 1)
    running = [admission.admit("alice", ["0"], ("function", 1), 0.01),
               admission.admit("bob", ["0"], ("function", 2), 5.0)]   # bob's pass is far ahead now
    carol = InThread(lambda: admission.admit("carol", ["0"], ("function", 3), 0.01))
    _until(lambda: admission.island("0").waiting["carol"] == 1)
    admission.enable(timeout_s=0.3)                      # bob's wait (carol's keeps its 10 s)
    started = time.monotonic()
    with pytest.raises(TimeoutError) as refused:
        admission.admit("bob", ["0"], ("function", 2), 5.0)
    assert 0.25 <= time.monotonic() - started < 5
    text = str(refused.value)
    assert "client 'bob' waited 0.3 s for 1 slot(s) on island '0' and was not admitted" in text, text
    assert ("3 call(s) ahead of it (2 of 2 slots in flight: {'alice': 1, 'bob': 1}; waiting to go first: "
            "{'carol': 1})") in text, text
    assert admission.island("0").waiting["bob"] == 0     # its place is given up
    for admitted in running:
        admission.node_ended(admitted, 0.01)
    admission.node_ended(carol.result(), 0.01)
    assert admission.island("0").in_flight == 0


def test_a_call_past_the_admission_timeout_fails_and_gives_back_what_it_took():
    controller, outbox, mesh, function_id = _controller(window=1, memory=1000, admission_timeout_s=0.3)
    [first] = controller.call_dispatch.call(_spec(function_id, mesh, 100), "alice")
    with pytest.raises(TimeoutError, match=r"client 'bob' .* island '0' .*\{'alice': 1\}"):
        controller.call_dispatch.call(_spec(function_id, mesh, 100), "bob")
    assert controller.memory.snapshot()["e0"]["clients"] == {"alice": 100}   # bob's reservation handed back
    assert len(outbox.runs()) == 2 and first.state == "pending"


# ---------------------------------------------------------------- a share that cannot be gamed

def test_a_call_waiting_for_memory_holds_no_admission_slot():
    """Window 2: alice's first call holds a slot; her second waits for memory. Bob's call is admitted meanwhile
    (with the old order, alice's waiting call held the second slot and bob waited for his turn until it timed out)."""
    controller, outbox, mesh, function_id = _controller(window=2, memory=1000, admission_timeout_s=3)
    [big] = controller.call_dispatch.call(_spec(function_id, mesh, 900), "alice")
    alice = InThread(lambda: controller.call_dispatch.call(_spec(function_id, mesh, 200), "alice"))
    _until(lambda: controller.memory.waiting == 1)
    island = controller.admission.island("0")
    assert island.in_flight == 1 and island.waiting == {"alice": 0, "bob": 0}
    [small] = InThread(lambda: controller.call_dispatch.call(_spec(function_id, mesh, 50), "bob")).result(timeout_s=2)
    assert island.in_flight == 2 and small.state == "pending"
    for executor_id, run in outbox.runs()[:2]:            # alice's first call ends: its slot comes free
        controller.on_message(executor_id, pb.Envelope(done=pb.Done(call_id=run.call_id, seq=run.seq, ok=True)), [])
    controller.lifetimes.release(big.array_id)            # and its memory
    [later] = alice.result()
    assert later.state == "pending" and island.in_flight == 2
    assert controller.memory.snapshot()["e0"]["clients"] == {"alice": 200, "bob": 50}


# ---------------------------------------------------------------- fakes

class _Outbox:
    def __init__(self):
        self.sent: list[tuple[str, pb.Envelope]] = []

    def to_executor(self, executor_id, envelope, payload=()):
        self.sent.append((executor_id, envelope))

    def runs(self) -> list[tuple[str, pb.Run]]:
        return [(e, env.run) for e, env in self.sent if env.WhichOneof("body") == "run"]


def _controller(*, window: int, memory: int, admission_timeout_s: float):
    outbox = _Outbox()
    controller = Controller(outbox, ControllerConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0,
                                                     executor_memory_bytes=memory, memory_wait_s=10.0,
                                                     share_window_calls=window))
    for i in range(2):
        register = pb.Register(executor_id=f"e{i}", data_address=f"tcp://127.0.0.1:{7000 + i}", device="cpu",
                               backend="eager", pid=1000 + i)
        controller.on_message(f"e{i}", pb.Envelope(register=register), [])
    controller.admission.enable(timeout_s=admission_timeout_s)   # as a controller serving clients
    for client in ("alice", "bob"):
        controller.admission.add_client(client, 1)
    mesh = controller.resources.allocate({"data": 2}, ["e0", "e1"])
    return controller, outbox, mesh, controller.call_dispatch.register_function("grow", pb.Graph(), [])


def _spec(function_id, mesh, *shard_bytes):
    return CallSpec(function_id=function_id, name="grow", mesh=mesh, inputs=(), num_outputs=len(shard_bytes),
                    output_shard_bytes=tuple(shard_bytes))
