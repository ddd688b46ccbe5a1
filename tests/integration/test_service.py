"""A standalone controller serving several clients (`pathways-controller`, docs/service.md): the operator's status
and levers over gRPC, a client that dies or is disconnected, bad input, an executor drained, and SIGTERM.

One controller of 3 eager executors serves the module (heartbeat timeout 2 s); the drain test runs last.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import pathways_torch as pw
from controller.config import ServiceConfig
from pathways_torch.launch.health import admin, clients_table, get_status
from pathways_torch.launch.health import main as pathways_status
from pathways_torch.launch.service_keys import admin_token, make_service_keys
from pathways_torch.wire import pb, seam
from tests.conftest import REPO_ROOT, process_gone, wait_until
from tests.service import ControllerProcess, open_context

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LIVENESS = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0}


@pw.function
def doubled(a):
    return a * 2


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    process = ControllerProcess(str(tmp_path_factory.mktemp("svc") / "keys"), num_executors=3, status_port=True,
                                args=["--heartbeat-interval-s", "0.2", "--heartbeat-timeout-s", "2",
                                      "--weights", "bob=2"])
    yield process
    process.stop()


def _health(address: str) -> str:
    """The standard gRPC health check (service ""), as a probe asks it."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _clients(service) -> dict:
    return {c.name: c for c in get_status(service.status, with_stats=False).clients}


def _store_bytes(service) -> int:
    return sum(e.store_bytes for e in get_status(service.status).executors)


def _store_bytes_now(service) -> int:
    """Not from the status cache: once a cached answer has aged out (a baseline to compare with)."""
    time.sleep(ServiceConfig.status_cache_s)
    return _store_bytes(service)


def _operator(service, request):
    """The operator's request, with the admin token of the service's keys (as pathways-status --keys-dir DIR)."""
    return admin(service.status, request, token=admin_token(service.keys_dir))


def test_status_lists_clients_and_only_the_operator_sets_weights(service):
    with open_context("remote", service, "alice", backend="eager") as alice, \
            open_context("remote", service, "bob", backend="eager") as bob:
        for ctx in (alice, bob):
            assert ctx.put(torch.ones(4), ctx.mesh({"data": 2}), [pw.Shard(0)]).result(30).sum() == 4
        clients = _clients(service)
        assert sorted(clients) == ["alice", "bob"] and clients["alice"].weight == 1 and clients["bob"].weight == 2
        reply = _operator(service, pb.AdminRequest(set_weight=pb.SetWeight(client="alice", weight=4)))
        assert reply.ok and _clients(service)["alice"].weight == 4
        for client, weight, says in [("zed", 1.0, "no such client is connected; connected: ['alice', 'bob']"),
                                     ("alice", 0.0, "expected a finite number in [1e-06, 1e+06], got 0.0"),
                                     ("alice", -2.0, "expected a finite number in [1e-06, 1e+06], got -2.0"),
                                     ("alice", 5e-324, "expected a finite number in [1e-06, 1e+06], got 5e-324"),
                                     ("alice", float("inf"), "expected a finite number in [1e-06, 1e+06], got inf")]:
            reply = _operator(service, pb.AdminRequest(set_weight=pb.SetWeight(client=client, weight=weight)))
            assert not reply.ok and says in reply.message, reply.message
        assert _health(service.status) == "SERVING"
        table = clients_table(get_status(service.status, with_stats=False))
        assert "alice  | 4 (67%)" in table and "bob    | 2 (33%)" in table, table
        # nothing a client may send sets a weight: the seam has no such request, and the service builds every
        # request it reads with op_from_wire (a wire message naming another is refused: test_tenant_flood's junk)
        assert "set_weight" not in seam.OPS
        with pytest.raises(TypeError, match="expected one of"):
            seam.op_from_wire("set_weight", ["bob", 100.0])
    assert wait_until(lambda: not _clients(service), 10), "a client that closed is not listed"


_REMOTE_ONLY = """
import sys, torch, pathways_torch as pw
with pw.Context(controller=sys.argv[1], keys=sys.argv[2], backend="eager") as ctx:
    mesh = ctx.mesh({"data": 2})
    doubled = pw.function(lambda a: a * 2)
    assert doubled(ctx.put(torch.arange(4.0), mesh, [pw.Shard(0)])).result(30).tolist() == [0.0, 2.0, 4.0, 6.0]
print("loaded:", sorted(m for m in sys.modules if m.split(".")[0] == "controller" or m == "pathways_torch.client"))
"""


def test_a_remote_client_process_never_loads_the_controller_or_the_embedded_client(service):
    """A remote context's call path goes through the wire alone (issue 48, point 2): the process that puts, calls
    and fetches imports neither `controller` nor the embedded client."""
    done = subprocess.run([sys.executable, "-c", _REMOTE_ONLY, service.address, service.keys("carol")],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "loaded: []" in done.stdout, done.stdout


def test_a_disconnected_client_fails_at_once_and_what_it_held_is_freed(service):
    with open_context("remote", service, "bob", backend="eager") as bob:
        bob_mesh = bob.mesh({"data": 2})
        kept = bob.put(torch.arange(8.0), bob_mesh, [pw.Shard(0)])
        kept.result(30)   # landed on both executors (the first put to each opens its data socket)
        baseline = _store_bytes_now(service)
        with open_context("remote", service, "alice", backend="eager") as alice:
            mesh = alice.mesh({"data": 2})
            big = alice.put(torch.ones(512, 1024), mesh, [pw.Shard(0)])   # 2 MiB
            assert big.result(30).sum() == 512 * 1024
            assert wait_until(lambda: _store_bytes(service) >= baseline + 2 * 2**20, 5)   # status: a cache <= 1 s old
            assert _operator(service, pb.AdminRequest(disconnect="alice")).ok
            with pytest.raises(pw.ControllerLostError, match="disconnected this client"):
                for _ in range(500):   # until the news arrives (at once: it is sent before anything is freed)
                    doubled(big).result(timeout_s=10)
                    time.sleep(0.01)
        assert wait_until(lambda: _store_bytes(service) <= baseline, 10), (_store_bytes(service), baseline)
        assert kept.result(30).tolist() == list(range(8))   # bob goes on
        reply = _operator(service, pb.AdminRequest(disconnect="alice"))
        assert not reply.ok and "no such client is connected" in reply.message


def test_a_killed_client_is_cleaned_up_within_the_heartbeat_bound_and_the_others_go_on(service):
    with open_context("remote", service, "bob", backend="eager") as bob:
        mesh = bob.mesh({"data": 2})
        x = bob.put(torch.arange(16.0).reshape(4, 4), mesh, [pw.Shard(0)])
        x.result(30)   # landed on both executors (the first put to each opens its data socket)
        baseline = _store_bytes_now(service)
        child = subprocess.Popen([sys.executable, os.path.join(REPO_ROOT, "tests/integration/service_client_script.py"),
                                  service.address, service.keys("carol")], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        try:
            assert wait_until(lambda: "carol" in _clients(service), 60)
            assert child.stdout.readline().strip() == "READY"
            # 4 puts and 4 results, 1 MiB each (status answers from a cache at most 1 s old)
            assert wait_until(lambda: _store_bytes(service) >= baseline + 8 * 2**20 * 0.9, 5)
            child.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            assert wait_until(lambda: "carol" not in _clients(service), 10)
            assert wait_until(lambda: _store_bytes(service) <= baseline, 10)
            assert time.monotonic() - killed < 2 * LIVENESS["heartbeat_timeout_s"] + 1
        finally:
            child.kill()
            child.wait()
        assert doubled(x).result(30).sum() == 2 * 120


def test_bad_input_names_what_was_asked_and_what_exists(service, tmp_path):
    with pytest.raises(pw.PlacementError, match=r"num_executors=9\): the controller at .* has 3 executors"):
        pw.Context(controller=service.address, keys=service.keys("alice"), num_executors=9, start_timeout_s=1)
    with open_context("remote", service, "alice", backend="eager") as alice:
        with pytest.raises(pw.PlacementError, match="needs 8 executors|has islands|live executors"):
            alice.mesh({"data": 8})
    with pytest.raises(ValueError, match="drop them"):
        pw.Context(controller=service.address, keys=service.keys("alice"), islands=[1, 1])
    stranger = ControllerProcess._run(["--make-keys", str(tmp_path / "other"), "--clients", "alice"])
    del stranger
    refused = get_status(service.status, with_stats=False).refused_clients
    with pytest.raises(pw.AuthenticationError, match="refused this client's key"):
        pw.Context(controller=service.address, keys=str(tmp_path / "other" / "clients" / "alice"), **LIVENESS)
    assert get_status(service.status, with_stats=False).refused_clients > refused


def test_calls_from_two_clients_match_eager_while_both_run(service):
    gc.collect()
    with open_context("remote", service, "alice", backend="eager") as alice, \
            open_context("remote", service, "bob", backend="eager") as bob:
        results = {}
        for name, ctx in (("alice", alice), ("bob", bob)):
            torch.manual_seed(len(name))
            data = torch.randn(6, 4)
            mesh = ctx.mesh({"data": 2})
            y = ctx.put(data, mesh, [pw.Shard(0)])
            outs = [pw.function(lambda a: a.sin() * 2, name=f"f_{name}")(y) for _ in range(20)]
            results[name] = (data, outs)
        for data, outs in results.values():
            for out in outs:
                assert torch.equal(out.result(30), data.sin() * 2)


def test_without_the_admin_token_no_lever_moves_and_with_keys_dir_each_does(service, tmp_path, capsys):
    """Issue 46 point 8 (M3): anyone on the host reaches the status port, and another service's keys are no key here;
    each lever is refused without this service's token, naming --keys-dir, and nothing changes."""
    other = make_service_keys(str(tmp_path / "other"), ["alice", "bob"], executors=1).root
    with open_context("remote", service, "alice", backend="eager") as alice, \
            open_context("remote", service, "bob", backend="eager") as bob:
        x = bob.put(torch.arange(4.0), bob.mesh({"data": 2}), [pw.Shard(0)])
        assert doubled(x).result(30).tolist() == [0.0, 2.0, 4.0, 6.0]
        weight = _clients(service)["alice"].weight
        refused = get_status(service.status, with_stats=False).refused_admin_requests
        for lever in (["--set-weight", "alice=8"], ["--disconnect", "bob"], ["--drain", "executor-1"]):
            for keys in ([], ["--keys-dir", other]):
                assert pathways_status([service.status, *lever, *keys]) == 2, lever + keys
                said = capsys.readouterr().out
                assert "refused: expected the operator's admin token" in said and "--keys-dir DIR" in said, said
        time.sleep(ServiceConfig.status_cache_s)   # no cached answer hides a change
        status = get_status(service.status, with_stats=False)
        assert {c.name: c.weight for c in status.clients} == {"alice": weight, "bob": _clients(service)["bob"].weight}
        assert {e.executor_id: e.state for e in status.executors}["executor-1"] == "alive"
        assert status.refused_admin_requests == refused + 6
        assert f"{refused + 6} operator request(s) without the admin token refused" in clients_table(status)
        assert doubled(x).result(30).tolist() == [0.0, 2.0, 4.0, 6.0]   # bob is still served
        assert pathways_status([service.status, "--set-weight", "alice=3", "--keys-dir", service.keys_dir]) == 0
        assert "done: alice's weight is 3" in capsys.readouterr().out
        assert _clients(service)["alice"].weight == 3 and "alice" in {c.name for c in status.clients}


def test_drained_executor_takes_no_new_work_and_is_removed_once_idle(service):
    with open_context("remote", service, "alice", backend="eager") as alice:
        whole = alice.mesh({"data": 3})
        x = alice.put(torch.ones(3), whole, [pw.Shard(0)])
        reply = _operator(service, pb.AdminRequest(drain="executor-2"))
        assert reply.ok, reply.message
        assert wait_until(lambda: {e.executor_id: e.state for e in get_status(service.status, False).executors}
                          ["executor-2"] == "removed", 10)
        with pytest.raises(pw.ExecutorLostError, match="executor-2"):
            doubled(x).result(timeout_s=10)
        pair = alice.mesh({"data": 2})
        assert pair.executor_ids == ("executor-0", "executor-1") or "executor-2" not in pair.executor_ids
        assert alice.put(torch.ones(2), pair, [pw.Shard(0)]).result(10).sum() == 2
        reply = _operator(service, pb.AdminRequest(drain="executor-9"))
        assert not reply.ok and "no such executor" in reply.message


def test_sigterm_fails_every_client_at_once_and_the_executors_exit(tmp_path):
    service = ControllerProcess(str(tmp_path / "keys"), num_executors=1, args=["--heartbeat-timeout-s", "30"])
    try:
        with open_context("remote", service, "alice", backend="eager", heartbeat_timeout_s=30) as alice:
            pids = alice.executor_pids
            x = alice.put(torch.ones(2), alice.mesh({"data": 1}), [pw.Shard(0)])
            assert x.result(30).sum() == 2
            service.process.send_signal(signal.SIGTERM)
            began = time.monotonic()
            with pytest.raises(pw.ControllerLostError, match="stopped"):
                for _ in range(1000):   # until the news arrives: far sooner than the 30 s heartbeat timeout
                    doubled(x).result(timeout_s=5)
                    time.sleep(0.01)
            assert time.monotonic() - began < 5
        assert service.process.wait(30) == 0
        assert wait_until(lambda: all(process_gone(pid) for pid in pids), 15)
    finally:
        service.stop()


def test_executors_that_join_a_controller_serve_its_clients(tmp_path):
    service = ControllerProcess(str(tmp_path / "keys"), num_executors=0, executor_keys=2)
    joined = [subprocess.Popen([sys.executable, "-m", "executor", "--controller", service.executor_address,
                                "--id", f"executor-{i}", "--keys-dir", os.path.join(service.keys_dir, "executors"),
                                "--backend", "eager"], cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL) for i in range(2)]
    try:
        with open_context("remote", service, "alice", num_executors=2, backend="eager") as alice:
            assert sorted(alice.executor_ids) == ["executor-0", "executor-1"]
            x = alice.put(torch.arange(4.0), alice.mesh({"data": 2}), [pw.Shard(0)])
            assert doubled(x).result(30).tolist() == [0.0, 2.0, 4.0, 6.0]
    finally:
        service.stop()
        for process in joined:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()


def test_a_controller_that_dies_fails_every_pending_future_within_the_heartbeat_bound(tmp_path):
    service = ControllerProcess(str(tmp_path / "keys"), num_executors=1, args=["--heartbeat-timeout-s", "2"])
    try:
        with open_context("remote", service, "alice", backend="eager", **LIVENESS) as alice:
            x = alice.put(torch.ones(2), alice.mesh({"data": 1}), [pw.Shard(0)])
            assert doubled(x).result(30).sum() == 4           # registered: the next call is not waited for
            service.process.send_signal(signal.SIGKILL)      # no word from it: only its silence tells
            began = time.monotonic()
            pending = doubled(x)
            with pytest.raises(pw.ControllerLostError, match="has not answered"):
                pending.result(timeout_s=30)
            assert time.monotonic() - began < LIVENESS["heartbeat_timeout_s"] + 2
            with pytest.raises(pw.ControllerLostError):
                doubled(x)                                    # and every request after
    finally:
        service.stop()
