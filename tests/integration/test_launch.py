"""pathways-run launches for real: the example under --standalone gives the losses of a plain ``python`` run;
two "hosts" on distinct loopback addresses (127.0.0.1 and 127.0.0.2), each with only its own key folder, train
together and match eager; a node stopped by its scheduler fails the script with an error naming that node; a
node that never joins is named with the address it was told to reach; nothing is left running."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO_ROOT, listening_tcp, on_loopback

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RUN = [sys.executable, "-m", "pathways_torch.launch.run"]

SCRIPT = os.path.join(os.path.dirname(__file__), "launched_training.py")


def _eager_losses(steps: int) -> list[float]:
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g, dtype=torch.float64),
                torch.randn(8, 1, generator=g, dtype=torch.float64)) for _ in range(steps)]
    from tests.conftest import train_eagerly

    return train_eagerly(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, nn.MSELoss())


def _lines(text: str) -> list[dict]:
    """The script's JSON records (stderr shares the pipe: a log line may follow a record on its line)."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(line)[0] for line in text.splitlines() if line.startswith("{")]


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children ...), from /proc/PID/stat."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):   # gone meanwhile
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _left_running(marker: str) -> list[str]:
    """Processes whose command line mentions ``marker`` (this test's key folder or script)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and int(pid) != os.getpid():
            found.append(f"{pid}: {cmdline[:200]}")
    return found


@pytest.fixture()
def two_hosts(tmp_path):
    """The run's keys for 2 nodes x 1 executor, the script, and a launcher per node."""
    keys = str(tmp_path / "keys")
    subprocess.run([*RUN, "--make-keys", keys, "--nnodes", "2", "--nproc-per-node", "1"], check=True,
                   capture_output=True, timeout=60)
    script = SCRIPT

    def launch(node: int, *script_args, port: int, extra=(), script=script, environ=()):
        environ = dict(os.environ, RANK=str(node), WORLD_SIZE="2", LOCAL_RANK="0", **dict(environ))
        return subprocess.Popen(
            [*RUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr", "127.0.0.1",
             "--master-port", str(port), "--host-addr", f"127.0.0.{node + 1}", "--keys-dir",
             os.path.join(keys, f"node-{node}"), "--backend", "eager", *extra, str(script), *script_args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT, env=environ)

    yield launch, keys
    assert _left_running(keys) == []


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_hosts_on_loopback_addresses_train_like_eager(two_hosts):
    launch, keys = two_hosts
    port = _port()
    other = launch(1, "3", "0", port=port)
    first = launch(0, "3", "0", port=port)
    out, _ = first.communicate(timeout=240)
    assert first.returncode == 0, out
    other_out, _ = other.communicate(timeout=60)
    assert other.returncode == 0, other_out
    records = _lines(out)
    # the script sees no RANK / WORLD_SIZE / LOCAL_RANK even where the launcher's own environment has them
    assert records[0] == {"executors": ["executor-0", "executor-1"], "backend": "eager", "torchrun_variables": []}
    losses = next(r["losses"] for r in records if "losses" in r)
    expected = _eager_losses(3)
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-12, (losses, expected)
    assert "executor-1 on 127.0.0.2, joining tcp://127.0.0.1:" in other_out


def test_a_node_stopped_by_its_scheduler_fails_the_script_naming_it(two_hosts):
    launch, keys = two_hosts
    port = _port()
    other = launch(1, "200", "0.2", port=port)
    first = launch(0, "200", "0.2", port=port, environ={"LAUNCHED_HEARTBEAT_TIMEOUT_S": "3"})
    for line in first.stdout:                      # the job trains: stop node 1 as a scheduler would
        if line.startswith('{"step": 2}'):
            other.send_signal(signal.SIGTERM)
            break
    rest, _ = first.communicate(timeout=120)
    assert first.returncode == 7, rest                 # the script's own exit code
    lost = next(r["lost"] for r in _lines(rest) if "lost" in r)
    assert re.search(r"executor executor-1 \(node 1 at 127\.0\.0\.2\) lost", lost), lost
    other.communicate(timeout=60)
    assert other.returncode is not None


def test_a_node_that_never_joins_is_named_with_the_address_it_was_told(two_hosts):
    launch, keys = two_hosts
    port = _port()
    first = launch(0, "1", "0", port=port, extra=("--join-timeout-s", "4"))
    out, _ = first.communicate(timeout=120)
    assert first.returncode != 0
    assert re.search(r"missing executor-1 \(node\(s\) 1\), told to reach the controller at tcp://127\.0\.0\.1:"
                     rf"{port}", out), out


@pytest.mark.timeout(400)
def test_the_example_launches_both_ways_with_the_same_losses(tmp_path):
    example = os.path.join(REPO_ROOT, "examples", "train_transformer.py")
    # Eager executors: what is checked is the launcher's path, the same on every backend (the default backend's run
    # of the example is test_train_example's); XLA's start-up would double the test's time.
    common = ["--steps", "6", "--min-accuracy", "0", "--backend", "eager"]

    def final(out: str) -> list[str]:
        return [line for line in out.splitlines() if line.startswith(("loss:", "held-out accuracy"))]

    plain = subprocess.run([sys.executable, example, "--executors", "2", *common, "--checkpoint",
                            str(tmp_path / "plain")], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert plain.returncode == 0, plain.stdout[-2000:] + plain.stderr[-2000:]
    launched = subprocess.run([*RUN, "--standalone", "--nproc-per-node", "2", "--backend", "eager", example, *common,
                               "--checkpoint",
                               str(tmp_path / "launched")], capture_output=True, text=True, timeout=300,
                              cwd=REPO_ROOT)
    assert launched.returncode == 0, launched.stdout[-2000:] + launched.stderr[-2000:]
    assert len(final(plain.stdout)) == 2 and final(launched.stdout) == final(plain.stdout)
    assert "pathways-run: node 0: 2 executor(s)" in launched.stderr


def test_a_node_with_a_key_of_another_run_is_refused_and_named(two_hosts, tmp_path):
    launch, keys = two_hosts
    foreign = str(tmp_path / "foreign")
    subprocess.run([*RUN, "--make-keys", foreign, "--nnodes", "2", "--nproc-per-node", "1"], check=True,
                   capture_output=True, timeout=60)
    port = _port()
    script = SCRIPT
    other = subprocess.Popen(
        [*RUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", "1", "--master-addr", "127.0.0.1",
         "--master-port", str(port), "--host-addr", "127.0.0.2", "--keys-dir", os.path.join(foreign, "node-1"),
         "--backend", "eager", "--join-timeout-s", "5", script, "1", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT)
    first = launch(0, "1", "0", port=port, extra=("--join-timeout-s", "5"))
    out, _ = first.communicate(timeout=120)
    other_out, _ = other.communicate(timeout=120)
    assert first.returncode != 0 and other.returncode != 0
    assert "missing executor-1 (node(s) 1)" in out, out
    assert re.search(r"connection\(s\) failed the CURVE handshake meanwhile: a node with the keys of another run", out)
    assert "controller: HANDSHAKE_FAILED" in out                    # and node 0's log counts each refusal
    assert _left_running(foreign) == []


# ------------------------------------------------------------ hosts in network and mount namespaces

def test_two_hosts_in_namespaces_train_across_islands_over_a_tbf_link(tmp_path):
    """Two "hosts", each a network namespace with its own address and a private /tmp holding only its keys,
    each running pathways-run as a real host would, one island each, the link between them shaped by tc tbf:
    they train like eager through groups that met in the controller's store (no file, no shared disk); then a
    second job, whose node 1 launcher is killed, fails naming node 1; nothing is left running in either host."""
    from tests.integration.namespace_hosts import NamespaceHosts, unavailable

    why = unavailable()
    if why:
        pytest.skip(f"namespaces cannot be made here: {why} (the loopback-address tests above still run)")
    keys = str(tmp_path / "keys")
    subprocess.run([*RUN, "--make-keys", keys, "--nnodes", "2", "--nproc-per-node", "2"], check=True,
                   capture_output=True, timeout=60)
    hosts = NamespaceHosts(2, shaped={1: 20e6})
    try:
        def node(k, *script_args):
            argv = [*RUN, "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(k), "--master-addr",
                    hosts.address(0), "--master-port", "29400", "--keys-dir", "{keys}", "--island", str(k),
                    "--backend", "eager", SCRIPT, *script_args]
            return hosts.launch(k, argv, os.path.join(keys, f"node-{k}"), keep=(REPO_ROOT,), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT)

        other, first = node(1, "3", "0", "islands"), node(0, "3", "0", "islands")
        out, _ = first.communicate(timeout=240)
        other_out, _ = other.communicate(timeout=60)
        assert first.returncode == 0 and other.returncode == 0, out + other_out
        result = next(r for r in _lines(out) if "losses" in r)
        expected = _eager_losses(3)
        assert max(abs(a - b) for a, b in zip(result["losses"], expected)) < 1e-12, (result, expected)
        assert result["islands"] == ["0", "1"]
        assert result["groups"] >= 2 and result["store_requests"] > 0      # in-island groups met in the store
        assert f"on {hosts.address(1)}, joining tcp://{hosts.address(0)}:29400" in other_out
        assert hosts.tbf_sent_bytes(1) > 0                                  # the link was the shaped pair
        assert hosts.pids(0) == [] and hosts.pids(1) == []

        other, first = node(1, "200", "0.2", "islands"), node(0, "200", "0.2", "islands")
        for line in first.stdout:
            if line.startswith('{"step": 2}'):
                os.kill(other.pid, signal.SIGKILL)       # `ip netns exec` execs: this is node 1's launcher
                break
        rest, _ = first.communicate(timeout=120)
        assert first.returncode == 7, rest
        lost = next(r["lost"] for r in _lines(rest) if "lost" in r)
        assert re.search(rf"executor executor-[23] \(node 1 at {re.escape(hosts.address(1))}\) lost", lost), lost
        other.wait(30)
        deadline = time.monotonic() + 30
        while (hosts.pids(0) or hosts.pids(1)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert hosts.pids(0) == [] and hosts.pids(1) == []
    finally:
        hosts.close()


def test_health_for_probes_status_for_people_and_ctrl_c_ends_the_job(tmp_path):
    """--health-port serves grpc.health.v1 (the node, each executor) where a Kubernetes grpc probe asks;
    --status-port serves the controller's view that pathways-status prints; Ctrl-C (SIGINT to the launcher)
    interrupts the script, its context stops every executor, and nothing is left running."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health_port, status_port = _port(), _port()
    launcher = subprocess.Popen(
        [*RUN, "--standalone", "--nproc-per-node", "2", "--backend", "eager", "--health-port", str(health_port),
         "--status-port", str(status_port), SCRIPT, "500", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT)
    try:
        for line in launcher.stdout:
            if line.startswith('{"step": 2}'):
                break
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            for service in ("", "executor-0", "executor-1"):
                assert check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == \
                    health_pb2.HealthCheckResponse.SERVING, service
            with pytest.raises(grpc.RpcError) as unknown:
                check(health_pb2.HealthCheckRequest(service="executor-9"), timeout=10)
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        # Every socket the run listens on (launcher: health; script: controller, status; executors: command, data,
        # gloo) is on loopback, as --standalone's --host-addr is (test_security.py checks an in-process run alike).
        listening = [s for pid in [launcher.pid, *_descendants(launcher.pid)] for s in listening_tcp(pid)]
        assert {health_port, status_port} <= {port for _, port in listening}, listening
        assert len(listening) >= 2 + 1 + 2 * 3, listening
        assert all(on_loopback(address) for address, _ in listening), listening
        status = subprocess.run([sys.executable, "-m", "pathways_torch.launch.health", f"127.0.0.1:{status_port}"],
                                capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        assert status.returncode == 0, status.stdout + status.stderr
        rows = [line.split(" | ") for line in status.stdout.splitlines() if line.startswith("executor-")]
        assert [(r[0].strip(), r[4].strip(), r[5].strip()) for r in rows] == [("executor-0", "alive", "1"),
                                                                               ("executor-1", "alive", "1")]
        assert int(rows[0][8].replace(",", "")) > 0                      # the executors' store bytes
        assert "2 executors" in status.stdout and "calls in flight" in status.stdout
        launcher.send_signal(signal.SIGINT)
        launcher.communicate(timeout=60)
        assert launcher.returncode != 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert _left_running(SCRIPT) == []
    assert _left_running("pathways-run-keys-") == []     # the executors (started with the run's standalone keys)
    down = subprocess.run([sys.executable, "-m", "pathways_torch.launch.health", f"127.0.0.1:{status_port}",
                           "--timeout-s", "2"], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert down.returncode == 1 and "no answer from" in down.stdout


FLAKY_SCRIPT = """
import os, sys
import pathways_torch as pw
marker = sys.argv[1]
if not os.path.exists(marker):          # the first attempt fails before making its context
    open(marker, "w").close()
    sys.exit(3)
with pw.Context() as ctx:
    print("attempt 2 on", ctx.executor_ids, flush=True)
"""


def test_max_restarts_starts_the_whole_job_again_and_the_exit_code_is_the_scripts(tmp_path):
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY_SCRIPT)
    once = subprocess.run([*RUN, "--standalone", "--nproc-per-node", "1", "--backend", "eager", str(script),
                           str(tmp_path / "once")], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert once.returncode == 3, once.stderr                         # no restarts: the script's own code
    again = subprocess.run([*RUN, "--standalone", "--nproc-per-node", "1", "--backend", "eager", "--max-restarts",
                            "1", str(script), str(tmp_path / "again")], capture_output=True, text=True, timeout=120,
                           cwd=REPO_ROOT)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "the job failed (exit code 3); restart 1 of 1" in again.stderr
    assert "attempt 2 on ['executor-0']" in again.stdout
    assert _left_running(str(script)) == []


RECOVERY_SCRIPT = os.path.join(os.path.dirname(__file__), "launched_recovery.py")


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_node_restarts_its_lost_executor_with_a_spare_key_and_the_script_recovers(two_hosts, tmp_path, fault):
    # SIGSTOP: a live process to its node, lost to the controller; the node kills it after --kill-stopped-after-s.
    launch, keys = two_hosts
    port = _port()
    node0 = launch(0, "8", str(tmp_path / "ckpt"), fault, port=port, script=RECOVERY_SCRIPT)
    node1 = launch(1, port=port, extra=("--max-executor-restarts", "1", "--kill-stopped-after-s", "2"),
                   script=RECOVERY_SCRIPT)
    out0, _ = node0.communicate(timeout=240)
    out1, _ = node1.communicate(timeout=60)
    assert node0.returncode == 0 and node1.returncode == 0, out0 + out1
    (record,) = [r for r in _lines(out0) if "losses" in r]
    assert record["losses"] == record["expected"], record         # dropout on: the same steps, recovered
    assert record["stats"]["recoveries"] == 1 and record["stats"]["steps_recomputed"] <= 2, record["stats"]
    assert record["epochs"] == {"executor-0": 1, "executor-1": 2}
    assert record["pids"]["executor-1"] != record["victim"]
    assert "starting it again with the key executor-1.r1 (restart 1 of 1)" in out1
    assert "the key of executor-1 is revoked" in out0
    assert ("has been stopped for 2 s (--kill-stopped-after-s 2); killing it" in out1) == (fault == "SIGSTOP"), out1
