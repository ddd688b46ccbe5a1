"""One client's operations over the controller (`controller/client_ops.py`), with a fake outbox: ids scoped to
their owner, output ids granted in blocks, a call that failed before dispatch, and what goes when a client goes."""

from __future__ import annotations

import pytest

from controller import CallSpec, Controller, ControllerConfig
from controller.client_ops import ClientOps, NotYoursError
from controller.shares import ClientGone
from pathways_torch.errors import ExecutorLostError
from pathways_torch.wire import pb
from pathways_torch.wire.seam import AllocateMesh, Call, GrantIds, Landed, NewArray, RegisterFunction, Release

pytestmark = pytest.mark.timeout(30)


class FakeOutbox:
    def __init__(self):
        self.sent: list[tuple[str, pb.Envelope]] = []

    def to_executor(self, executor_id, envelope, payload=()):
        self.sent.append((executor_id, envelope))

    def of(self, kind):
        return [(e, env) for e, env in self.sent if env.WhichOneof("body") == kind]


@pytest.fixture
def two_clients():
    outbox = FakeOutbox()
    controller = Controller(outbox)
    for i in range(2):
        controller.on_message(f"e{i}", pb.Envelope(register=pb.Register(
            executor_id=f"e{i}", data_address=f"tcp://127.0.0.1:{7000 + i}", backend="eager")), [])
    return controller, outbox, ClientOps(controller, None, "alice"), ClientOps(controller, None, "bob")


def _call(ops, function_id, mesh, inputs=(), **kwargs):
    return ops.handle(Call(CallSpec(function_id=function_id, name="f", mesh=mesh, inputs=tuple(inputs),
                                    num_outputs=1), **kwargs))


def test_a_client_names_only_what_it_was_handed(two_clients):
    controller, _, alice, bob = two_clients
    f = alice.handle(RegisterFunction("f", pb.Graph(), []))
    mesh = alice.handle(AllocateMesh({"data": 2}))
    [x] = alice.handle(NewArray(mesh.executor_ids, landing=0))
    [y] = _call(alice, f, mesh, [x.array_id])
    assert y.owner == "alice" and x.owner == "alice"
    g = bob.handle(RegisterFunction("f", pb.Graph(), []))
    bob_mesh = bob.handle(AllocateMesh({"data": 2}))
    refusals = [lambda: _call(bob, f, bob_mesh), lambda: _call(bob, g, mesh),
                lambda: _call(bob, g, bob_mesh, [y.array_id]), lambda: bob.handle(Landed(x.array_id))]
    for refused in refusals:
        with pytest.raises(NotYoursError, match="not one this client"):
            refused()
    bob.handle(Release(y.array_id))                       # another's id: nothing happens (a finalizer must not raise)
    assert controller.arrays.get(y.array_id) is not None and not controller.arrays.get(y.array_id).released
    # never made and another's read alike: the answer does not tell them apart
    with pytest.raises(NotYoursError) as stranger:
        _call(bob, g, bob_mesh, [y.array_id])
    with pytest.raises(NotYoursError) as nothing:
        _call(bob, g, bob_mesh, [10**9])
    assert str(stranger.value).replace(str(y.array_id), "N") == str(nothing.value).replace(str(10**9), "N")


def test_output_ids_come_from_the_clients_grants_in_order(two_clients):
    _, _, alice, bob = two_clients
    f = alice.handle(RegisterFunction("f", pb.Graph(), []))
    mesh = alice.handle(AllocateMesh({"data": 2}))
    first, count = alice.handle(GrantIds(3))
    bob_first, _ = bob.handle(GrantIds(3))
    assert bob_first >= first + count            # grants never overlap
    [out] = _call(alice, f, mesh, output_ids=[first])
    assert out.array_id == first and out.owner == "alice"
    with pytest.raises(NotYoursError, match=f"expected the next id this client was granted \\({first + 1}\\)"):
        _call(alice, f, mesh, output_ids=[bob_first])
    carol = ClientOps(alice.controller, None, "carol")
    h = carol.handle(RegisterFunction("h", pb.Graph(), []))
    with pytest.raises(NotYoursError, match="none left"):
        _call(carol, h, carol.handle(AllocateMesh({"data": 2})), output_ids=[first + 2])


def test_a_call_that_failed_before_dispatch_fails_its_readers_with_the_same_error(two_clients):
    _, _, alice, _ = two_clients
    error = ExecutorLostError("executor e1 lost", executor_id="e1")
    alice.never_made([41], error)
    f = alice.handle(RegisterFunction("f", pb.Graph(), []))
    mesh = alice.handle(AllocateMesh({"data": 2}))
    with pytest.raises(ExecutorLostError) as raised:
        _call(alice, f, mesh, [41])
    assert raised.value is error
    alice.handle(Release(41))
    with pytest.raises(NotYoursError):
        _call(alice, f, mesh, [41])


def test_a_client_that_goes_frees_its_arrays_and_its_functions_leave_every_executor(two_clients):
    controller, outbox, alice, bob = two_clients
    f = alice.handle(RegisterFunction("f", pb.Graph(), []))
    g = bob.handle(RegisterFunction("g", pb.Graph(), []))
    mesh = alice.handle(AllocateMesh({"data": 2}))
    _call(alice, f, mesh)
    [kept] = _call(bob, g, bob.handle(AllocateMesh({"data": 2})))
    assert alice.release_everything() == 1
    assert alice.forget_everything() == 1
    assert outbox.of("forget") == []          # her call in flight still runs f on the executors: it ends first
    [alices_call] = [call.call_id for call in controller.state.calls.values() if call.owner == "alice"]
    for executor_id in ("e0", "e1"):
        controller.on_message(executor_id, pb.Envelope(done=pb.Done(call_id=alices_call, ok=True)), [])
    forgets = {e: list(env.forget.function_ids) for e, env in outbox.of("forget")}
    assert forgets == {"e0": [f], "e1": [f]}
    assert f not in controller.state.functions and g in controller.state.functions
    assert controller.arrays.get(kept.array_id) is not None


def test_a_refused_call_still_uses_up_its_output_ids(two_clients):
    _, _, alice, _ = two_clients
    f = alice.handle(RegisterFunction("f", pb.Graph(), []))
    mesh = alice.handle(AllocateMesh({"data": 2}))
    first, _ = alice.handle(GrantIds(4))
    with pytest.raises(NotYoursError):
        _call(alice, f, mesh, [10**9], output_ids=[first])    # refused: the client has moved past `first` anyway
    [out] = _call(alice, f, mesh, output_ids=[first + 1])
    assert out.array_id == first + 1


# ---------------------------------------------------------------- a client that leaves mid-put or mid-call (#46: H3, M6)

@pytest.fixture
def budgeted():
    """Two executors with 1,000 bytes each counted (`MemoryBudget`), and alice's ops over them."""
    outbox = FakeOutbox()
    controller = Controller(outbox, ControllerConfig(executor_memory_bytes=1000, memory_wait_s=0.2))
    for i in range(2):
        controller.on_message(f"e{i}", pb.Envelope(register=pb.Register(
            executor_id=f"e{i}", data_address=f"tcp://127.0.0.1:{7000 + i}", backend="eager")), [])
    return controller, outbox, ClientOps(controller, None, "alice")


def _spent(outbox):
    """(executor, role, sequence) of every put token the controller's Frees spent."""
    return sorted((e, s.role, s.sequence) for e, env in outbox.of("free") for s in env.free.spent_puts)


def test_a_client_that_leaves_mid_put_gives_back_its_budget_and_spends_its_tokens(budgeted):
    controller, outbox, alice = budgeted
    [landing] = alice.handle(NewArray(("e0", "e1"), landing=2, shard_bytes=800))   # never lands: the client was killed
    alice.handle(Landed(landing.array_id))                                           # one shard of two came
    assert controller.memory.snapshot()["e0"]["held"] == 800
    assert alice.release_everything() == 1
    assert controller.memory.snapshot() == {} and controller.arrays.get(landing.array_id) is None
    assert landing.state == "failed" and "left while its puts were landing" in str(landing.error)
    freed = sorted((e, r.array_id, r.shard) for e, env in outbox.of("free") for r in env.free.shards)
    assert freed == [("e0", landing.array_id, 0), ("e1", landing.array_id, 1)]
    # Its tokens are spent on both executors: a shard still on its way is refused there, never kept.
    assert _spent(outbox) == [("e0", "client-alice", 1), ("e1", "client-alice", 1)]
    # Another client's 800-byte put fits now (it failed with OutOfMemoryError while the record leaked: H3).
    bob = ClientOps(controller, None, "bob")
    assert bob.handle(NewArray(("e0", "e1"), landing=2, shard_bytes=800))[0].held_bytes == 800


def test_what_a_call_or_put_racing_the_clients_leave_adds_is_freed_at_once_budget_and_all(budgeted, monkeypatch):
    controller, outbox, alice = budgeted
    f = alice.handle(RegisterFunction("f", pb.Graph(), []))
    mesh = alice.handle(AllocateMesh({"data": 2}))
    dispatch = controller.call_dispatch.call

    def call_racing_the_leave(spec, owner, output_ids=None):   # the client goes while its call is dispatched
        records = dispatch(spec, owner, output_ids)
        assert controller.memory.snapshot()["e0"]["held"] == 600
        alice.release_everything()
        return records

    monkeypatch.setattr(controller.call_dispatch, "call", call_racing_the_leave)
    spec = CallSpec(function_id=f, name="f", mesh=mesh, inputs=(), num_outputs=1, output_shard_bytes=(600,))
    with pytest.raises(ClientGone, match="client 'alice' left while a request was making arrays"):
        alice.handle(Call(spec))
    [run] = [env.run for _, env in outbox.of("run")][:1]
    [output] = [r.array_id for r in run.outputs]
    assert controller.memory.snapshot() == {} and controller.arrays.get(output) is None and not alice.arrays
    assert ("e0", output) in [(e, r.array_id) for e, env in outbox.of("free") for r in env.free.shards]
    # A put's new array made after the leave (it waited for memory meanwhile): undone too, its tokens spent.
    with pytest.raises(ClientGone):
        alice.handle(NewArray(("e0", "e1"), landing=2, shard_bytes=300))[0]
    assert controller.memory.snapshot() == {} and len(controller.arrays) == 0 and len(_spent(outbox)) == 2
    with pytest.raises(ClientGone):   # and a function registered after it leaves the controller's table again
        alice.handle(RegisterFunction("g", pb.Graph(), []))
    assert alice.functions == {f} and set(controller.state.functions) == {f}
