"""Simulated executors sharing a process (`executor.sim_host`): their names, the open-file check, the device clock
that does not sleep, and the precise timers it runs on."""

from __future__ import annotations

import time

import pytest

from executor.__main__ import parse_args
from executor.sim import SimBackend, _SimFunction
from executor.sim_host import FILES_PER_PROCESS, FILES_PER_SIM, check_open_files, sim_ids
from pathways_torch.config import ContextConfig
from pathways_torch.local.cluster import _process_groups
from pathways_torch.wire import SocketLoop

pytestmark = pytest.mark.timeout(30)


def test_sim_ids_are_given_or_numbered():
    assert sim_ids(["a", "b"], 2) == ["a", "b"]
    assert sim_ids(["host"], 3) == ["host.0", "host.1", "host.2"]
    with pytest.raises(ValueError, match="expected one id or 3 comma-separated ids"):
        sim_ids(["a", "b"], 3)


def test_too_many_for_the_open_file_limit_names_the_limit_and_ulimit():
    check_open_files(4, limit=FILES_PER_PROCESS + 4 * FILES_PER_SIM)
    with pytest.raises(ValueError) as error:
        check_open_files(1000, limit=1024)
    text = str(error.value)
    assert "1024" in text and "ulimit -n" in text and f"at most {(1024 - FILES_PER_PROCESS) // FILES_PER_SIM}" in text
    with pytest.raises(ValueError, match="at least 1"):
        check_open_files(0)


def test_the_command_line_refuses_bad_sim_counts_before_anything_starts(capsys):
    base = ["--controller", "tcp://127.0.0.1:1", "--keys", "/nonexistent", "--backend", "sim"]
    with pytest.raises(SystemExit):
        parse_args([*base, "--sim-count", "0"])
    assert "at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([*base, "--sim-count", "10000000"])
    assert "ulimit -n" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([*base, "--id", "a,b", "--sim-count", "3"])
    assert parse_args([*base, "--id", "x", "--sim-count", "4"]).sim_count == 4
    with pytest.raises(ValueError, match="only simulated executors share a process"):
        parse_args([*base[:-1], "eager", "--sim-count", "2"])


def test_context_refuses_sims_per_process_without_sims():
    with pytest.raises(ValueError, match="positive int"):
        ContextConfig(backend="sim", sims_per_process=0)
    with pytest.raises(ValueError, match="only simulated executors share a process"):
        ContextConfig(backend="eager", sims_per_process=4)


def test_processes_hold_executors_of_one_island():
    assert _process_groups(["", "", "", ""], None) == [[0], [1], [2], [3]]
    assert _process_groups(["", "", "", "", ""], 2) == [[0, 1], [2, 3], [4]]
    assert _process_groups(["0", "0", "0", "1", "1"], 4) == [[0, 1, 2], [3, 4]]


def test_a_device_that_does_not_sleep_keeps_its_clock():
    backend = SimBackend(sleeps=False)
    step = _SimFunction(0.5, [((2,), "float32")])
    backend.ready_at = 100.0
    began = time.monotonic()
    start = backend.clock_ns()
    outputs = backend.run(step, [])
    assert time.monotonic() - began < 0.1                        # no sleep
    assert backend.free_at == 100.5 and backend.clock_ns() - start == 500_000_000   # the device time of the step
    assert outputs[0].shape == (2,)
    backend.ready_at = 100.2    # queued while the device was busy: starts when it is free, not when it came
    backend.run(step, [])
    assert backend.free_at == 101.0
    backend.ready_at = 200.0    # came after the device was free: starts when it came
    backend.run(step, [])
    assert backend.free_at == 200.5


def test_precise_timers_fire_in_due_order_and_not_early():
    loop = SocketLoop("timers", precise_timers=True)
    loop.start()
    fired = []
    try:
        now = time.monotonic()
        dues = [now + 0.005 + 0.0007 * k for k in (3, 0, 2, 1, 4)]
        for due in dues:
            loop.call_at(due, lambda due=due: fired.append((due, time.monotonic())))
        deadline = time.monotonic() + 5
        while len(fired) < len(dues) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
    assert [due for due, _ in fired] == sorted(dues)
    assert all(at >= due for due, at in fired)
