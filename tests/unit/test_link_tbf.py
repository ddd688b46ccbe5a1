"""The link shaped by the kernel: a relay with shaping "tbf" listens in a network namespace behind a veth pair
that tc tbf shapes on both ends, so the kernel sets the rate (the relay's token bucket stays off), every byte
is still counted, and close() deletes the namespace; where tbf cannot be made, "tbf" is refused with the
failing step and "auto" falls back to the relay, saying why. The tests that make namespaces need root and
iproute2 (CI runs as root) and skip, with the reason, elsewhere."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time

import pytest

import pathways_torch as pw
from pathways_torch.local import netns
from pathways_torch.local.link import LinkRelay, LinkShapingError
from tests.unit.test_link import _echo_server, _round_trip

pytestmark = pytest.mark.timeout(60)

_RATE = 4e6
_PAYLOAD = 4 * 2**20


def _tbf_relay(**shape) -> LinkRelay:
    reason = netns.tbf_unavailable()
    if reason is not None:
        pytest.skip(f"tbf cannot be made here: {reason}")
    try:
        return LinkRelay(pw.Link(shaping="tbf", **shape))
    except LinkShapingError as error:
        if "`ip netns add" in str(error):       # no right to make a namespace (a container without CAP_SYS_ADMIN)
            pytest.skip(f"tbf cannot be made here: {error}")
        raise


def _sink():
    """A server that reads one connection to the end; ``done`` gets (bytes, time of the last one)."""
    server = socket.create_server(("127.0.0.1", 0))
    done: list = []

    def serve():
        connection, _ = server.accept()
        with connection:
            received = 0
            while data := connection.recv(1 << 20):
                received += len(data)
                done.append((received, time.perf_counter()))

    threading.Thread(target=serve, daemon=True).start()
    return server, f"tcp://127.0.0.1:{server.getsockname()[1]}", done


def _one_way_rate(relay: LinkRelay, num_bytes: int) -> float:
    """Bytes per second from a sender, through the relay, to a sink (the sink's last byte ends the clock)."""
    server, target, done = _sink()
    host, port = relay.add(target).removeprefix("tcp://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port))) as sender:
            start = time.perf_counter()
            sender.sendall(bytes(num_bytes))
            while not done or done[-1][0] < num_bytes:
                time.sleep(0.005)
        _wait_for(lambda: relay.bytes_to[target] == num_bytes)
        return num_bytes / (done[-1][1] - start)
    finally:
        server.close()


def _wait_for(condition, timeout_s: float = 5.0) -> None:
    # The relay counts a chunk after its send returns: the peer may hold the bytes a moment before.
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the relay's counters"
        time.sleep(0.01)


def _tbf_sent_bytes(veth: netns.TbfVeth, end: str) -> int:
    """What ``tc -s qdisc show`` says tbf has sent on one end of the pair ("root" or "namespace")."""
    where = ([] if end == "root" else ["-n", veth.namespace])
    device = veth.root_device if end == "root" else veth.ns_device
    shown = subprocess.run(["tc", *where, "-s", "qdisc", "show", "dev", device], capture_output=True, text=True,
                           check=True).stdout
    assert "qdisc tbf" in shown and "rate 32Mbit" in shown, shown          # 4 MB/s
    return int(re.search(r"Sent (\d+) bytes", shown).group(1))


def _namespace_exists(name: str) -> bool:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return name in [line.split()[0] for line in listed.splitlines() if line.strip()]


def test_tbf_sets_the_rate_and_the_relays_own_bucket_stays_off():
    relay = _tbf_relay(bandwidth_bytes_per_s=_RATE)
    unshaped = LinkRelay(pw.Link())
    try:
        assert relay.shaping == "tbf" and relay.veth is not None, relay.shaping_reason
        rate = _one_way_rate(relay, _PAYLOAD)
        fast = _one_way_rate(unshaped, _PAYLOAD)
        print(f"4 MiB through tbf at 4 MB/s: {rate / 1e6:.2f} MB/s; unshaped relay: {fast / 1e6:.1f} MB/s")
        assert 0.5 * _RATE <= rate <= 1.3 * _RATE, rate
        assert fast > 3 * _RATE, fast                   # so the range above cannot pass without tbf
        assert relay.bytes_relayed == _PAYLOAD and relay.bytes_metered == 0
        assert _tbf_sent_bytes(relay.veth, "root") >= _PAYLOAD    # the sender's bytes crossed root -> namespace
        assert relay.describe() == (f"tbf on veth (namespace {relay.veth.namespace}), 0 ms one-way (relay), "
                                    f"4 MB/s")
    finally:
        relay.close()
        unshaped.close()


def test_both_directions_cross_a_shaped_end_and_close_deletes_the_namespace():
    relay = _tbf_relay(delay_s=0.02, bandwidth_bytes_per_s=_RATE)
    server, target = _echo_server()
    payload = bytes(range(256)) * 4096                  # 1 MiB each way
    try:
        address = relay.add(target)
        assert address.startswith(f"tcp://{relay.veth.ns_address}:")
        echoed, elapsed = _round_trip(address, payload)
        assert echoed == payload
        assert elapsed >= 2 * 0.02 + len(payload) / _RATE * 0.5, elapsed    # the relay's delay both ways, and tbf
        _wait_for(lambda: relay.bytes_relayed == 2 * len(payload))
        assert relay.bytes_to[target] == 2 * len(payload) and relay.bytes_metered == 0
        assert _tbf_sent_bytes(relay.veth, "root") >= len(payload)
        assert _tbf_sent_bytes(relay.veth, "namespace") >= len(payload)    # the echo crossed namespace -> root
    finally:
        relay.close()
        server.close()
    assert not _namespace_exists(relay.veth.namespace)
    assert subprocess.run(["ip", "link", "show", relay.veth.root_device], capture_output=True).returncode != 0
    relay.close()                                       # twice is harmless


def test_a_dead_runs_namespaces_are_deleted_and_no_other_is_touched():
    if netns.tbf_unavailable() is not None:
        pytest.skip(f"tbf cannot be made here: {netns.tbf_unavailable()}")
    ended = subprocess.Popen(["true"])
    ended.wait()                                        # its pid names a process that is gone
    stale = f"{netns.NAMESPACE_PREFIX}{ended.pid}-0"
    kept = [f"{netns.NAMESPACE_PREFIX}{os.getpid()}-999999",   # this (live) process's
            f"{netns.NAMESPACE_PREFIX}{ended.pid}-x",                      # not a name we make
            f"pathways-test-other-{ended.pid}-0"]                          # another prefix
    made = [name for name in [stale, *kept] if subprocess.run(["ip", "netns", "add", name]).returncode == 0]
    relay = None
    try:
        if stale not in made:
            pytest.skip(f"`ip netns add {stale}` failed: no right to make namespaces here")
        relay = _tbf_relay(bandwidth_bytes_per_s=_RATE)
        assert not _namespace_exists(stale)
        assert all(_namespace_exists(name) for name in kept if name in made)
    finally:
        if relay is not None:
            relay.close()
        for name in made:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def test_where_tbf_cannot_be_made_tbf_is_refused_and_auto_falls_back(monkeypatch):
    monkeypatch.setattr(netns, "tbf_unavailable", lambda: "not root (euid 1000): network namespaces and tc "
                                                          "qdiscs need root")
    with pytest.raises(LinkShapingError, match=r"expected to shape the link with tc tbf .* got: not root "
                                               r"\(euid 1000\).*; fix: run as root"):
        LinkRelay(pw.Link(bandwidth_bytes_per_s=_RATE, shaping="tbf"))
    relay = LinkRelay(pw.Link(delay_s=0.005, bandwidth_bytes_per_s=_RATE))
    try:
        assert relay.shaping == "relay" and relay.veth is None
        assert relay.shaping_reason.startswith("tbf not possible: not root (euid 1000)")
        assert relay.describe() == ("relayed, 5 ms one-way, 4 MB/s (the relay's token bucket; tbf not possible: "
                                    "not root (euid 1000): network namespaces and tc qdiscs need root)")
        assert _one_way_rate(relay, 2**20) <= 1.3 * _RATE
        assert relay.bytes_metered == relay.bytes_relayed == 2**20
    finally:
        relay.close()


def test_a_failing_ip_netns_add_is_named_with_its_stderr(monkeypatch):
    calls = []

    def command(*argv):
        calls.append(argv)
        if argv[:3] == ("ip", "netns", "add"):
            return subprocess.CompletedProcess(argv, 1, "", "mount --make-shared /run/netns failed: Operation "
                                                            "not permitted\n")
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(netns, "tbf_unavailable", lambda: None)
    monkeypatch.setattr(netns, "_command", command)
    with pytest.raises(LinkShapingError, match=r"got: `ip netns add pathways-link-\d+-\d+` failed \(exit 1\): "
                                               r"mount --make-shared /run/netns failed: Operation not permitted; fix"):
        LinkRelay(pw.Link(bandwidth_bytes_per_s=_RATE, shaping="tbf"))
    relay = LinkRelay(pw.Link(bandwidth_bytes_per_s=_RATE))
    relay.close()
    assert relay.shaping == "relay" and "`ip netns add pathways-link-" in relay.shaping_reason
    assert not [argv for argv in calls if argv[:2] in (("ip", "link"), ("tc", "qdisc"))]   # stopped at the failure


@pytest.mark.timeout(10)
def test_iproute2_runs_from_the_system_folders_not_from_path(tmp_path, monkeypatch):
    # A PATH entry that shadows `ip` must not be what a root process runs.
    fake = tmp_path / "ip"
    fake.write_text("#!/bin/sh\necho shadowed\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ.get('PATH', '')}")
    path = netns._tool_path("ip")
    assert path is None or not path.startswith(str(tmp_path)), path
    if path is not None:
        assert "shadowed" not in netns._command("ip", "-V").stdout
