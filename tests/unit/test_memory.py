"""The controller's memory budget (--executor-memory-bytes): `MemoryBudget` alone, then in a `Controller` with a
fake outbox (no sockets, no processes). The waits are real but short: each test waits on a condition it can see
(`MemoryBudget.waiting`), never on a guessed sleep."""

from __future__ import annotations

import time

import pytest

from controller import CallSpec, Controller, ControllerConfig
from controller.memory import MemoryBudget, demand_of
from controller.program import ProgramSpec
from controller.resources import MeshAllocation
from pathways_torch.errors import ContextClosedError, OutOfMemoryError
from pathways_torch.wire import pb
from tests.threads import InThread, until
from pathways_torch.wire.seam import AllocateMesh, Call, RegisterFunction

pytestmark = pytest.mark.timeout(30)


def _until(condition, timeout_s: float = 5.0) -> None:
    until(condition, timeout_s)


# ---------------------------------------------------------------- MemoryBudget alone

def test_a_request_that_fits_takes_its_bytes_at_once():
    budget = MemoryBudget(1000)
    reservation = budget.reserve("alice", {"e0": 600, "e1": 600}, timeout_s=0.0)
    assert reservation.demand == {"e0": 600, "e1": 600}
    assert budget.held == {"e0": 600, "e1": 600} and budget.waits == 0
    assert budget.snapshot()["e0"] == {"held": 600, "clients": {"alice": 600}}


def test_a_request_waits_until_another_release_makes_room_then_proceeds():
    budget = MemoryBudget(1000)
    budget.reserve("alice", {"e0": 800}, timeout_s=0.0)
    waiter = InThread(lambda: budget.reserve("bob", {"e0": 300, "e1": 300}, timeout_s=10.0))
    _until(lambda: budget.waiting == 1)
    assert budget.held["e0"] == 800 and budget.held.get("e1", 0) == 0   # nothing taken while it waits
    budget.release("alice", {"e0": 500})
    reservation = waiter.result()
    assert reservation.client == "bob"
    assert budget.held == {"e0": 600, "e1": 300}
    assert budget.snapshot()["e0"]["clients"] == {"alice": 300, "bob": 300}
    assert budget.waits == 1 and budget.waiting == 0


def test_a_release_too_small_keeps_the_waiter_waiting():
    budget = MemoryBudget(1000)
    budget.reserve("alice", {"e0": 900}, timeout_s=0.0)
    waiter = InThread(lambda: budget.reserve("bob", {"e0": 400}, timeout_s=10.0))
    _until(lambda: budget.waiting == 1)
    budget.release("alice", {"e0": 200})       # 700 + 400 > 1000: still no room
    time.sleep(0.05)
    assert waiter.thread.is_alive()
    budget.release("alice", {"e0": 100})       # 600 + 400 fits
    waiter.result()
    assert budget.held["e0"] == 1000


def test_a_wait_past_its_timeout_fails_naming_the_client_the_executor_the_bytes_and_the_limit():
    budget = MemoryBudget(1000)
    budget.reserve("alice", {"e0": 100, "e1": 900}, timeout_s=0.0)
    start = time.monotonic()
    with pytest.raises(OutOfMemoryError) as caught:
        budget.reserve("alice", {"e0": 200, "e1": 200}, timeout_s=0.1, what="call 'grow'")
    assert time.monotonic() - start >= 0.1
    error = caught.value
    assert (error.client, error.executor_id, error.requested_bytes, error.held_bytes, error.limit_bytes) == \
        ("alice", "e1", 200, 900, 1000)
    text = str(error)
    for part in ("'alice'", "call 'grow'", "200 bytes", "executor e1", "1000 bytes", "900 bytes",
                 "--executor-memory-bytes", "free arrays"):
        assert part in text, (part, text)
    assert budget.held == {"e0": 100, "e1": 900}   # a failed request takes nothing
    assert budget.refused == 1


def test_a_request_over_the_limit_by_itself_fails_at_once():
    budget = MemoryBudget(1000)
    start = time.monotonic()
    with pytest.raises(OutOfMemoryError) as caught:
        budget.reserve("bob", {"e0": 10, "e1": 1001}, timeout_s=30.0)
    assert time.monotonic() - start < 1.0
    assert (caught.value.client, caught.value.executor_id, caught.value.requested_bytes) == ("bob", "e1", 1001)
    assert "never fits" in str(caught.value)
    assert not budget.held and budget.waits == 0


def test_release_is_exact_and_cancel_gives_back_once():
    budget = MemoryBudget(1000)
    a = budget.reserve("alice", demand_of(("e0", "e1", "e0"), 100), timeout_s=0.0)
    assert a.demand == {"e0": 200, "e1": 100}
    b = budget.reserve("bob", {"e0": 50}, timeout_s=0.0)
    budget.cancel(a)
    budget.cancel(a)          # twice: given back once
    assert budget.held == {"e0": 50}
    b.claimed = True          # claimed by its records: they give it back themselves
    budget.cancel(b)
    assert budget.held == {"e0": 50}
    budget.release("bob", {"e0": 50})
    assert not budget.held and not budget.by_client and budget.snapshot() == {}


def test_no_limit_counts_nothing():
    budget = MemoryBudget(0)
    assert budget.reserve("alice", {"e0": 1 << 40}, timeout_s=0.0) is None
    assert not budget.held


def test_closing_ends_every_wait():
    budget = MemoryBudget(100)
    budget.reserve("alice", {"e0": 100}, timeout_s=0.0)
    waiter = InThread(lambda: budget.reserve("bob", {"e0": 1}, timeout_s=10.0))
    _until(lambda: budget.waiting == 1)
    budget.close("the context closed")
    with pytest.raises(ContextClosedError, match="the context closed"):
        waiter.result()


# ---------------------------------------------------------------- in the controller

class _Outbox:
    def __init__(self):
        self.sent: list[tuple[str, pb.Envelope]] = []

    def to_executor(self, executor_id, envelope, payload=()):
        self.sent.append((executor_id, envelope))

    def runs(self) -> list[tuple[str, pb.Run]]:
        return [(e, env.run) for e, env in self.sent if env.WhichOneof("body") == "run"]


def _controller(limit: int, wait_s: float):
    outbox = _Outbox()
    controller = Controller(outbox, ControllerConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0,
                                                     executor_memory_bytes=limit, memory_wait_s=wait_s))
    for i in range(2):
        register = pb.Register(executor_id=f"e{i}", data_address=f"tcp://127.0.0.1:{7000 + i}", device="cpu",
                               backend="eager", pid=1000 + i)
        controller.on_message(f"e{i}", pb.Envelope(register=register), [])
    mesh = controller.resources.allocate({"data": 2}, ["e0", "e1"])
    function_id = controller.call_dispatch.register_function("grow", pb.Graph(), [])
    return controller, outbox, mesh, function_id


def _spec(function_id, mesh, *shard_bytes, inputs=()):
    return CallSpec(function_id=function_id, name="grow", mesh=mesh, inputs=tuple(inputs),
                    num_outputs=len(shard_bytes), output_shard_bytes=tuple(shard_bytes))


def test_a_call_past_the_limit_waits_until_an_array_is_released():
    controller, outbox, mesh, function_id = _controller(1000, wait_s=10.0)
    x = controller.lifetimes.new_array(mesh.executor_ids, landing=2, owner="alice", shard_bytes=400)
    for _ in range(2):
        controller.lifetimes.landed(x.array_id)
    [y] = controller.call_dispatch.call(_spec(function_id, mesh, 500, inputs=(x.array_id,)), "alice")
    assert controller.memory.held == {"e0": 900, "e1": 900} and y.held_bytes == 500
    waiter = InThread(lambda: controller.call_dispatch.call(_spec(function_id, mesh, 200, 100), "alice"))
    _until(lambda: controller.memory.waiting == 1)
    assert len(outbox.runs()) == 2                 # only the first call's runs: the second waits, unsequenced
    controller.lifetimes.release(x.array_id)       # its 400 per executor are free again
    z, w = waiter.result()
    assert len(outbox.runs()) == 4
    assert controller.memory.held == {"e0": 800, "e1": 800}
    assert (z.held_bytes, w.held_bytes) == (200, 100)
    for record in (y, z, w):
        controller.lifetimes.release(record.array_id)
    assert not controller.memory.held              # every byte given back, exactly once


def test_a_call_that_never_gets_room_fails_after_the_wait_while_another_owner_goes_on():
    controller, outbox, mesh, function_id = _controller(1000, wait_s=0.3)
    [big] = controller.call_dispatch.call(_spec(function_id, mesh, 900), "alice")
    waiter = InThread(lambda: controller.call_dispatch.call(_spec(function_id, mesh, 200), "alice"))
    _until(lambda: controller.memory.waiting == 1)
    [small] = controller.call_dispatch.call(_spec(function_id, mesh, 50), "bob")   # fits: goes on while alice waits
    assert [e for e, _ in outbox.runs()] == ["e0", "e1", "e0", "e1"]
    with pytest.raises(OutOfMemoryError) as caught:
        waiter.result()
    error = caught.value
    assert (error.client, error.executor_id, error.requested_bytes, error.held_bytes, error.limit_bytes) == \
        ("alice", "e0", 200, 950, 1000)
    assert "'grow'" in str(error)
    assert len(outbox.runs()) == 4                 # the failed call was never sent
    assert controller.call_dispatch.calls_in_flight == 2
    assert controller.memory.snapshot()["e0"]["clients"] == {"alice": 900, "bob": 50}
    controller.lifetimes.release(big.array_id)
    [later] = controller.call_dispatch.call(_spec(function_id, mesh, 200), "alice")   # room now: at once
    assert later.state == "pending" and controller.memory.held["e0"] == 250


def test_a_put_past_the_limit_fails_at_once_and_a_failed_put_leaves_nothing_held():
    controller, _, mesh, _ = _controller(1000, wait_s=0.1)
    with pytest.raises(OutOfMemoryError) as caught:
        controller.lifetimes.new_array(mesh.executor_ids, landing=2, owner="carol", shard_bytes=1500)
    assert (caught.value.client, caught.value.requested_bytes, caught.value.limit_bytes) == ("carol", 1500, 1000)
    assert not controller.memory.held and len(controller.arrays) == 0
    controller.members.declare_lost("e1", "killed")
    with pytest.raises(Exception, match="e1"):
        controller.lifetimes.new_array(mesh.executor_ids, landing=2, owner="carol", shard_bytes=100)
    assert not controller.memory.held                # reserved, then the put failed: handed back


def test_a_put_released_while_landing_is_given_back_once_it_lands():
    controller, _, mesh, _ = _controller(1000, wait_s=0.1)
    x = controller.lifetimes.new_array(mesh.executor_ids, landing=2, owner="carol", shard_bytes=300)
    controller.lifetimes.release(x.array_id)
    assert controller.memory.held == {"e0": 300, "e1": 300}   # its shards are still on their way
    controller.lifetimes.landed(x.array_id)
    controller.lifetimes.landed(x.array_id)
    assert not controller.memory.held


def test_a_program_run_counts_its_outputs_not_its_intermediates():
    controller, outbox, mesh, function_id = _controller(1000, wait_s=0.2)
    x = controller.lifetimes.new_array(mesh.executor_ids, owner="alice")
    spec = ProgramSpec(name="two", input_values=(0,), input_meshes=(mesh,), output_values=(2,), nodes=(
        CallSpec(name="a", function_id=function_id, mesh=mesh, inputs=(0,), outputs=(1,), output_shard_bytes=(700,)),
        CallSpec(name="b", function_id=function_id, mesh=mesh, inputs=(1,), outputs=(2,), output_shard_bytes=(600,))))
    lowered = controller.call_dispatch.register_program(spec)
    [out] = controller.call_dispatch.run_program(lowered.program_id, [x.array_id], "alice")
    assert controller.memory.held == {"e0": 600, "e1": 600} and out.held_bytes == 600
    with pytest.raises(OutOfMemoryError) as caught:
        controller.call_dispatch.run_program(lowered.program_id, [x.array_id], "alice")
    assert "program 'two'" in str(caught.value) and caught.value.requested_bytes == 600
    controller.lifetimes.release(out.array_id)
    assert not controller.memory.held


def test_without_a_limit_nothing_is_counted_or_waited_for():
    controller, outbox, mesh, function_id = _controller(0, wait_s=0.0)
    x = controller.lifetimes.new_array(mesh.executor_ids, owner="alice", shard_bytes=1 << 40)
    [y] = controller.call_dispatch.call(_spec(function_id, mesh, 1 << 40, inputs=(x.array_id,)), "alice")
    assert (x.held_bytes, y.held_bytes) == (0, 0) and not controller.memory.held


def test_the_error_crosses_the_seam_with_what_it_names():
    from pathways_torch.wire import seam_codec

    budget = MemoryBudget(1000)
    budget.reserve("alice", {"e0": 900}, timeout_s=0.0)
    with pytest.raises(OutOfMemoryError) as caught:
        budget.reserve("alice", {"e0": 200}, timeout_s=0.0)
    error = seam_codec.decode(seam_codec.encode({"err": caught.value}))["err"]
    assert type(error) is OutOfMemoryError and str(error) == str(caught.value)
    assert (error.client, error.executor_id, error.requested_bytes, error.held_bytes, error.limit_bytes) == \
        ("alice", "e0", 200, 900, 1000)
    mesh = MeshAllocation(1, (("data", 1),), ("e0",))
    spec = seam_codec.decode(seam_codec.encode({"s": _spec(1, mesh, 64, 32)}))["s"]
    assert spec.output_shard_bytes == (64, 32)


# ---------------------------------------------------------------- held to where it lands (issue 46, point 4)

def test_under_a_limit_each_run_carries_the_bytes_counted_per_output_shard():
    controller, outbox, mesh, function_id = _controller(1000, wait_s=0.2)
    spec = CallSpec(function_id=function_id, name="grow", mesh=mesh, inputs=(), num_outputs=3,
                    output_shard_bytes=(100, -5))     # a bogus size and a missing one: both count 0, and store 0
    controller.call_dispatch.call(spec, "alice")
    assert [list(run.output_budget_bytes) for _, run in outbox.runs()] == [[100, 0, 0], [100, 0, 0]]
    x = controller.lifetimes.new_array(mesh.executor_ids, owner="alice")
    program = ProgramSpec(name="two", input_values=(0,), input_meshes=(mesh,), output_values=(1, 2), nodes=(
        CallSpec(name="a", function_id=function_id, mesh=mesh, inputs=(0,), outputs=(1,), output_shard_bytes=(70,)),
        CallSpec(name="b", function_id=function_id, mesh=mesh, inputs=(1,), outputs=(2,), output_shard_bytes=(60,))))
    lowered = controller.call_dispatch.register_program(program)
    controller.call_dispatch.run_program(lowered.program_id, [x.array_id], "alice")
    runs = [env.run_program for _, env in outbox.sent if env.WhichOneof("body") == "run_program"]
    assert runs and all(list(run.output_budget_bytes) == [70, 60] for run in runs)


def test_without_a_limit_runs_carry_no_budgets():
    controller, outbox, mesh, function_id = _controller(0, wait_s=0.0)
    controller.call_dispatch.call(_spec(function_id, mesh, 100), "alice")
    assert all(not run.output_budget_bytes for _, run in outbox.runs())


def test_a_wait_for_memory_ends_at_once_when_its_client_leaves():
    from controller.shares import ClientGone

    budget = MemoryBudget(1000)
    budget.reserve("alice", {"e0": 900}, timeout_s=0.0)
    waiter = InThread(lambda: budget.reserve("alice", {"e0": 200}, timeout_s=30.0, what="call 'f'"))
    bob = InThread(lambda: budget.reserve("bob", {"e0": 200}, timeout_s=30.0))
    _until(lambda: budget.waiting == 2)
    started = time.monotonic()
    budget.forget_client("alice")
    with pytest.raises(ClientGone, match="client 'alice' left while call 'f' waited for executor memory"):
        waiter.result(timeout_s=5.0)
    assert time.monotonic() - started < 5.0 and budget.waiting == 1   # bob's wait goes on: he did not leave
    budget.release("alice", {"e0": 900})
    assert bob.result().demand == {"e0": 200}
    assert budget.reserve("alice", {"e0": 200}, timeout_s=0.0) is not None   # alice again (reconnected): as ever


def test_a_client_that_leaves_ends_its_call_waiting_for_memory_through_its_ops():
    from controller.client_ops import ClientOps
    from controller.shares import ClientGone

    controller, outbox, _, _ = _controller(1000, wait_s=30.0)
    alice = ClientOps(controller, None, "alice")
    function_id, mesh = alice.handle(RegisterFunction("grow", pb.Graph(), [])), alice.handle(AllocateMesh({"data": 2}))
    alice.handle(Call(_spec(function_id, mesh, 900)))
    waiter = InThread(lambda: alice.handle(Call(_spec(function_id, mesh, 200))))
    _until(lambda: controller.memory.waiting == 1)
    started = time.monotonic()
    alice.stop_waiting()          # as ClientService disconnects it (then its worker stops, then what it held goes)
    alice.release_everything()
    with pytest.raises(ClientGone):
        waiter.result(timeout_s=5.0)
    assert time.monotonic() - started < 5.0                       # not the 30 s wait
    assert len(outbox.runs()) == 2 and not controller.memory.held   # never sent; every byte given back
