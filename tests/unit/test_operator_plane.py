"""The operator's plane of a standalone controller (issue 46 point 8), with in-process fakes: each lever needs the
admin token (compared in constant time; refused without it or with another, changing nothing, counted), and status
answers from a cache, so a burst of status calls costs a few fan-outs to the executors, not one per call."""

from __future__ import annotations

import threading
import types
from concurrent import futures

import pytest

from controller.admin import Admin
from controller.status import StatusCache, serve_status
from pathways_torch.launch.health import admin, get_status
from pathways_torch.wire import pb
from tests.service import free_port

pytestmark = pytest.mark.timeout(60)

TOKEN = "ab" * 32


class _Clients:
    """What `Admin` reads of a `ClientService`: the sessions, their weights, disconnect, and the loop."""

    def __init__(self, names):
        self.sessions = {name: types.SimpleNamespace(ops=types.SimpleNamespace(arrays={}), requests_served=0,
                                                     last_heard=0.0) for name in names}
        self.weights = {name: 1.0 for name in names}
        self.loop = types.SimpleNamespace(every=lambda interval_s, callback: None)
        self.refused_clients = self.dropped_messages = 0
        self.refusals = {}
        self.clock = lambda: 0.0

    def disconnect(self, name, why):
        return self.sessions.pop(name, None) is not None


class _Controller:
    """What `Admin` and `status_of` read of a controller; ``requests.gather`` counts the fan-outs to the executors."""

    def __init__(self, executors=("executor-0", "executor-1")):
        self.fan_outs = 0
        self.state = types.SimpleNamespace(lock=threading.Lock(), calls={})
        self.admission = types.SimpleNamespace(set_weight=lambda client, weight: None, usage=lambda window_s: {})
        self.resources = types.SimpleNamespace(
            executors={e: types.SimpleNamespace(executor_id=e, lost=False, draining=False, island="0", device="cpu",
                                                backend="eager", epoch=0, last_heard=0.0) for e in executors})
        self.resources.ordered = lambda: list(self.resources.executors.values())
        self.arrays, self.executor_labels = {}, {}
        self.call_dispatch = types.SimpleNamespace(calls_in_flight=0)
        self.requests = types.SimpleNamespace(gather=self.gather)
        self.clock = lambda: 0.0

    def gather(self, kind):
        assert kind == "stats"
        self.fan_outs += 1
        stats = pb.Stats(store_bytes=8 * self.fan_outs)
        return {e: types.SimpleNamespace(stats=stats) for e in self.resources.executors}


def _admin(token=TOKEN):
    controller, clients = _Controller(), _Clients(["alice", "bob"])
    operator = Admin(controller, clients)
    if token:
        operator.use_token(token)
    return operator, controller, clients


REQUESTS = [pb.AdminRequest(set_weight=pb.SetWeight(client="alice", weight=4)), pb.AdminRequest(disconnect="bob"),
            pb.AdminRequest(drain="executor-1")]


@pytest.mark.parametrize("token, says", [(None, "got none; pass pathways-status --keys-dir DIR"),
                                         ("", "got none; pass pathways-status --keys-dir DIR"),
                                         ("cd" * 32, "got another; pass pathways-status --keys-dir DIR"),
                                         (TOKEN[:-1], "got another"), (TOKEN + "0", "got another")])
def test_every_lever_without_the_token_is_refused_and_changes_nothing(token, says):
    operator, controller, clients = _admin()
    for count, request in enumerate(REQUESTS, 1):
        reply = operator.handle(request, token)
        assert not reply.ok and says in reply.message and "admin.token" in reply.message, reply.message
        assert reply.message.startswith(f"{request.WhichOneof('action')} refused: expected the operator's admin token")
        assert operator.refused_requests == count
    assert clients.weights["alice"] == 1.0 and "bob" in clients.sessions
    assert not controller.resources.executors["executor-1"].draining
    assert operator.add_clients(pb.StatusReply()).refused_admin_requests == 3


def test_every_lever_with_the_token_works():
    operator, controller, clients = _admin()
    assert all(operator.handle(request, TOKEN).ok for request in REQUESTS)
    assert clients.weights["alice"] == 4 and "bob" not in clients.sessions
    assert controller.resources.executors["executor-1"].draining and operator.refused_requests == 0


def test_a_controller_without_a_token_takes_no_operator_request():
    operator, _, clients = _admin(token=None)
    reply = operator.handle(REQUESTS[0], TOKEN)
    assert not reply.ok and "started without an admin token" in reply.message and clients.weights["alice"] == 1.0
    with pytest.raises(ValueError, match="got an empty one"):
        operator.use_token("")


def test_the_cache_asks_once_per_age_and_each_caller_gets_its_own_copy():
    now = [0.0]
    made = []

    def compute(with_stats):
        made.append(with_stats)
        return pb.StatusReply(run_id=f"{len(made)}")

    cache = StatusCache(compute, 1.0, clock=lambda: now[0])
    replies = [cache.get(True) for _ in range(1000)]
    assert made == [True] and {r.run_id for r in replies} == {"1"}
    replies[0].clients.add(name="mine")              # the clients are added per reply: no other reply sees them
    assert not cache.get(True).clients
    assert cache.get(False).run_id == "2" and made == [True, False]   # one reply per kind
    now[0] = 0.99
    assert cache.get(True).run_id == "1"
    now[0] = 1.0
    assert cache.get(True).run_id == "3"
    cache.clear()
    assert cache.get(True).run_id == "4"
    with pytest.raises(ValueError, match="expected an age in seconds > 0 and finite, got inf"):
        StatusCache(compute, float("inf"))


def test_a_burst_of_status_calls_over_grpc_costs_a_few_fan_outs_and_levers_need_the_token():
    operator, controller, clients = _admin()
    port = free_port()
    server = serve_status(controller, port, "pathways-controller", admin=operator)
    address = f"127.0.0.1:{port}"
    try:
        with futures.ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda _: get_status(address, with_stats=True), range(1000)))
        assert len(replies) == 1000 and all(len(r.executors) == 2 for r in replies)
        assert 1 <= controller.fan_outs <= 5, controller.fan_outs   # one per second of the burst, at most
        asked = controller.fan_outs
        refused = admin(address, REQUESTS[0])
        assert not refused.ok and "--keys-dir" in refused.message and clients.weights["alice"] == 1.0
        assert get_status(address, with_stats=False).refused_admin_requests == 1
        assert admin(address, REQUESTS[0], token=TOKEN).ok and clients.weights["alice"] == 4
        get_status(address, with_stats=True)
        assert controller.fan_outs == asked + 1     # a lever that changed something empties the cache
    finally:
        server.stop(grace=0)


def test_status_off_loopback_warns_that_anyone_reads_it_and_levers_need_the_token(caplog):
    from pathways_torch.launch.controller_main import _warn_if_status_is_open

    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        _warn_if_status_is_open(host)
    assert not caplog.records
    for host in ("0.0.0.0", "10.1.2.3", "node-0.example"):
        _warn_if_status_is_open(host)
    assert len(caplog.records) == 3
    assert all("is not loopback" in r.message and "admin token" in r.message and "--keys-dir" in r.message
               for r in caplog.records)
