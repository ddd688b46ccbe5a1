"""pathways-run's flags, keys and environment: bad input names the flag, the value and the fix, before anything
starts; the run's keys are one private folder per node holding only that node's secrets; the PATHWAYS_*
variables round-trip; a context under a launch refuses a count or backend the launch does not have."""

from __future__ import annotations

import os
import stat

import pytest

import pathways_torch as pw
from pathways_torch.launch.environment import LAUNCH_VARIABLES, LaunchEnvironment, node_of
from pathways_torch.launch.keys import make_run_keys
from pathways_torch.launch.run import LaunchConfig, LaunchError, parse_args, resolve_nproc, route_address
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(60)


def _error(argv) -> str:
    with pytest.raises(LaunchError) as info:
        parse_args(argv)
    return str(info.value)


def test_bad_flags_name_the_flag_the_value_and_the_fix(tmp_path):
    assert "--node-rank 2: expected 0 .. 1 for --nnodes 2" in _error(
        ["--nnodes", "2", "--node-rank", "2", "--keys-dir", str(tmp_path), "train.py"])
    assert "--master-addr 'no-such-host.invalid' does not resolve" in _error(
        ["--master-addr", "no-such-host.invalid", "--keys-dir", str(tmp_path), "train.py"])
    assert "--keys-dir: required" in _error(["--nnodes", "2", "--node-rank", "1", "train.py"])
    assert "expected a script" in _error(["--standalone"])
    assert "--nproc-per-node 'two'" in _error(["--standalone", "--nproc-per-node", "two", "train.py"])


def test_nproc_gpu_on_a_host_without_gpus_is_refused():
    import torch

    if torch.cuda.device_count():
        pytest.skip("this host has CUDA devices")
    with pytest.raises(LaunchError, match="--nproc-per-node gpu: this host has no CUDA device"):
        resolve_nproc("gpu")
    assert resolve_nproc("cpu") == os.cpu_count() == resolve_nproc("auto")
    assert resolve_nproc("3") == 3


def test_a_standalone_launch_is_one_node_on_loopback():
    config = parse_args(["--standalone", "--nproc-per-node", "2", "--backend", "eager", "train.py", "--steps", "5"])
    assert isinstance(config, LaunchConfig)
    assert (config.nnodes, config.node_rank, config.master_addr, config.host_addr) == (1, 0, "127.0.0.1", "127.0.0.1")
    assert config.executor_ids == ["executor-0", "executor-1"]
    assert config.script_args == ("--steps", "5") and config.backend == "eager"
    assert route_address("127.0.0.1", 1) == "127.0.0.1"


def test_node_k_owns_its_executors_and_the_environment_round_trips():
    config = parse_args(["--nnodes", "3", "--nproc-per-node", "2", "--node-rank", "2", "--keys-dir", "/k",
                         "--master-port", "29500", "--backend", "eager", "train.py"])
    assert config.executor_ids == ["executor-4", "executor-5"]
    assert [node_of(e, 2) for e in config.executor_ids] == [2, 2]
    env = config.environment()
    assert set(env.to_environ()) == set(LAUNCH_VARIABLES)
    assert LaunchEnvironment.from_environ(env.to_environ()) == env
    assert env.controller_bind == "tcp://127.0.0.1:29500" and env.num_executors == 6
    assert LaunchEnvironment.from_environ({}) is None
    with pytest.raises(ValueError, match="lacks PATHWAYS_KEYS_DIR"):
        LaunchEnvironment.from_environ({k: v for k, v in env.to_environ().items() if k != "PATHWAYS_KEYS_DIR"})


def test_the_run_keys_are_one_private_folder_per_node_with_only_its_secrets(tmp_path):
    root = str(tmp_path / "keys")
    folders = make_run_keys(root, nnodes=2, nproc_per_node=2)
    assert folders == [os.path.join(root, "node-0"), os.path.join(root, "node-1")]
    secrets = [sorted(os.listdir(os.path.join(f, "secret"))) for f in folders]

    def own(*executors):   # each executor's pair and its 3 spares (a replacement on its node uses the next)
        return [f"{e}{spare}.key_secret" for e in executors for spare in ("", ".r1", ".r2", ".r3")]

    assert secrets == [["client.key_secret", "controller.key_secret", *own("executor-0", "executor-1")],
                       own("executor-2", "executor-3")]
    publics = [sorted(os.listdir(os.path.join(f, "public"))) for f in folders]
    assert publics[0] == publics[1] == ["client.key", "controller.key", *[
        name.replace(".key_secret", ".key") for name in own("executor-0", "executor-1", "executor-2", "executor-3")]]
    for directory, _, files in os.walk(root):
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700, directory
        for name in files:
            assert stat.S_IMODE(os.stat(os.path.join(directory, name)).st_mode) == 0o600, name
    assert sorted(os.listdir(root)) == ["node-0", "node-1"]       # the scratch folder with every pair is gone
    from pathways_torch.wire.security import SecurityError

    with pytest.raises(SecurityError, match="expected a new or empty folder"):
        make_run_keys(root, nnodes=2, nproc_per_node=2)


def test_a_keys_folder_others_can_read_is_refused_before_anything_starts(tmp_path):
    from pathways_torch.launch.run import run

    root = str(tmp_path / "keys")
    make_run_keys(root, nnodes=1, nproc_per_node=1)
    os.chmod(os.path.join(root, "node-0", "secret"), 0o755)
    config = parse_args(["--keys-dir", root, "--backend", "eager", "train.py"])
    with pytest.raises(LaunchError, match=r"--keys-dir .*mode 0755.*chmod 700"):
        run(config)


def test_a_context_under_a_launch_refuses_another_count_or_backend(monkeypatch):
    env = LaunchEnvironment(controller_bind="tcp://127.0.0.1:1", keys_dir="/nonexistent", nnodes=2,
                            nproc_per_node=2, backend="eager")
    for name, value in env.to_environ().items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"num_executors=3\) under pathways-run, which started 4 executors"):
        pw.Context(num_executors=3)
    with pytest.raises(ValueError, match=r"backend='xla:torchax'\) under pathways-run, whose executors run 'eager'"):
        pw.Context(backend="xla:torchax")
    with pytest.raises(ValueError, match="islands come from each node's --island"):
        pw.Context(islands=[2, 2])


def test_process_state_tells_running_stopped_and_gone_apart():
    import signal
    import subprocess

    from pathways_torch.wire.process_state import is_gone, is_stopped, process_state

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert process_state(child.pid) is not None and not is_stopped(child.pid)   # R, S or D: running
        child.send_signal(signal.SIGSTOP)
        assert wait_until(lambda: is_stopped(child.pid), 5)
        child.send_signal(signal.SIGCONT)
        assert wait_until(lambda: not is_stopped(child.pid), 5)
        child.kill()
        assert wait_until(lambda: is_gone(child.pid), 5)      # a zombie until reaped: gone already
    finally:
        child.kill()
        child.wait()
    assert is_gone(child.pid)


# ------------------------------------------------------------ --controller: joining a standalone controller

JOIN = ["--controller", "tcp://127.0.0.1:5555", "--keys-dir", "/k/executors", "--backend", "eager"]


def test_joining_a_controller_refuses_a_script_and_the_flags_of_a_launch_controller():
    message = _error([*JOIN, "train.py", "--steps", "5"])
    assert "--controller tcp://127.0.0.1:5555 with the script 'train.py'" in message
    assert "runs no script" in message and "drop 'train.py', or drop --controller" in message
    for flags in (["--master-addr", "127.0.0.1"], ["--master-port", "29400"], ["--status-port", "8123"],
                  ["--standalone"]):
        message = _error([*JOIN, *flags])
        assert f"--controller tcp://127.0.0.1:5555 with {flags[0]}:" in message, message
        assert message.endswith(f"drop {flags[0]}"), message
    message = _error([*JOIN, "--master-addr", "h", "--status-port", "1"])
    assert "with --master-addr, --status-port:" in message and message.endswith("drop --master-addr, --status-port")


def test_joining_a_controller_refuses_spare_key_restarts_a_missing_keys_folder_and_a_bad_address():
    message = _error([*JOIN, "--max-executor-restarts", "1"])
    assert "--max-executor-restarts 1 with --controller" in message
    assert "spare keys" in message and "pathways-controller --make-keys) have none" in message
    assert message.endswith("drop --max-executor-restarts")
    message = _error(["--controller", "tcp://127.0.0.1:5555"])
    assert "--keys-dir: required with --controller" in message and "DIR/executors" in message
    for address in ("127.0.0.1:5555", "tcp://127.0.0.1", "tcp://127.0.0.1:http", "ipc:///tmp/x"):
        message = _error(["--controller", address, "--keys-dir", "/k"])
        assert f"--controller {address!r}: expected tcp://HOST:PORT" in message and "executors at" in message
    assert "--controller 'no-such-host.invalid' does not resolve" in _error(
        ["--controller", "tcp://no-such-host.invalid:5555", "--keys-dir", "/k"])


def test_a_node_joining_a_controller_runs_only_its_own_executors():
    config = parse_args(["--nnodes", "3", "--nproc-per-node", "2", "--node-rank", "1", "--island", "b", *JOIN])
    assert config.joins_controller and config.script == "" and config.status_port == 0
    assert config.controller_address == "tcp://127.0.0.1:5555" and config.host_addr == "127.0.0.1"
    assert config.executor_ids == ["executor-2", "executor-3"]
    launch = parse_args(["--keys-dir", "/k", "--backend", "eager", "train.py"])
    assert not launch.joins_controller and launch.controller_address == "tcp://127.0.0.1:29400"


def test_the_keys_check_takes_the_service_executors_folder_for_this_nodes_executors_only(tmp_path):
    from pathways_torch.launch import make_service_keys
    from pathways_torch.launch.run_config import node_keys

    folders = make_service_keys(str(tmp_path / "service"), ["alice"], executors=4)
    flags = ["--nnodes", "3", "--nproc-per-node", "2", "--controller", "tcp://127.0.0.1:5555",
             "--keys-dir", folders.executors, "--backend", "eager"]
    for rank in (0, 1):    # node 0 too: the folder holds no controller or client secret, and needs none
        assert node_keys(parse_args([*flags, "--node-rank", str(rank)])) == folders.executors
    with pytest.raises(LaunchError) as info:     # keys for executor-0 .. executor-3 only
        node_keys(parse_args([*flags, "--node-rank", "2"]))
    message = str(info.value)
    assert f"--keys-dir {folders.executors}:" in message and "'executor-4'" in message
    assert "needs the keys of executor-4 .. executor-5" in message and "--executors N" in message
    with pytest.raises(LaunchError, match="expected a secret key for 'controller'"):   # a launch's node 0 does
        node_keys(parse_args(["--keys-dir", folders.executors, "--backend", "eager", "train.py"]))
