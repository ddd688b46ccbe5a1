"""An executor started as a local cluster starts it (forked from the fork server, its output in its own log) leaves
its stacks in that log: every thread's when asked (SIGUSR1, and it goes on), and when it dies of a native crash
(SIGSEGV). Issue 47: a survivor died of SIGSEGV with no stack in its log."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pathways_torch.local.cluster import LocalCluster
from pathways_torch.wire.security import CLIENT, CONTROLLER, KeyDirectory

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

EXECUTOR = "executor-0"
NOBODY = "tcp://127.0.0.1:9"   # no controller answers: the executor waits for one (--join-timeout-s) and we act


def _running_as_executor(pid: int, log_path: str) -> bool:
    """Whether the forked process ``pid`` became the executor: its stderr is its log, and it started threads
    (ZeroMQ's, the heartbeat's), which it does only once its ``main`` runs."""
    try:
        return os.readlink(f"/proc/{pid}/fd/2") == log_path and len(os.listdir(f"/proc/{pid}/task")) >= 3
    except OSError:
        return False


def _wait_for(condition, what: str, timeout_s: float = 90.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"expected {what} within {timeout_s} s")


def _log(cluster: LocalCluster) -> str:
    with open(os.path.join(cluster.log_dir, f"{EXECUTOR}.log"), errors="replace") as log:
        return log.read()


def test_an_executor_writes_every_stack_to_its_log_when_asked_and_when_it_crashes(tmp_path):
    keys = KeyDirectory.create([CONTROLLER, CLIENT, EXECUTOR], parent=str(tmp_path))
    (tmp_path / "logs").mkdir()
    cluster = LocalCluster(NOBODY, [EXECUTOR], keys_dir=keys.path, log_dir=str(tmp_path / "logs"),
                           join_timeout_s=120.0)
    try:
        process = cluster.process_of(EXECUTOR)
        log_path = os.path.join(cluster.log_dir, f"{EXECUTOR}.log")
        _wait_for(lambda: _running_as_executor(process.pid, log_path), "the forked process to run the executor")

        os.kill(process.pid, signal.SIGUSR1)
        # the main thread's stack comes last: read the log once it is there (it is written while we read)
        asked = _wait_for(lambda: "executor/__main__.py" in (log := _log(cluster)) and log,
                          "the main thread's stack in its log after SIGUSR1")
        assert "Thread 0x" in asked and "most recent call first" in asked, asked
        time.sleep(0.5)
        assert process.poll() is None, f"SIGUSR1 ended the executor ({process.returncode}); its log:\n{asked}"

        os.kill(process.pid, signal.SIGSEGV)
        _wait_for(lambda: process.poll() is not None, "the executor to die of its SIGSEGV")
        crashed = _log(cluster)[len(asked):]
        assert process.returncode == -signal.SIGSEGV, process.returncode
        assert "Fatal Python error: Segmentation fault" in crashed, crashed
        assert "Thread 0x" in crashed and "most recent call first" in crashed, crashed
    finally:
        cluster.stop(2.0)


_NATIVE_CRASH = """
import ctypes, sys
from pathways_torch.wire.crash_stacks import enable_crash_stacks
enable_crash_stacks()
from executor.backends import xla_collectives
if xla_collectives.load() is None:
    print("unavailable:", xla_collectives.unavailable_reason(), file=sys.stderr)
    sys.exit(7)
ctypes.string_at(0)   # a read of address 0, in C
"""


def test_a_native_crash_writes_its_cpp_frames_then_every_python_stack():
    """With the collectives extension loaded (the XLA route's executors), a fault in C code writes its native frames
    (the extension's handler) and then faulthandler's Python stacks, and the process still dies of the signal."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _NATIVE_CRASH], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode != 7, f"the extension is not built here (pathways-build-extensions): {done.stderr}"
    assert done.returncode == -signal.SIGSEGV, (done.returncode, done.stderr)
    native, _, python = done.stderr.partition("Fatal Python error: Segmentation fault")
    assert "Fatal signal: native stack" in native, done.stderr
    assert "_ctypes" in native and "pathways_xla_collectives" in native, native   # the faulting C frame, ours
    assert "most recent call first" in python and 'File "<string>"' in python, python
