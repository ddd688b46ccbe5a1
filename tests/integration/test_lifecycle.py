"""No executor outlives its client: normal exit, an exception, Ctrl-C and SIGKILL of the client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO_ROOT, process_gone, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SCRIPT = os.path.join(os.path.dirname(__file__), "client_script.py")


def _start(how: str) -> tuple[subprocess.Popen, list[int]]:
    client = subprocess.Popen([sys.executable, SCRIPT, how], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    pids: list[int] = []
    for line in client.stdout:
        if line.startswith("TAKE SIGINT"):
            assert line.split()[2:] == [], f"threads that could take the client's Ctrl-C: {line}"
        if line.startswith("PIDS"):
            pids = [int(p) for p in line.split()[1:]]
        if line.startswith("READY") or (pids and how in ("clean", "exception")):
            break
    assert len(pids) == 2, client.stderr.read() if client.poll() is not None else "no PIDS line"
    return client, pids


@pytest.mark.parametrize("how", ["clean", "exception"])
def test_executors_stop_when_the_context_exits(how):
    client, pids = _start(how)
    code = client.wait(60)
    assert code == (0 if how == "clean" else 1)
    assert wait_until(lambda: all(process_gone(p) for p in pids), 10), pids


def test_ctrl_c_in_the_client_stops_every_executor():
    client, pids = _start("sigint")
    client.send_signal(signal.SIGINT)
    try:
        code = client.wait(30)
    except subprocess.TimeoutExpired:   # where it hangs, for whoever reads the failure
        client.send_signal(signal.SIGUSR1)
        time.sleep(1)
        client.kill()
        raise AssertionError("the client did not exit within 30 s of Ctrl-C; its threads:\n"
                             + client.communicate()[1][-6000:]) from None
    assert code != 0
    assert "KeyboardInterrupt" in client.stderr.read()
    assert wait_until(lambda: all(process_gone(p) for p in pids), 10), pids


def test_sigkill_of_the_client_makes_executors_exit():
    client, pids = _start("sigkill")
    assert not any(process_gone(p) for p in pids)
    client.kill()
    client.wait(10)
    # Executors poll their parent every heartbeat interval (0.2 s here).
    assert wait_until(lambda: all(process_gone(p) for p in pids), 10), pids
