"""Authenticated sockets: who is refused, how fast, and that the cluster keeps serving.

Every ZeroMQ socket speaks CURVE against the launcher's allow-list. Each refusal
here is observed twice: on the refused end (a socket monitor event, or a closed
TCP connection, within a bounded time, never a hang) and on the refusing end
(its count of refused connections). After each, a normal call still works.
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

import pathways_torch as pw
from pathways_torch.data_client import DataClient
from pathways_torch.wire import pb
from pathways_torch.wire.security import CLIENT, CONTROLLER, Credentials, KeyDirectory, KeyPair
from tests.conftest import REPO_ROOT, listening_tcp, on_loopback, wait_until
from tests.handles import client_credentials_of, controller_of, keys_of, server_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BOUND_S = 5.0   # a refused peer learns it within this (it takes milliseconds on loopback)


@pytest.fixture(scope="module")
def ctx():
    with pw.Context(num_executors=2, backend="eager") as context:
        yield context


@pytest.fixture(scope="module")
def mesh(ctx):
    return ctx.mesh({"data": 2})


@pytest.fixture
def zctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(scope="module")
def add_one():
    return pw.function(lambda a: a + 1, name="add_one")


def _still_serves(ctx, mesh, add_one) -> None:
    x = torch.arange(8.0)
    out = add_one(ctx.put(x, mesh, [pw.Shard(0)]))
    torch.testing.assert_close(out.result(timeout_s=30), x + 1)


def _target(ctx, target: str) -> tuple[str, bytes]:
    """The endpoint and CURVE server key of the controller's ROUTER or executor-0's data ROUTER."""
    if target == "controller":
        return server_of(ctx).address, server_of(ctx).credentials.keys.public
    info = controller_of(ctx).resources.executors["executor-0"]
    return info.data_address, info.public_key


def _refused(ctx, target: str) -> int:
    if target == "controller":
        return ctx.stats()["controller"]["refused_connections"]
    return ctx.stats()["executors"]["executor-0"]["refused_connections"]


def _settled_refused(ctx, target: str, quiet_s: float = 0.3) -> int:
    """The refused count once it has not moved for ``quiet_s``: a legitimate connection still in its
    handshake counts as refused for the milliseconds that takes (`ConnectionWatch.refused`), so a count
    read during one would be one too high and hide the hostile connection that follows."""
    value, since = _refused(ctx, target), time.monotonic()
    while time.monotonic() - since < quiet_s:
        time.sleep(0.05)
        now = _refused(ctx, target)
        if now != value:
            value, since = now, time.monotonic()
    return value


def _dealer(zctx, address: str, server_key: bytes | None, keys: KeyPair | None, identity: bytes | None = None,
            *, monitor: bool = True):
    """A DEALER (CURVE when ``server_key`` is given, else NULL) and its monitor socket (or None)."""
    dealer = zctx.socket(zmq.DEALER)
    dealer.linger = 0
    if identity:
        dealer.identity = identity
    if server_key is not None:
        dealer.curve_serverkey, dealer.curve_publickey, dealer.curve_secretkey = server_key, keys.public, keys.secret
    monitor_socket = dealer.get_monitor_socket() if monitor else None
    dealer.connect(address)
    return dealer, monitor_socket


def _wait_for_event(monitor, wanted: set[str], timeout_s: float) -> tuple[str | None, list[str]]:
    """Read monitor events until one in ``wanted`` (returned with all seen) or the timeout."""
    seen, deadline = [], time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if not monitor.poll(int(left * 1000) + 1):
            break
        name = zmq.Event(recv_monitor_message(monitor)["event"]).name
        seen.append(name)
        if name in wanted:
            return name, seen
    return None, seen


def _ping(target: str) -> list:
    """A well-formed message the target would answer if it admitted us."""
    if target == "controller":
        return [pb.Envelope(heartbeat=pb.Heartbeat(sent_at=1.0)).SerializeToString()]
    fetch = pb.Fetch(request_id=1)
    fetch.shard.CopyFrom(pb.ShardRef(array_id=1, shard=0))
    return [pb.Envelope(fetch=fetch).SerializeToString()]


def _offer(dealer, frames: list) -> None:
    """Send without blocking: once a refused handshake has torn its connection down, a DEALER has no peer and a
    blocking send would wait for the next reconnection (it hung a CI run for 120 s). The refusal is read from the
    monitor's events, not from the message."""
    try:
        dealer.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        pass


def test_every_socket_listens_on_loopback_and_no_key_stays_on_disk(ctx, mesh):
    """Every TCP socket the client and the executors listen on, as the kernel lists them (not the addresses we were
    told): the controller's, each executor's command and data sockets and its gloo groups' (a collective ran
    first). A launched run's health and status servers: tests/integration/test_launch.py, with the same check."""
    total = pw.function(lambda a: pw.all_reduce(a.sum(), axis="data"), name="total")
    assert total(ctx.put(torch.arange(8.0), mesh, [pw.Shard(0)])).result(timeout_s=60).tolist() == [28.0, 28.0]
    assert server_of(ctx).address.startswith("tcp://127.0.0.1:")
    client = listening_tcp(os.getpid())
    assert ("127.0.0.1", _port_of(server_of(ctx).address)) in client, client
    for info in controller_of(ctx).resources.ordered():
        assert info.data_address.startswith("tcp://127.0.0.1:"), info
        assert len(info.public_key) == 40 and info.public_key == server_of(ctx).credentials.allowed[info.executor_id]
        listening = listening_tcp(info.pid)
        ours = {_port_of(info.data_address), _port_of(info.command_address)}
        assert ours <= {port for _, port in listening}, (info, listening)
        assert len(listening) > len(ours), f"{info.executor_id}: no gloo listener among {listening}"
        client += listening
    outside = [(address, port) for address, port in client if not on_loopback(address)]
    assert not outside, f"expected every listening socket on 127.0.0.0/8, got {outside}"
    assert not os.path.exists(keys_of(ctx).path)   # every process read its keys at start-up


def _port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@pytest.mark.parametrize("target", ["controller", "executor"])
def test_a_key_not_on_the_allow_list_is_refused(ctx, mesh, add_one, zctx, target):
    address, server_key = _target(ctx, target)
    public, secret = zmq.curve_keypair()
    refused_before = _settled_refused(ctx, target)
    dealer, monitor = _dealer(zctx, address, server_key, KeyPair(public=public, secret=secret), b"executor-0")
    started = time.monotonic()
    _offer(dealer, _ping(target))
    event, seen = _wait_for_event(monitor, {"HANDSHAKE_FAILED_AUTH"}, BOUND_S)
    assert event == "HANDSHAKE_FAILED_AUTH", seen
    assert time.monotonic() - started < BOUND_S
    assert "HANDSHAKE_SUCCEEDED" not in seen
    assert not dealer.poll(300), "a refused client got an answer"
    assert wait_until(lambda: _refused(ctx, target) > refused_before, 5)
    _still_serves(ctx, mesh, add_one)


@pytest.mark.parametrize("target", ["controller", "executor"])
def test_the_null_mechanism_is_refused(ctx, mesh, add_one, zctx, target):
    address, _ = _target(ctx, target)
    refused_before = _settled_refused(ctx, target)
    dealer, monitor = _dealer(zctx, address, None, None)
    _offer(dealer, _ping(target))
    # A ZMTP mechanism mismatch; under load libzmq sometimes reports it without detail.
    failures = {"HANDSHAKE_FAILED_PROTOCOL", "HANDSHAKE_FAILED_NO_DETAIL"}
    event, seen = _wait_for_event(monitor, failures, BOUND_S)
    assert event in failures, seen
    assert not dealer.poll(300)
    assert wait_until(lambda: _refused(ctx, target) > refused_before, 5)
    _still_serves(ctx, mesh, add_one)


@pytest.mark.parametrize("junk", [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\xff" + b"\x00" * 8 + b"\x7f" + os.urandom(200)],
                         ids=["http", "zmtp-like"])
@pytest.mark.parametrize("target", ["controller", "executor"])
def test_plain_tcp_junk_is_cut_off(ctx, mesh, add_one, target, junk):
    address, _ = _target(ctx, target)
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    refused_before = _settled_refused(ctx, target)
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=BOUND_S) as raw:
        raw.sendall(junk)
        received = b""
        try:
            while chunk := raw.recv(4096):   # the server's greeting at most, then it hangs up
                received += chunk
        except ConnectionResetError:
            pass
    assert time.monotonic() - started < BOUND_S
    assert len(received) <= 64, received   # a greeting, never an answer
    assert wait_until(lambda: _refused(ctx, target) > refused_before, 5)
    _still_serves(ctx, mesh, add_one)


def test_the_client_refuses_an_impostor_executor(ctx, zctx):
    """A server that does not hold executor-0's secret: the client's fetch fails, it does not hang."""
    impostor = zctx.socket(zmq.ROUTER)
    public, secret = zmq.curve_keypair()
    impostor.curve_server, impostor.curve_publickey, impostor.curve_secretkey = True, public, secret
    port = impostor.bind_to_random_port("tcp://127.0.0.1")
    client = DataClient(zctx, client_credentials_of(ctx))
    try:
        client.connect("executor-0", f"tcp://127.0.0.1:{port}", server_of(ctx).credentials.allowed["executor-0"])
        started = time.monotonic()
        with pytest.raises(pw.AuthenticationError, match="executor-0") as info:
            client.fetch("executor-0", pb.ShardRef(array_id=1, shard=0)).result(BOUND_S)
        assert time.monotonic() - started < BOUND_S and info.value.peer == "executor-0"
        assert not impostor.poll(200), "the impostor received a request"
    finally:
        client.close()
        impostor.close(linger=0)


def test_a_client_with_a_foreign_key_gets_an_error_not_a_hang(ctx, mesh, add_one, zctx):
    x = ctx.put(torch.ones(4), mesh, [pw.Shard(0)])
    x.result(timeout_s=30)
    public, secret = zmq.curve_keypair()
    stranger = Credentials(role=CLIENT, keys=KeyPair(public=public, secret=secret), allowed={})
    client = DataClient(zctx, stranger)
    try:
        info = controller_of(ctx).resources.executors["executor-0"]
        client.connect("executor-0", info.data_address, info.public_key)
        with pytest.raises(pw.AuthenticationError):
            client.fetch("executor-0", pb.ShardRef(array_id=x.array_id, shard=0)).result(BOUND_S)
        errors = []
        client.put("executor-0", [(pb.ShardRef(array_id=10**9, shard=0), torch.ones(2))], errors.append)
        assert wait_until(lambda: errors, BOUND_S) and isinstance(errors[0], pw.AuthenticationError)
    finally:
        client.close()
    _still_serves(ctx, mesh, add_one)


def test_an_executor_key_can_neither_fetch_nor_put_nor_save_on_another_executor(monkeypatch, zctx, tmp_path):
    """Every executor's key passes a data socket's handshake (transfers need it), but only the client's key may
    fetch, put or save there: executor-1's key gets no answer, nothing is stored or written, and each is counted."""
    import shutil

    kept: list[str] = []   # the context's key folder, kept on disk just long enough to read executor-1's pair
    monkeypatch.setattr(KeyDirectory, "remove", lambda self: kept.append(self.path))
    with pw.Context(num_executors=2, backend="eager") as ctx:
        try:
            thief = KeyDirectory(kept[0]).credentials("executor-1")
        finally:
            shutil.rmtree(kept[0], ignore_errors=True)
        x = ctx.put(torch.arange(4.0), ctx.mesh({"data": 2}), [pw.Shard(0)])   # shard 0 lives on executor-0
        x.result(timeout_s=30)
        info = controller_of(ctx).resources.executors["executor-0"]
        before = ctx.stats()["executors"]["executor-0"]
        client = DataClient(zctx, thief)
        try:
            client.connect("executor-0", info.data_address, info.public_key)
            fetched = client.fetch("executor-0", pb.ShardRef(array_id=x.array_id, shard=0))
            put_results: list = []
            client.put("executor-0", [(pb.ShardRef(array_id=10**9, shard=0), torch.ones(2))], put_results.append)
            saved = client.save("executor-0", [pb.ShardRef(array_id=x.array_id, shard=0)], ["w"],
                                str(tmp_path / "stolen.safetensors"))
            assert wait_until(lambda: ctx.stats()["executors"]["executor-0"]["refused_data_messages"]
                              >= before["refused_data_messages"] + 3, 10)
            # Refused where they arrived, in order: had any been answered, the answer would have left by now.
            assert not fetched.done() and not saved.done() and put_results == []
            assert not (tmp_path / "stolen.safetensors").exists()
            after = ctx.stats()["executors"]["executor-0"]
            assert after["refused_data_messages"] == before["refused_data_messages"] + 3
            assert after["dropped_messages"] == before["dropped_messages"] + 3
            assert (after["store_buffers"], after["store_bytes"]) == (before["store_buffers"], before["store_bytes"])
        finally:
            client.close()
        torch.testing.assert_close(x.result(timeout_s=30), torch.arange(4.0))   # the client's key still may
    shutil.rmtree(kept[0], ignore_errors=True)


def test_an_executor_whose_key_is_not_allowed_exits_at_once(ctx, tmp_path):
    """The controller refuses it; it says why in its log and exits instead of waiting unheard. (The refusal comes
    once: the executor watches its connection from before it connects, tests/unit/test_security.py.)"""
    keys = KeyDirectory.create(["executor-9"], parent=str(tmp_path))
    # It knows the real controller's key, but its own is not on the controller's allow-list.
    with open(os.path.join(keys.path, "public", f"{CONTROLLER}.key"), "w") as f:
        f.write(f'curve\n    public-key = "{server_of(ctx).credentials.keys.public.decode()}"\n')
    refused_before = ctx.stats()["controller"]["refused_connections"]
    started = time.monotonic()
    # The simulated backend imports no torch: the executor is up in a second or two even on a loaded machine, so
    # the bound below tells exiting on the refusal from the 60 s join timeout, whatever the load.
    out = subprocess.run([sys.executable, "-m", "executor", "--controller", server_of(ctx).address,
                          "--id", "executor-9", "--keys", keys.path, "--backend", "sim", "--heartbeat-timeout-s", "60"],
                         capture_output=True, text=True, timeout=90, cwd=REPO_ROOT,
                         env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    assert out.returncode == 5, out.stderr    # EXIT_REFUSED: a node does not start it again with a spare key
    assert "could not authenticate with the controller" in out.stderr and "HANDSHAKE_FAILED_AUTH" in out.stderr
    assert time.monotonic() - started < 30, out.stderr   # never the 60 s join timeout
    assert "executor-9" not in controller_of(ctx).resources.executors
    assert ctx.stats()["controller"]["refused_connections"] > refused_before


def test_an_executor_refuses_a_key_directory_others_can_read(tmp_path):
    keys = KeyDirectory.create([CONTROLLER, "executor-0"], parent=str(tmp_path))
    os.chmod(keys.path, 0o755)
    out = subprocess.run([sys.executable, "-m", "executor", "--controller", "tcp://127.0.0.1:9", "--id", "executor-0",
                          "--keys", keys.path, "--backend", "eager"],
                         capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
                         env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    assert out.returncode != 0
    assert "expected 0700" in out.stderr and "chmod 700" in out.stderr



# ---------------------------------------------------------------- hostile frames from an authenticated peer

def _put(array_id: int, tensor_meta: pb.TensorMeta, tag: int = 0) -> bytes:
    put = pb.Put(request_id=7)
    put.shard.CopyFrom(pb.ShardRef(array_id=array_id, shard=0, tag=tag))
    put.tensor.CopyFrom(tensor_meta)
    return pb.Envelope(put=put).SerializeToString()


def _transfer(array_id: int, tag: int, *, frame: int = 1, failed: bool = False) -> bytes:
    transfer = pb.Transfer(failed=failed)
    transfer.shard.CopyFrom(pb.ShardRef(array_id=array_id, shard=0, tag=tag))
    transfer.tensor.CopyFrom(pb.TensorMeta(dtype="float32", shape=[2], frame=frame))
    if failed:
        transfer.failure.CopyFrom(pb.RemoteFailure(type="ValueError", message="forged"))
    return pb.Envelope(transfer=transfer).SerializeToString()


_FLOATS = torch.ones(2).numpy().tobytes()
_UNKNOWN_FIELD_ONLY = b"\xf8\x3e\x01"   # field 999, varint 1: parses, but carries no known message
_VALID_PUT = _put(123, pb.TensorMeta(dtype="float32", shape=[2], frame=1))

# Each is dropped by an executor's data socket (and counted): never stored; only the puts are answered
# (with a failing PutAck, so that a real client's put ends).
EXECUTOR_HOSTILE = {
    "junk frame 0": [b"\x00\xffnot a protobuf\xff" * 4],
    "empty frame 0": [b""],
    "truncated protobuf": [_VALID_PUT[: len(_VALID_PUT) // 2], _FLOATS],
    "huge shape": [_put(124, pb.TensorMeta(dtype="float32", shape=[1 << 31, 1 << 31], frame=1)), _FLOATS],
    "shape and frame disagree": [_put(125, pb.TensorMeta(dtype="float32", shape=[1000], frame=1)), _FLOATS],
    "unknown dtype": [_put(126, pb.TensorMeta(dtype="__class__", shape=[2], frame=1)), _FLOATS],
    "unknown field only": [_UNKNOWN_FIELD_ONLY],
    "frame index out of range": [_transfer(127, 1, frame=5), _FLOATS],
    "transfer no run waits for": [_transfer(128, 1), _FLOATS],
    "forged failure for no run": [_transfer(129, 1, failed=True)],
    "control message on the data socket": [pb.Envelope(run=pb.Run(call_id=10**6, function_id=1)).SerializeToString()],
    "reply sent to a server": [pb.Envelope(put_ack=pb.PutAck(request_id=1)).SerializeToString()],
}

# Each is dropped by the controller (and counted); the peer holds the client's key, so it is
# authenticated, but it is no executor and may not speak as one.
CONTROLLER_HOSTILE = {
    "junk frame 0": (b"client", [b"\x00\xffnot a protobuf"]),
    "truncated protobuf": (b"client", [pb.Envelope(register=pb.Register(executor_id="client", data_address="x" * 40))
                                      .SerializeToString()[:20]]),
    "unknown field only": (b"client", [_UNKNOWN_FIELD_ONLY]),
    "register by a non-executor": (b"client", [pb.Envelope(register=pb.Register(
        executor_id="client", data_address="tcp://127.0.0.1:1")).SerializeToString()]),
    "done for an unknown call": (b"client", [pb.Envelope(done=pb.Done(call_id=10**9, ok=True)).SerializeToString()]),
    "speaking as an executor": (b"executor-7", [pb.Envelope(done=pb.Done(call_id=1, ok=True)).SerializeToString()]),
    "heartbeat as an executor": (b"executor-7#heartbeat", [pb.Envelope(heartbeat=pb.Heartbeat()).SerializeToString()]),
}

ROUNDS = 20   # each kind is sent this many times: a leak would show in the counts


def _executor_state(ctx) -> dict:
    stats = ctx.stats()["executors"]["executor-0"]
    return {k: stats[k] for k in ("store_buffers", "store_bytes", "dropped_messages", "num_computations")}


def test_hostile_frames_to_an_executor_are_dropped_and_it_keeps_serving(ctx, mesh, add_one, zctx):
    gc.collect()
    x = ctx.put(torch.arange(8.0), mesh, [pw.Shard(0)])
    x.result(timeout_s=30)
    before = _executor_state(ctx)
    address, server_key = _target(ctx, "executor")
    dealer, _ = _dealer(zctx, address, server_key, client_credentials_of(ctx).keys, monitor=False)
    for _ in range(ROUNDS):
        for frames in EXECUTOR_HOSTILE.values():
            dealer.send_multipart(frames)
    # A fetch for an array that does not exist is answered with a failure, and stores nothing.
    fetch = pb.Fetch(request_id=99)
    fetch.shard.CopyFrom(pb.ShardRef(array_id=10**12, shard=0))
    dealer.send_multipart([pb.Envelope(fetch=fetch).SerializeToString()])
    # A put whose frame does not fit its header is refused with a failing PutAck (so a real client's put
    # ends, issue 15); nothing else hostile is answered.
    bad_puts = {124, 125, 126}
    replies = []
    while dealer.poll(int(BOUND_S * 1000) if not replies else 300):
        replies.append(pb.Envelope.FromString(dealer.recv_multipart()[0]))
    # A well-formed copy that may still be early for its Run is kept (bounded) and acknowledged, once; a copy
    # refused is not (a hostile peer learns nothing more).
    transfer_acks = [r.transfer_ack.shard.array_id for r in replies if r.WhichOneof("body") == "transfer_ack"]
    assert set(transfer_acks) <= {128, 129} and len(set(transfer_acks)) == len(transfer_acks), transfer_acks
    replies = [r for r in replies if r.WhichOneof("body") != "transfer_ack"]
    fetch_replies = [r.fetch_reply for r in replies if r.WhichOneof("body") == "fetch_reply"]
    put_acks = [r.put_ack for r in replies if r.WhichOneof("body") == "put_ack"]
    assert len(fetch_replies) == 1 and len(put_acks) + 1 == len(replies), [r.WhichOneof("body") for r in replies]
    reply = fetch_replies[0]
    assert reply.request_id == 99 and reply.failed and reply.failure.type == "KeyError"
    assert sorted(a.shard.array_id for a in put_acks) == sorted(i for i in bad_puts for _ in range(ROUNDS)), \
        "every refused put is answered once, and only those"
    assert all(a.failed and a.failure.message for a in put_acks)

    expected_drops = before["dropped_messages"] + ROUNDS * len(EXECUTOR_HOSTILE)
    assert wait_until(lambda: _executor_state(ctx)["dropped_messages"] >= expected_drops, 10)
    after = _executor_state(ctx)
    assert after == dict(before, dropped_messages=expected_drops)   # nothing stored, nothing computed
    _still_serves(ctx, mesh, add_one)
    torch.testing.assert_close(x.result(timeout_s=30), torch.arange(8.0))   # nothing stored was lost


def test_control_messages_from_anyone_but_the_controller_are_dropped(ctx, mesh, add_one, zctx):
    """The command socket admits allow-listed keys (CURVE), but reads only what the controller's key sent."""
    gc.collect()
    before = _executor_state(ctx)
    info = controller_of(ctx).resources.executors["executor-0"]
    dealer, _ = _dealer(zctx, info.command_address, info.public_key, client_credentials_of(ctx).keys, monitor=False)
    hostile = [pb.Envelope(shutdown=pb.Shutdown(reason="forged")).SerializeToString(),
               pb.Envelope(run=pb.Run(call_id=10**6, function_id=1)).SerializeToString(),
               pb.Envelope(free=pb.Free(shards=[pb.ShardRef(array_id=1, shard=0)])).SerializeToString()]
    for _ in range(ROUNDS):
        for frame in hostile:
            dealer.send_multipart([frame])
    expected_drops = before["dropped_messages"] + ROUNDS * len(hostile)
    assert wait_until(lambda: _executor_state(ctx)["dropped_messages"] >= expected_drops, 10)
    assert _executor_state(ctx) == dict(before, dropped_messages=expected_drops)
    _still_serves(ctx, mesh, add_one)   # the forged shutdown was not obeyed


def test_hostile_frames_to_the_controller_are_dropped_and_it_keeps_serving(ctx, mesh, add_one, zctx):
    gc.collect()   # earlier tests' arrays are released now, not in the middle
    before = ctx.stats()["controller"]["dropped_messages"]
    arrays, executors = len(controller_of(ctx).arrays), sorted(controller_of(ctx).resources.executors)
    address, server_key = _target(ctx, "controller")
    disconnects = lambda: server_of(ctx).connections.events["DISCONNECTED"]  # noqa: E731
    for identity, frames in CONTROLLER_HOSTILE.values():
        gone = disconnects()
        dealer, monitor = _dealer(zctx, address, server_key, client_credentials_of(ctx).keys, identity)
        # Send only once the handshake is done, and let close() flush: on a loaded machine a
        # handshake can outlast the poll below, and close() with linger 0 would discard the frames.
        event, seen = _wait_for_event(monitor, {"HANDSHAKE_SUCCEEDED"}, BOUND_S)
        assert event == "HANDSHAKE_SUCCEEDED", seen
        for _ in range(ROUNDS):
            dealer.send_multipart(frames)
        assert not dealer.poll(100), "a hostile message was answered"
        dealer.linger = int(BOUND_S * 1000)
        dealer.disable_monitor()   # frees its inproc address for the next dealer's monitor
        monitor.close()
        dealer.close()
        # The next dealer may reuse this identity, and a ROUTER refuses a second connection under
        # an identity still connected (no ROUTER_HANDOVER): its frames would be lost unread.
        assert wait_until(lambda: disconnects() > gone, BOUND_S), "the controller never saw the dealer go"
    expected = before + ROUNDS * len(CONTROLLER_HOSTILE)
    assert wait_until(lambda: ctx.stats()["controller"]["dropped_messages"] >= expected, 10)
    assert ctx.stats()["controller"]["dropped_messages"] == expected
    assert sorted(controller_of(ctx).resources.executors) == executors   # no one registered
    assert len(controller_of(ctx).arrays) == arrays
    assert ctx.stats()["controller"]["lost_executors"] == []
    _still_serves(ctx, mesh, add_one)


def test_an_oversized_frame_to_the_controller_is_cut_off(ctx, mesh, add_one, zctx):
    """Executors send the controller envelopes only: a frame over 64 MiB closes that connection unread."""
    address, server_key = _target(ctx, "controller")
    dealer, monitor = _dealer(zctx, address, server_key, client_credentials_of(ctx).keys, b"client")
    event, seen = _wait_for_event(monitor, {"HANDSHAKE_SUCCEEDED"}, BOUND_S)
    assert event == "HANDSHAKE_SUCCEEDED", seen
    dropped_before = ctx.stats()["controller"]["dropped_messages"]
    dealer.send(b"\0" * ((64 << 20) + 1))
    event, seen = _wait_for_event(monitor, {"DISCONNECTED"}, BOUND_S)
    assert event == "DISCONNECTED", seen
    assert ctx.stats()["controller"]["dropped_messages"] == dropped_before   # it never reached our code
    _still_serves(ctx, mesh, add_one)
