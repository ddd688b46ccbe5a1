"""The shaped link's relay: bytes pass unchanged in both directions, each chunk no earlier than the delay,
at most the bandwidth, and every byte is counted."""

from __future__ import annotations

import socket
import threading
import time

import pytest

import pathways_torch as pw
from pathways_torch.link import LinkRelay

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
