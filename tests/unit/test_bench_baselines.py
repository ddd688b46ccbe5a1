"""The benchmark's baseline servers: pausing a baseline stops its whole process tree."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from bench.baseline_server import signal_tree
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(30)

# A parent that starts a child, prints the child's pid, and sleeps (as Ray's driver starts its daemons).
_TREE = ("import subprocess, sys, time; "
         "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
         "print(child.pid, flush=True); time.sleep(60)")


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_signal_tree_stops_and_resumes_a_process_and_its_children():
    parent = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        signal_tree(parent.pid, signal.SIGSTOP)
        assert wait_until(lambda: _stopped(parent.pid) and _stopped(child), timeout_s=5)
        signal_tree(parent.pid, signal.SIGCONT)
        assert wait_until(lambda: not _stopped(parent.pid) and not _stopped(child), timeout_s=5)
    finally:
        signal_tree(parent.pid, signal.SIGKILL)
        parent.wait()
