"""Benchmark helpers: pausing a baseline stops its whole process tree; CPU per thread is read by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from bench.baseline_server import signal_tree
from bench.cpu_per_call import thread_cpu_s
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


def test_thread_cpu_is_read_per_named_thread_and_a_busy_thread_shows():
    stop = threading.Event()

    def spin():
        from pathways_torch.wire.threads import name_os_thread

        name_os_thread()
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=spin, name="pathways-spinner")
    thread.start()
    try:
        assert wait_until(lambda: thread_cpu_s(os.getpid()).get("pw-spinner", 0.0) >= 0.05, timeout_s=10)
    finally:
        stop.set()
        thread.join()
    assert "main" in thread_cpu_s(os.getpid())


def test_scale_takes_the_idle_load_of_a_run_off_its_cpu_and_counts_client_requests():
    from bench.scale import _CountingClient, without_idle

    run = {"client_cpu_ms": 30.0, "wall_ms": 200.0}
    without_idle(run, {"idle_cpu_ms_per_s": 50.0}, size=100)    # 10 ms of the run's 30 was the idle load
    assert run["client_cpu_ms_without_heartbeats"] == 20.0 and run["cpu_us_per_executor"] == 200.0

    class Client:
        def run_program(self, *args):
            return "ran"
        name = "client"

    counting = _CountingClient(Client())
    assert counting.run_program(1) == "ran" and counting.run_program(2) == "ran" and counting.name == "client"
    assert counting.requests == {"run_program": 2}


def test_thread_wakeups_count_the_times_a_thread_blocked():
    from bench.cpu_per_call import thread_wakeups

    ready, stop = threading.Event(), threading.Event()

    def sleeper():
        from pathways_torch.wire.threads import name_os_thread

        name_os_thread()
        ready.set()
        while not stop.is_set():
            time.sleep(0.001)

    thread = threading.Thread(target=sleeper, name="pathways-sleeper")
    thread.start()
    try:
        ready.wait(5)
        before = thread_wakeups(os.getpid()).get("pw-sleeper", 0)
        time.sleep(0.3)
        assert thread_wakeups(os.getpid())["pw-sleeper"] - before >= 20   # ~300 sleeps of 1 ms
    finally:
        stop.set()
        thread.join()
