"""A tenant's traffic never works the controller's I/O threads for it (issue 46, C2 and M1).

One `pathways-controller` of 2 eager executors with a 2 s heartbeat timeout serves alice (a real remote context,
measuring the latency of an awaited call) and bob, who sends raw seam messages from his own valid key on a DEALER
of his own. Before the change, a 12 MB message was decoded on the one I/O thread that also answers executors'
heartbeats (6.6 s): every executor was declared lost and alice got `ControllerLostError`.
"""

from __future__ import annotations

import time

import pytest
import torch
import zmq

import pathways_torch as pw
from pathways_torch.launch.health import get_status
from pathways_torch.wire import seam_codec
from pathways_torch.wire.security import KeyDirectory, make_client
from tests.conftest import wait_until
from tests.service import ControllerProcess, open_context
from pathways_torch.wire.seam import Call, NewArray, RegisterFunction
from tests.handles import client_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

CAP = 8 << 20
PING = seam_codec.encode({"r": 0, "op": "ping", "a": []})


def _lists(request_id: int, count: int) -> list:
    """A call whose argument is ``count`` empty lists, written as the seam's JSON directly (encoding them is slow)."""
    return [b'{"$d":[["r",%d],["op","call"],["a",[[' % request_id + b"[]," * count + b'[]],[]]]]}']


@pw.function
def doubled(a):
    return a * 2


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    process = ControllerProcess(str(tmp_path_factory.mktemp("flood") / "keys"), num_executors=2, status_port=True,
                                args=["--heartbeat-interval-s", "0.2", "--heartbeat-timeout-s", "2",
                                      "--max-queued-requests", "4096"])
    yield process
    process.stop()


@pytest.fixture(scope="module")
def alice(service):
    with open_context("remote", service, client="alice", heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0) as ctx:
        yield ctx


class RawClient:
    """Bob's own DEALER with his own key: seam messages as he likes, answers read back."""

    def __init__(self, service, name: str = "bob"):
        self.context = zmq.Context()
        credentials = KeyDirectory(service.keys(name)).credentials(f"client-{name}")
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        make_client(self.socket, credentials, credentials.public_key("controller"))
        self.socket.connect(service.address)

    def send(self, frames) -> None:
        self.socket.send_multipart(frames)

    def answers(self, timeout_s: float, until=lambda messages: False) -> list:
        """What comes back until ``until(messages)`` or ``timeout_s``; bob pings meanwhile, as a client does."""
        messages, deadline = [], time.monotonic() + timeout_s
        while True:
            self.send(PING)
            while self.socket.poll(0 if timeout_s == 0 else 100):
                messages.append(seam_codec.decode(self.socket.recv_multipart()))
            if time.monotonic() >= deadline or until(messages):
                return messages

    def close(self) -> None:
        self.socket.close()
        self.context.term()


def _doubles(ctx, mesh) -> bool:
    return torch.equal(doubled(ctx.put(torch.ones(4), mesh, [pw.Shard(0)])).result(30), torch.full((4,), 2.0))


def _all_alive(service) -> bool:
    return all(e.state == "alive" for e in get_status(service.status, with_stats=False).executors)


def test_a_message_over_the_cap_is_refused_and_costs_no_executor(service, alice):
    mesh = alice.mesh({"data": 2})
    bob = RawClient(service)
    try:
        # 12 MB of [[],[],...]: 6.6 s and 300 MB on the controller's only I/O thread before the change
        bob.send(_lists(7, 4 << 20))
        answers = bob.answers(10, until=lambda m: any(a.get("r") == 7 for a in m))
        bob.send(seam_codec.encode({"r": 9, "op": "flush_frees", "a": [b"\0" * (16 << 20)]}))   # 16 MB in a frame
        answers += bob.answers(10, until=lambda m: any(a.get("r") == 9 for a in m))
        assert "at most" in str(next(a for a in answers if a.get("r") == 9)["err"])
        refusal = next(a for a in answers if a.get("r") == 7)["err"]
        assert isinstance(refusal, ValueError)
        assert f"expected at most {CAP}" in str(refusal) and "--max-client-message-bytes" in str(refusal)
        # Under the cap but millions of lists: refused on bob's own worker, before a list is built
        bob.send(_lists(8, 2 << 20))
        answers = bob.answers(10, until=lambda m: any(a.get("r") == 8 for a in m))
        assert "lists and objects" in str(next(a for a in answers if a.get("r") == 8)["err"])
        assert _doubles(alice, mesh)   # meanwhile: bob's silence while alice waits is his own (he is cut off)
    finally:
        bob.close()
    assert _all_alive(service)
    assert _doubles(alice, mesh)


def test_twenty_thousand_junk_messages_cost_no_executor_and_little_latency(service, alice):
    """Alice's awaited calls go on, right, while the controller works through bob's flood (from his first junk
    message until his probe behind them is answered)."""
    mesh = alice.mesh({"data": 2})
    x = alice.put(torch.arange(4.0), mesh, [pw.Shard(0)])
    bob = RawClient(service)
    junk = [[b"not json"], [b'{"$d":[["r",0],["op","nope"]]}'], seam_codec.encode({"r": 0, "op": "call", "a": [1]}),
            [b'{"$d":[["r",0],["op","executors"],["a",[]]]}', b"extra"]]
    try:
        for i in range(20_000):
            bob.send(junk[i % len(junk)])
        bob.send(seam_codec.encode({"r": 99, "op": "executors", "a": []}))
        samples, answers, deadline = [], [], time.monotonic() + 60
        while time.monotonic() < deadline and not any(a.get("r") == 99 or a.get("ev") == "disconnected"
                                                      for a in answers):
            start = time.perf_counter()
            assert torch.equal(doubled(x).result(30), torch.arange(4.0) * 2)
            samples.append((time.perf_counter() - start) * 1000)
            answers += bob.answers(0)   # and a ping: bob is a live client, only a noisy one
        # served in order behind the junk (his queue holds 4,096 here), or cut off with the reason: only bob pays
        assert any(a.get("r") == 99 and "ok" in a for a in answers) or any(
            "sent faster than it is served" in a.get("why", "") for a in answers if a.get("ev") == "disconnected")
    finally:
        bob.close()
    assert _all_alive(service) and samples   # alice's calls went on meanwhile (their latency: bench/tenant_flood.py)


def test_a_client_past_its_queue_bound_is_disconnected_with_the_reason(service, alice):
    bob = RawClient(service, name="carol")
    try:
        stuck = seam_codec.encode({"r": 0, "op": "wait_for_executors", "a": [99, 30.0]})   # parks carol's worker
        bob.send(stuck)
        for _ in range(5000):
            bob.send(seam_codec.encode({"r": 0, "op": "counters", "a": []}))
        answers = bob.answers(20, until=lambda m: any(a.get("ev") == "disconnected" for a in m))
        why = next(a["why"] for a in answers if a.get("ev") == "disconnected")
        assert "sent faster than it is served" in why and "4096 requests" in why
    finally:
        bob.close()
    assert wait_until(lambda: "carol" not in {c.name for c in get_status(service.status, False).clients}, 10)
    assert _all_alive(service)
    mesh = alice.mesh({"data": 2})
    assert _doubles(alice, mesh)


def test_calls_that_never_end_hold_neither_the_island_nor_anothers_run_ahead(service, alice):
    """Found by bench/fuzz_service.py: bob's calls on an array he never puts never end. They held the island's 16
    admission slots and the shared run-ahead bound for good, and alice's next call never ran. Now their slots go
    back after the hold (10 s), charged to bob, and run-ahead is bounded per client."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from pathways_torch.wire.graph_schema import encode_graph
    from pathways_torch.wire.seam import CallSpec

    with open_context("remote", service, client="bob", backend="eager", heartbeat_interval_s=0.2,
                      heartbeat_timeout_s=2.0) as bob:
        mesh = bob.mesh({"data": 2})
        never = client_of(bob).request(NewArray(list(mesh.executor_ids), landing=2, shard_bytes=8))[0]   # never put
        graph, constants = encode_graph(make_fx(lambda x: x + 1)(torch.zeros(2)))
        function_id = client_of(bob).request(RegisterFunction("stuck", graph, list(constants)))
        for _ in range(40):
            client_of(bob).request(Call(CallSpec(function_id=function_id, name="stuck", mesh=mesh.allocation,
                                      inputs=(never.array_id,), num_outputs=1, output_shard_bytes=(8,))))
        start = time.monotonic()
        assert _doubles(alice, alice.mesh({"data": 2}))
        assert time.monotonic() - start < 20.0
    # bob left: the put he never sent never will come, so his calls end (they failed), and his name starts afresh
    assert wait_until(lambda: get_status(service.status, with_stats=False).calls_in_flight == 0, 20)
    with open_context("remote", service, client="bob", backend="eager", heartbeat_interval_s=0.2,
                      heartbeat_timeout_s=2.0) as bob:
        assert _doubles(bob, bob.mesh({"data": 2}))


def test_a_bye_with_bad_arguments_ends_nothing(service):
    """Found by bench/fuzz_service.py: a refused bye still ended the session, silently (a real bye is not answered),
    and every later request of the client went unanswered."""
    carol = RawClient(service, name="carol")
    try:
        carol.send(seam_codec.encode({"r": 0, "op": "bye", "a": [1]}))
        carol.send(seam_codec.encode({"r": 5, "op": "counters", "a": []}))
        answers = carol.answers(10, until=lambda m: any(a.get("r") == 5 for a in m))
        assert any(a.get("r") == 5 and "ok" in a for a in answers), answers
    finally:
        carol.close()
