"""Clients of one `pathways-controller` keep to their own arrays (docs/service.md): bob can neither read, free,
overwrite, call nor name alice's, whether he asks the controller (`controller.client_ops`, NotYoursError) or goes
straight to an executor's data socket (executor/data_roles.py, OwnerCheck: each put carries the controller's token
for its array and its client, each fetch is checked against the owner the controller announced)."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

import pathways_torch as pw
from pathways_torch.client import CallSpec
from pathways_torch.errors import RemoteError
from pathways_torch.wire import pb
from pathways_torch.wire.put_tokens import PUT_TOKEN_BYTES
from tests.service import client_fixture
from pathways_torch.wire.seam import Call, FlushFrees, Release, ReleaseMany, RunProgram
from tests.handles import client_of, data_client_of, dispatcher_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

inc = pw.function(lambda x: x + 1, name="inc")


alice = client_fixture("alice", "shared_service", num_executors=4, backend="eager")
bob = client_fixture("bob", "shared_service", num_executors=4, backend="eager")


def _fetch(ctx, executor_id: str, array_id: int, shard: int = 0):
    return data_client_of(ctx).fetch(executor_id, pb.ShardRef(array_id=array_id, shard=shard))


def _put(ctx, executor_id: str, array_id: int, tensor, token: bytes, shard: int = 0) -> BaseException | None:
    """A put straight to ``executor_id``; the error it ended with (None: it was kept)."""
    landed: concurrent.futures.Future = concurrent.futures.Future()
    data_client_of(ctx).put(executor_id, [(pb.ShardRef(array_id=array_id, shard=shard), tensor, token)],
                            landed.set_result)
    return landed.result(timeout=30)


def _not_held(error: BaseException, executor_id: str, array_id: int, shard: int = 0) -> bool:
    return isinstance(error, RemoteError) and \
        f"executor {executor_id} holds no shard {shard} of array {array_id}" in str(error)


def _refusal(request) -> str:
    """What the controller said when it refused ``request``: raised at once (`NotYoursError`, a ValueError on this
    side), or, for a call sent without waiting for the answer, the failure of every output it named."""
    try:
        states = request()
    except ValueError as exc:
        return str(exc)
    assert states and all(state.wait(30) and state.state == "failed" for state in states), states
    return str(states[0].error)


def _run_program(client, program_id: int, input_ids: list):
    """A run of a program, as the dispatcher asks for it (not waited for where the client registered it)."""
    return client.request(RunProgram(program_id, input_ids))


@pytest.mark.timeout(120)
def test_bob_cannot_fetch_alices_arrays_from_the_executors(alice, bob):
    mesh = alice.mesh({"data": 4})
    host = torch.arange(8.0)
    x = alice.put(host, mesh, [pw.Shard(0)])
    y = inc(x)
    torch.testing.assert_close(y.result(timeout_s=60), host + 1)
    ids = alice.executor_ids
    # By the ids alice holds, and by guesses around them: every one is answered as an array never held there.
    bobs = set(getattr(client_of(bob), "_states", {}))   # his own arrays, if an earlier test made any, are his to read
    guesses = [a for a in range(max(1, y.array_id - 3), y.array_id + 4) if a not in bobs]
    for array_id in (x.array_id, y.array_id, *guesses):
        for position, executor_id in enumerate(ids):
            with pytest.raises(RemoteError) as info:
                _fetch(bob, executor_id, array_id, position).result(timeout=30)
            assert _not_held(info.value, executor_id, array_id, position), str(info.value)
    # The same text as for an id no one holds: the owner is not revealed.
    with pytest.raises(RemoteError) as unknown:
        _fetch(bob, ids[0], 10**9).result(timeout=30)
    assert _not_held(unknown.value, ids[0], 10**9)
    torch.testing.assert_close(_fetch(alice, ids[1], y.array_id, 1).result(timeout=30), host[2:4] + 1)
    torch.testing.assert_close(y.result(timeout_s=30), host + 1)


@pytest.mark.timeout(120)
def test_bob_cannot_put_into_alices_arrays_even_with_a_token_of_his_own(alice, bob):
    mesh, bob_mesh = alice.mesh({"data": 4}), bob.mesh({"data": 4})
    host = torch.arange(8.0)
    x = alice.put(host, mesh, [pw.Shard(0)])
    out = x
    for _ in range(20):   # a chain: its last output is likely still pending when bob's puts arrive
        out = inc(out)
    mine = bob.put(torch.zeros(8), bob_mesh, [pw.Shard(0)])
    token = mine._state.put_token
    assert len(token) == 4 * PUT_TOKEN_BYTES and x._state.put_token not in (b"", token)   # one per shard
    evil = torch.full((2,), 666.0)
    ids = alice.executor_ids
    for array_id in (out.array_id, x.array_id):
        for candidate in (token, b"", b"\0" * 16):
            error = _put(bob, ids[0], array_id, evil, candidate)
            assert isinstance(error, RemoteError) and f"array {array_id} is not this client's" in str(error), \
                repr(error)
    torch.testing.assert_close(out.result(timeout_s=60), host + 20)
    torch.testing.assert_close(x.result(timeout_s=30), host)
    # Bob's own token still puts into his own array (a put's first fill wins: a fresh id of his own).
    fresh = bob.put(torch.ones(8), bob_mesh, [pw.Shard(0)])
    torch.testing.assert_close(fresh.result(timeout_s=30), torch.ones(8))
    torch.testing.assert_close(mine.result(timeout_s=30), torch.zeros(8))


@pytest.mark.timeout(120)
def test_bob_cannot_release_call_on_or_run_a_program_on_alices_arrays(alice, bob):
    mesh, bob_mesh = alice.mesh({"data": 4}), bob.mesh({"data": 4})
    host = torch.arange(8.0)
    x = alice.put(host, mesh, [pw.Shard(0)])
    y = inc(x)
    torch.testing.assert_close(y.result(timeout_s=60), host + 1)

    @pw.program(name="twice")
    def twice(a):
        return inc(inc(a))

    torch.testing.assert_close(twice(x).result(timeout_s=60), host + 2)   # alice's program: registered, run
    alice_programs = [entry[0] for entry in dispatcher_of(alice)._lowered_programs.values()]
    # Bob's own function and program, called the ordinary way first (registered, on his own mesh).
    b = bob.put(torch.zeros(8), bob_mesh, [pw.Shard(0)])
    own = pw.function(lambda a: a * 2, name="bobs")
    torch.testing.assert_close(own(b).result(timeout_s=60), torch.zeros(8))

    @pw.program(name="bobs_program")
    def bobs_program(a):
        return own(a)

    torch.testing.assert_close(bobs_program(b).result(timeout_s=60), torch.zeros(8))
    function_id = next(fid for fid, version in dispatcher_of(bob)._function_ids.values() if version().name == "bobs")
    program_id = next(entry[0] for entry in dispatcher_of(bob)._lowered_programs.values())

    client = client_of(bob)
    # A call on the wire names its outputs with ids granted to its client; one that leaves them to the controller
    # (the embedded client's form) is refused: bob would hold arrays he cannot name.
    own_spec = CallSpec(function_id=function_id, name="bobs", mesh=bob_mesh.allocation, inputs=(b.array_id,),
                        num_outputs=1)
    with pytest.raises(TypeError, match="'output_ids' must be list or tuple"):
        client._request(Call(own_spec))
    for array_id in (x.array_id, y.array_id):
        client.request(Release(array_id))                           # not his: nothing freed (a finalizer never raises)
        client.request(ReleaseMany([array_id]))
        spec = CallSpec(function_id=function_id, name="bobs", mesh=bob_mesh.allocation, inputs=(array_id,),
                        num_outputs=1)
        assert "not one this client holds" in _refusal(lambda: client.request(Call(spec)))
        assert "not one this client holds" in _refusal(lambda: _run_program(client, program_id, [array_id]))
    for alices in alice_programs:
        if alices != program_id:
            assert "not one this client registered" in _refusal(lambda: _run_program(client, alices, [b.array_id]))
    client.request(FlushFrees())
    # Alice's arrays are all still there, and still read right.
    torch.testing.assert_close(x.result(timeout_s=30), host)
    ids = alice.executor_ids
    torch.testing.assert_close(_fetch(alice, ids[3], y.array_id, 3).result(timeout=30), host[6:8] + 1)
    torch.testing.assert_close(inc(y).result(timeout_s=60), host + 2)


@pytest.mark.timeout(120)
def test_ids_bob_reads_in_his_own_trace_name_nothing_of_alices(alice, bob, tmp_path):
    mesh, bob_mesh = alice.mesh({"data": 4}), bob.mesh({"data": 4})
    host = torch.arange(8.0)
    y = pw.function(lambda a: a - 1, name="alices_secret")(alice.put(host, mesh, [pw.Shard(0)]))
    torch.testing.assert_close(y.result(timeout_s=60), host - 1)
    trace = bob.trace(str(tmp_path / "bob.json"))   # every executor's events: alice's calls are in it
    seen = {(e["args"]["function_id"], e["args"]["call_id"]) for e in trace["traceEvents"]
            if e.get("name") == "alices_secret" and "args" in e}
    assert seen, "alice's calls appear in bob's trace"
    b = bob.put(torch.zeros(8), bob_mesh, [pw.Shard(0)])
    for function_id, call_id in seen:
        spec = CallSpec(function_id=function_id, name="alices_secret", mesh=bob_mesh.allocation, inputs=(b.array_id,),
                        num_outputs=1)
        assert "not one this client registered" in _refusal(lambda: client_of(bob).request(Call(spec)))
        # a call id is no array id of his either: reading it as one is refused like any stranger's
        for position, executor_id in enumerate(bob_mesh.executor_ids if call_id not in client_of(bob)._states else ()):
            with pytest.raises(RemoteError):
                _fetch(bob, executor_id, call_id, position).result(timeout=30)
    torch.testing.assert_close(y.result(timeout_s=30), host - 1)
