"""``pathways-run --controller ADDR``: a node's executors join a standalone ``pathways-controller`` started without
executors (docs/launch.md, "Joining a standalone controller"). The node runs no script; a remote client computes on
its executors; SIGTERM stops them and the node exits 0. When its executors all exit without being asked (the
controller stopped), the node exits 1 naming each one's exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

import pathways_torch as pw
from tests.conftest import REPO_ROOT, process_gone, wait_until
from tests.service import ControllerProcess, free_port, open_context

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pw.function
def doubled(a):
    return a * 2


def _join(service: ControllerProcess, *flags: str) -> subprocess.Popen:
    """``pathways-run`` node 0 of 1 with 2 executors, joining ``service`` with its executors' keys."""
    return subprocess.Popen(
        [sys.executable, "-m", "pathways_torch.launch.run", "--nnodes", "1", "--nproc-per-node", "2",
         "--node-rank", "0", "--controller", service.executor_address,
         "--keys-dir", os.path.join(service.keys_dir, "executors"), "--backend", "eager", *flags],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _service(tmp_path) -> tuple[ControllerProcess, str]:
    """A controller started without executors (keys for 2), and its status address."""
    status = f"127.0.0.1:{free_port()}"
    return ControllerProcess(str(tmp_path / "keys"), clients=("alice",), num_executors=0, executor_keys=2,
                             args=["--status-port", status.rsplit(":", 1)[1]]), status


def _joined(status: str) -> bool:
    """Both executors registered and answered the controller's Stats request. That request follows the Welcome on
    their command socket, so each has its put secret by then: a client's put that reaches an executor before its
    Welcome is refused ("no put secret from the controller yet"), and the put's array never completes."""
    import grpc

    from pathways_torch.launch.health import get_status

    try:
        reply = get_status(status, with_stats=True, timeout_s=5)
    except grpc.RpcError:
        return False
    return not reply.stats_error and sorted((e.executor_id, e.state) for e in reply.executors) == [
        ("executor-0", "alive"), ("executor-1", "alive")]


def _stop(node: subprocess.Popen) -> str:
    """Kill ``node`` if it still runs; its output not read yet."""
    if node.poll() is None:
        node.kill()
    return "" if node.stdout.closed else node.communicate(timeout=30)[0]


def test_a_pathways_run_node_serves_a_standalone_controllers_clients_until_sigterm(tmp_path):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    service, status = _service(tmp_path)
    health_port = free_port()
    node = _join(service, "--health-port", str(health_port))
    try:
        assert wait_until(lambda: _joined(status), 60, 0.2)
        with open_context("remote", service, "alice", num_executors=2, backend="eager") as alice:
            assert sorted(alice.executor_ids) == ["executor-0", "executor-1"]
            pids = alice.executor_pids
            x = alice.put(torch.arange(4.0), alice.mesh({"data": 2}), [pw.Shard(0)])
            assert doubled(x).result(30).tolist() == [0.0, 2.0, 4.0, 6.0]
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:   # the node's health, as a probe asks
            check = health_pb2_grpc.HealthStub(channel).Check
            for name in ("", "executor-0", "executor-1"):
                assert check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == \
                    health_pb2.HealthCheckResponse.SERVING, name
        assert node.poll() is None                     # the client left: the node goes on serving
        node.send_signal(signal.SIGTERM)
        assert node.wait(30) == 0, _stop(node)
        assert wait_until(lambda: all(process_gone(pid) for pid in pids), 10), pids
        output = node.communicate(timeout=30)[0]
        assert "joining " + service.executor_address in output and "no script runs here" in output, output
        assert "stopped its executors executor-0, executor-1" in output, output
    finally:
        print("pathways-run:", _stop(node), "pathways-controller:", *service.output, sep="\n")   # shown on failure
        service.stop()


def test_a_node_whose_executors_all_exit_fails_naming_each(tmp_path):
    service, status = _service(tmp_path)
    node = _join(service)
    try:
        assert wait_until(lambda: _joined(status), 60, 0.2)
        assert service.stop() == 0                      # it tells its executors to stop
        assert node.wait(30) == 1, _stop(node)
        output = node.communicate(timeout=30)[0]
        for name in ("executor-0", "executor-1"):
            assert f"node 0: {name} (pid " in output, output
        assert f"every executor of this node has exited; it no longer serves {service.executor_address}" in output
    finally:
        print("pathways-run:", _stop(node), "pathways-controller:", *service.output, sep="\n")   # shown on failure
        service.stop()
