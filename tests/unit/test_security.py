"""Key directories, allow-lists and CURVE sockets in one process (loopback, no cluster)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from pathways_torch.wire.security import (CLIENT, CONTROLLER, HANDSHAKE_FAILURES, ConnectionWatch, Credentials,
                                          Gatekeeper, KeyDirectory, KeyPair, SecurityError, check_role, make_client,
                                          make_server, peer_key, peer_role)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def keys(tmp_path):
    return KeyDirectory.create([CONTROLLER, CLIENT, "executor-0"], parent=str(tmp_path))


@pytest.fixture
def zctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _events(monitor, until: set[str], timeout_s: float = 5.0) -> list[str]:
    seen, deadline = [], time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0 and monitor.poll(int(left * 1000) + 1):
        seen.append(zmq.Event(recv_monitor_message(monitor)["event"]).name)
        if seen[-1] in until:
            break
    return seen


def _server(zctx, credentials):
    server = make_server(zctx.socket(zmq.ROUTER), credentials)
    server.linger = 0
    return server, f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"


def _client(zctx, credentials, server_key, address):
    dealer = make_client(zctx.socket(zmq.DEALER), credentials, server_key)
    dealer.linger = 0
    monitor = dealer.get_monitor_socket()
    dealer.connect(address)
    return dealer, monitor


def test_key_directory_is_private_and_holds_one_pair_per_role(keys):
    assert os.stat(keys.path).st_mode & 0o777 == 0o700
    assert os.stat(os.path.join(keys.path, "secret")).st_mode & 0o777 == 0o700
    public = keys.public_keys()
    assert sorted(public) == [CLIENT, CONTROLLER, "executor-0"]
    assert len(set(public.values())) == 3
    pair = keys.keypair("executor-0")
    assert pair.public == public["executor-0"] and len(pair.secret) == 40
    assert pair.secret.decode() not in repr(pair) and pair.secret.decode() not in repr(keys.credentials(CLIENT))
    secret_file = os.path.join(keys.path, "secret", "executor-0.key_secret")
    assert os.stat(secret_file).st_mode & 0o777 == 0o600
    # The public directory holds no secret.
    for name in os.listdir(os.path.join(keys.path, "public")):
        with open(os.path.join(keys.path, "public", name)) as f:
            assert "secret-key" not in f.read()


def test_key_directory_refuses_what_it_cannot_trust(keys, tmp_path):
    with pytest.raises(SecurityError, match="expected a secret key for 'executor-1'"):
        keys.keypair("executor-1")
    with pytest.raises(SecurityError, match="already has a key"):
        keys.add("executor-0")
    os.chmod(keys.path, 0o750)
    with pytest.raises(SecurityError, match=r"mode 0750.*expected 0700.*chmod 700"):
        KeyDirectory(keys.path)
    with pytest.raises(SecurityError, match="does not exist"):
        KeyDirectory(str(tmp_path / "nowhere"))
    with pytest.raises(SecurityError, match="distinct"):
        KeyDirectory.create(["a", "a"], parent=str(tmp_path))


@pytest.mark.parametrize("role", ["", "a#heartbeat", "../x", "-x", "x" * 65, "a b"])
def test_role_names_are_plain(role):
    with pytest.raises(SecurityError, match="role"):
        check_role(role)


def test_key_pairs_and_credentials_are_checked():
    with pytest.raises(SecurityError, match="40-character"):
        KeyPair(public=b"short", secret=b"x" * 40)
    public, secret = zmq.curve_keypair()
    with pytest.raises(SecurityError, match="no public key for 'controller'"):
        Credentials(role=CLIENT, keys=KeyPair(public=public, secret=secret), allowed={}).public_key(CONTROLLER)


def test_gatekeeper_admits_exactly_the_allow_list_and_names_roles(keys, zctx):
    gatekeeper = Gatekeeper(zctx, keys.public_keys())
    try:
        server, address = _server(zctx, keys.credentials(CONTROLLER))
        server_key = keys.public_keys()[CONTROLLER]
        good, good_monitor = _client(zctx, keys.credentials("executor-0"), server_key, address)
        good.send(b"hello")
        assert server.poll(5000)
        frames = server.recv_multipart(copy=False)
        assert frames[-1].bytes == b"hello" and peer_role(frames[-1]) == "executor-0"
        assert "HANDSHAKE_SUCCEEDED" in _events(good_monitor, {"HANDSHAKE_SUCCEEDED"})

        public, secret = zmq.curve_keypair()
        stranger = Credentials(role=CLIENT, keys=KeyPair(public=public, secret=secret), allowed={})
        bad, bad_monitor = _client(zctx, stranger, server_key, address)
        bad.send(b"let me in")
        assert "HANDSHAKE_FAILED_AUTH" in _events(bad_monitor, {"HANDSHAKE_FAILED_AUTH"})
        assert not server.poll(200)
        assert gatekeeper.refused == 1
    finally:
        gatekeeper.stop()


def test_each_message_carries_the_key_its_connection_authenticated_with_and_a_revoked_one_is_told_apart(keys, zctx):
    # A replacement shares its role with the incarnation it replaces; only the key tells their connections apart.
    gatekeeper = Gatekeeper(zctx, keys.public_keys())
    try:
        server, address = _server(zctx, keys.credentials(CONTROLLER))
        old_key = keys.public_keys()["executor-0"]
        old, _ = _client(zctx, keys.credentials("executor-0"), keys.public_keys()[CONTROLLER], address)
        old.send(b"before")
        assert server.poll(5000)
        frames = server.recv_multipart(copy=False)
        assert peer_role(frames[-1]) == "executor-0" and peer_key(frames[-1]) == old_key
        assert gatekeeper.admits(old_key)
        new_public, _ = zmq.curve_keypair()
        gatekeeper.admit("executor-0", new_public)            # the replacement's key; the old one is revoked
        old.send(b"after")                                    # on the connection made before: still delivered
        assert server.poll(5000)
        frames = server.recv_multipart(copy=False)
        assert peer_role(frames[-1]) == "executor-0" and peer_key(frames[-1]) == old_key
        assert not gatekeeper.admits(old_key) and gatekeeper.admits(new_public)
    finally:
        gatekeeper.stop()


def test_a_spare_key_revokes_the_role_and_the_spares_before_it_but_not_those_after(zctx):
    # An executor started after executor-1's first replacement lists that one's key under its spare role.
    pairs = {role: zmq.curve_keypair()[0] for role in ("executor-1", "executor-1.r1", "executor-1.r2",
                                                        "executor-1.r3", "executor-2")}
    gatekeeper = Gatekeeper(zctx, pairs)
    try:
        gatekeeper.admit("executor-1", pairs["executor-1.r2"])     # the second replacement registered
        assert [gatekeeper.admits(pairs[r]) for r in ("executor-1", "executor-1.r1", "executor-1.r2",
                                                      "executor-1.r3", "executor-2")] == [False, False, True, True,
                                                                                          True]
    finally:
        gatekeeper.stop()


def test_a_server_without_a_gatekeeper_admits_no_one(keys, zctx):
    """Fail closed: ZAP_ENFORCE_DOMAIN makes a CURVE server with no running allow-list refuse everyone."""
    server, address = _server(zctx, keys.credentials(CONTROLLER))
    dealer, monitor = _client(zctx, keys.credentials(CLIENT), keys.public_keys()[CONTROLLER], address)
    dealer.send(b"hello")
    seen = _events(monitor, HANDSHAKE_FAILURES | {"HANDSHAKE_SUCCEEDED"})
    assert seen and seen[-1] in HANDSHAKE_FAILURES, seen
    assert not server.poll(200)


def test_a_client_refuses_a_server_without_the_expected_key(keys, zctx):
    gatekeeper = Gatekeeper(zctx, keys.public_keys())
    try:
        public, secret = zmq.curve_keypair()
        impostor = Credentials(role=CONTROLLER, keys=KeyPair(public=public, secret=secret), allowed={})
        server, address = _server(zctx, impostor)
        dealer, monitor = _client(zctx, keys.credentials(CLIENT), keys.public_keys()[CONTROLLER], address)
        dealer.send(b"secret plans")
        seen = _events(monitor, HANDSHAKE_FAILURES)
        assert seen and seen[-1] in HANDSHAKE_FAILURES, seen
        assert not server.poll(200)
    finally:
        gatekeeper.stop()


def test_connection_watch_counts_refusals():
    seen = []
    watch = ConnectionWatch("test", lambda event, w: seen.append(event))

    def feed(event):
        watch.on_frames([int(event).to_bytes(2, "little") + (0).to_bytes(4, "little"), b"tcp://127.0.0.1:1"])

    for event in (zmq.EVENT_ACCEPTED, zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_ACCEPTED,
                  zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_ACCEPTED, zmq.EVENT_DISCONNECTED):
        feed(event)
    assert watch.refused == 2             # one refused key, one that never spoke ZMTP
    assert watch.handshake_failures == 1  # libzmq reports junk only as accepted-then-disconnected
    assert seen[0] == "ACCEPTED" and "HANDSHAKE_FAILED_AUTH" in seen


def test_a_failure_without_detail_is_a_rejection_only_when_it_repeats():
    watch = ConnectionWatch("test")

    def feed(event):
        watch.on_frames([int(event).to_bytes(2, "little") + (0).to_bytes(4, "little"), b"tcp://127.0.0.1:1"])

    feed(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    feed(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    assert not watch.rejected                # e.g. a peer that died mid-handshake
    feed(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    feed(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    feed(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    assert not watch.rejected
    feed(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    assert watch.rejected                    # e.g. a server without the key we expect
    feed(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    assert not watch.rejected
    feed(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    assert watch.rejected                    # our key was refused: at once


def test_a_replacement_admits_none_of_the_keys_of_the_incarnations_it_replaces():
    from pathways_torch.wire.security import without_replaced_keys

    allowed = {"controller": b"c", "client": b"k", "executor-0": b"0", "executor-1": b"1", "executor-1.r1": b"a",
               "executor-1.r2": b"b", "executor-10": b"x", "executor-0.r1": b"z"}
    assert without_replaced_keys(allowed, "executor-1", "executor-1.r2") == {
        "controller": b"c", "client": b"k", "executor-0": b"0", "executor-1.r2": b"b", "executor-10": b"x",
        "executor-0.r1": b"z"}


def test_an_executor_whose_key_is_refused_exits_even_if_the_refusal_comes_before_connect_returns(
        keys, zctx, tmp_path, monkeypatch):
    """ZeroMQ refuses a key once: after an authentication failure it does not connect again. On a loaded machine
    that one handshake can be over before the executor's line after ``connect()`` runs; the executor must see it
    all the same and exit (EXIT_REFUSED), not wait unheard for the join timeout."""
    from executor.config import ExecutorConfig
    from executor.process import EXIT_REFUSED, ExecutorProcess

    gatekeeper = Gatekeeper(zctx, keys.public_keys())        # the controller's allow-list: no executor-9 on it
    _, address = _server(zctx, keys.credentials(CONTROLLER))
    (tmp_path / "stranger").mkdir()
    own = KeyDirectory.create(["executor-9"], parent=str(tmp_path / "stranger"))
    with open(os.path.join(own.path, "public", f"{CONTROLLER}.key"), "w") as f:
        f.write(f'curve\n    public-key = "{keys.public_keys()[CONTROLLER].decode()}"\n')
    connect = zmq.Socket.connect

    def connect_then_stall(socket, where):   # the executor descheduled until its handshake was refused
        result = connect(socket, where)
        deadline = time.monotonic() + 10
        while where == address and not gatekeeper.refused and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        return result

    monkeypatch.setattr(zmq.Socket, "connect", connect_then_stall)
    process = ExecutorProcess(ExecutorConfig(controller_address=address, executor_id="executor-9", keys_dir=own.path,
                                             backend="sim"))
    monkeypatch.setattr(zmq.Socket, "connect", connect)
    exits = []

    def record_exit(reason, code=None):
        exits.append((code, reason))
        process.loop.stop()

    monkeypatch.setattr(process, "_exit", record_exit)
    try:
        assert gatekeeper.refused == 1
        loop = threading.Thread(target=process.loop.run_forever, daemon=True)
        loop.start()
        loop.join(10)
        assert exits and exits[0][0] == EXIT_REFUSED, exits
        assert "could not authenticate with the controller" in exits[0][1] and "HANDSHAKE_FAILED_AUTH" in exits[0][1]
    finally:
        process.loop.stop()
        process.gatekeeper.stop()
        gatekeeper.stop()
        process.zmq.destroy(linger=0)


def test_a_server_socket_queues_thousands_of_connections_not_libzmqs_default_100(keys, zctx):
    """The controller's socket takes three connections per executor: with libzmq's backlog of 100, a start of
    1,024 executors overflowed the listen queue 15,186 times and dropped SYNs came back seconds later."""
    socket = make_server(zctx.socket(zmq.ROUTER), keys.credentials(CONTROLLER))
    try:
        assert socket.getsockopt(zmq.BACKLOG) >= 4096
    finally:
        socket.close(linger=0)
