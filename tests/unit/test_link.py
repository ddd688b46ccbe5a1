"""The shaped link's relay: bytes pass unchanged in both directions, each chunk no earlier than the delay,
at most the bandwidth, and every byte is counted."""

from __future__ import annotations

import socket
import threading
import time

import pytest

import pathways_torch as pw
from pathways_torch.local.link import LinkRelay

pytestmark = pytest.mark.timeout(30)


def _echo_server():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def serve():
        connection, _ = server.accept()
        with connection:
            while data := connection.recv(65536):
                connection.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return server, f"tcp://127.0.0.1:{server.getsockname()[1]}"


def _round_trip(relay_address: str, payload: bytes) -> tuple[bytes, float]:
    host, port = relay_address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as client:
        start = time.monotonic()
        client.sendall(payload)
        received = b""
        while len(received) < len(payload):
            received += client.recv(65536)
        return received, time.monotonic() - start


def test_the_relay_delays_counts_and_passes_bytes_unchanged():
    server, address = _echo_server()
    relay = LinkRelay(pw.Link(delay_s=0.05))
    try:
        echoed, elapsed = _round_trip(relay.add(address), b"x" * 1000)
        assert echoed == b"x" * 1000
        assert elapsed >= 0.05                      # one way through the relay (the echo comes back direct)
        # The relay counts a chunk after writing it: the client can read the echo before the count (seen under
        # load), so wait for it a moment.
        deadline = time.monotonic() + 2.0
        while relay.bytes_relayed < 2000 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert relay.bytes_relayed == 2000 and relay.bytes_to[address] == 2000
    finally:
        relay.close()
        server.close()


def test_the_relay_holds_to_its_bandwidth():
    server, address = _echo_server()
    relay = LinkRelay(pw.Link(bandwidth_bytes_per_s=2e6, shaping="relay"))
    try:
        payload = bytes(range(256)) * 4096           # 1 MiB each way: 2 MiB through the relay
        echoed, elapsed = _round_trip(relay.add(address), payload)
        assert echoed == payload
        assert elapsed >= 0.4, elapsed               # 1 MiB at 2 MB/s (less one 64 KiB burst) takes >= 0.49 s
        assert relay.shaping == "relay" and relay.veth is None and relay.bytes_metered == relay.bytes_relayed
        assert relay.describe() == ("relayed, 0 ms one-way, 2 MB/s (the relay's token bucket; shaping='relay' "
                                    "asked for it)")
    finally:
        relay.close()
        server.close()


def test_a_link_refuses_nonsense():
    with pytest.raises(ValueError, match="delay_s must be >= 0"):
        pw.Link(delay_s=-1)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s must be positive"):
        pw.Link(bandwidth_bytes_per_s=0)
    with pytest.raises(ValueError, match="shaping: expected one of 'auto', 'tbf', 'relay', got 'netem'"):
        pw.Link(bandwidth_bytes_per_s=1e6, shaping="netem")
    with pytest.raises(ValueError, match="shaping='tbf' shapes a bandwidth, but bandwidth_bytes_per_s is None"):
        pw.Link(delay_s=0.001, shaping="tbf")


def test_a_link_says_what_it_asks_for():
    assert pw.Link(delay_s=0.005, bandwidth_bytes_per_s=10e6).describe() == "relayed, 5 ms one-way, 10 MB/s"
    assert pw.Link(shaping="relay").describe() == "relayed, 0 ms one-way, unlimited rate, shaping='relay'"


def test_a_fast_links_bucket_holds_two_milliseconds_of_its_rate():
    """A 64 KiB bucket capped every link near 50 MB/s (one relay wake-up writes at most the bucket); the
    bucket holds 2 ms of the rate, at least 64 KiB. (Throughput itself is load-dependent: not timed here.)"""
    fast, slow, unlimited = (LinkRelay(pw.Link(bandwidth_bytes_per_s=rate, shaping="relay"))
                             for rate in (1e9, 1e6, None))
    try:
        assert fast._burst == pytest.approx(2e6) and slow._burst == 64 * 1024 and unlimited._burst == 64 * 1024
    finally:
        for relay in (fast, slow, unlimited):
            relay.close()


def test_a_gone_destination_is_refused_and_the_relay_goes_on_relaying_the_others():
    # A lost executor's peers keep reconnecting to its old relayed port: the relay refuses those connections (as
    # the gone destination would) and must not die of it, which would cut every island off.
    gone = socket.socket()
    gone.bind(("127.0.0.1", 0))
    gone_address = f"tcp://127.0.0.1:{gone.getsockname()[1]}"
    gone.close()                                    # nothing listens there any more
    server, address = _echo_server()
    relay = LinkRelay(pw.Link(delay_s=0.001, shaping="relay"))
    try:
        host, port = relay.add(gone_address).removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as refused:
            refused.settimeout(5)
            assert refused.recv(1) == b""           # closed by the relay
        assert relay.refused[gone_address] == 1
        echoed, _ = _round_trip(relay.add(address), b"still relayed")
        assert echoed == b"still relayed"
    finally:
        relay.close()
        server.close()


def _slow_server(rcvbuf: int = 4096):
    """A destination that accepts and then reads nothing until ``go`` is set; returns what it read by then."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)   # inherited by the accepted socket
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    go, received = threading.Event(), bytearray()

    def serve():
        connection, _ = server.accept()
        with connection:
            go.wait(20)
            while data := connection.recv(65536):
                received.extend(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, f"tcp://127.0.0.1:{server.getsockname()[1]}", go, received, thread


def test_a_slow_destination_holds_the_sender_back_instead_of_growing_the_relays_queue():
    server, address, go, received, reader = _slow_server()
    relay = LinkRelay(pw.Link(delay_s=0.001, shaping="relay"))
    payload = bytes(range(256)) * (32 * 1024)        # 8 MiB: far more than the bound and the kernel's buffers
    try:
        host, port = relay.add(address).removeprefix("tcp://").rsplit(":", 1)
        client = socket.create_connection((host, int(port)))
        client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sent = threading.Event()
        sender = threading.Thread(target=lambda: (client.sendall(payload), sent.set()), daemon=True)
        sender.start()
        time.sleep(1.0)                               # the destination reads nothing meanwhile
        assert not sent.is_set(), "the relay took all 8 MiB from the sender: no back-pressure"
        assert 0 < relay.queue_high_water <= relay.queue_limit, (relay.queue_high_water, relay.queue_limit)
        go.set()                                      # the destination reads again: every byte arrives, in order
        sender.join(20)
        client.close()                                # what the relay still holds goes out before it closes
        reader.join(20)
        assert bytes(received) == payload
        assert relay.queue_high_water <= relay.queue_limit
    finally:
        go.set()
        relay.close()
        server.close()


def test_the_queue_bound_is_two_bursts_or_what_the_delay_keeps_in_flight():
    # A burst is the bucket (2 ms of the rate, at least 64 KiB), or, when more, what the delay holds in flight at
    # the rate: a smaller bound would cap a delayed link below its rate.
    for link, expected in ((pw.Link(shaping="relay"), 2 * 64 * 1024),
                           (pw.Link(bandwidth_bytes_per_s=1e9, shaping="relay"), 2 * 2e6),
                           (pw.Link(delay_s=0.005, bandwidth_bytes_per_s=100e6, shaping="relay"), 2 * 500e3)):
        relay = LinkRelay(link)
        try:
            assert relay.queue_limit == int(expected), (link, relay.queue_limit)
        finally:
            relay.close()


def test_an_error_in_one_connection_closes_that_connection_and_the_relay_serves_the_others(caplog):
    doomed_server, doomed = _echo_server()
    server, address = _echo_server()
    relay = LinkRelay(pw.Link(shaping="relay"))
    original = relay._allowed

    def failing(direction, now, wanted):
        if direction.target == doomed:
            raise RuntimeError("a bug in the relay")
        return original(direction, now, wanted)

    relay._allowed = failing
    try:
        host, port = relay.add(doomed).removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as victim:
            victim.settimeout(5)
            victim.sendall(b"boom")
            try:
                assert victim.recv(1) == b""              # closed by the relay
            except ConnectionResetError:
                pass
        assert relay.failed_connections == 1
        assert "relaying a connection to " + doomed + " failed" in caplog.text
        assert relay._thread.is_alive()
        echoed, _ = _round_trip(relay.add(address), b"still relayed")
        assert echoed == b"still relayed"
    finally:
        relay.close()
        server.close()
        doomed_server.close()


def test_an_owners_new_port_removes_its_old_one_and_its_connections():
    old_server, old = _echo_server()
    server, new = _echo_server()
    relay = LinkRelay(pw.Link(shaping="relay"))
    try:
        old_port = relay.add(old, owner="executor-1")
        host, port = old_port.removeprefix("tcp://").rsplit(":", 1)
        held = socket.create_connection((host, int(port)))
        held.settimeout(5)
        held.sendall(b"x")
        assert held.recv(1) == b"x"                       # relayed while the old incarnation stands
        new_port = relay.add(new, owner="executor-1")     # its replacement registered at a new address
        deadline = time.monotonic() + 5
        while relay.listeners != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert relay.listeners == 1
        try:
            assert held.recv(1) == b""                    # its connection was closed with its port
        except ConnectionResetError:
            pass
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, int(port)), timeout=2).close()
        echoed, _ = _round_trip(new_port, b"to the replacement")
        assert echoed == b"to the replacement"
        relay.remove(new)
        while relay.listeners and time.monotonic() < deadline:
            time.sleep(0.01)
        assert relay.listeners == 0
    finally:
        relay.close()
        server.close()
        old_server.close()
