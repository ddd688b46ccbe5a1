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


def _sim_core():
    from executor.core import ExecutorCore
    from tests.unit.test_executor_core import FakeOutbox

    outbox, holder = FakeOutbox(), {}
    backend = SimBackend(sleeps=False)

    def submit(job):
        backend.ready_at = 100.0
        holder["core"].finish(holder["core"].compute(job))

    core = holder["core"] = ExecutorCore(executor_id="e0", backend=backend, outbox=outbox, submit=submit)
    return core, outbox, backend


def _run_sim_chain(at_once: bool, functions=(1, 1, 1, 1), reporting=(1, 3)):
    from pathways_torch.wire import pb

    core, outbox, backend = _sim_core()
    core.interpreter._at_once = at_once
    meta = pb.TensorMeta(dtype="float32", shape=[3])
    for function_id, seconds in ((1, 0.25), (2, 0.5)):
        graph = pb.Graph(inputs=[meta], outputs=[meta])
        core.on_control(pb.Envelope(load_function=pb.LoadFunction(function_id=function_id, name=f"f{function_id}",
                                                                   graph=graph, sim_seconds=seconds)), [])
    put = pb.Put(request_id=1, shard=pb.ShardRef(array_id=5))
    put.tensor.CopyFrom(pb.TensorMeta(dtype="float32", shape=[3], frame=1))
    core.on_data(b"client", pb.Envelope(put=put), [bytes(12)], role="client")
    n = len(functions)
    plan = pb.RegisterProgram(program_id=9, name="chain", input_values=[0], output_values=[n], num_nodes=n)
    for index, function_id in enumerate(functions):
        node = pb.ProgramNode(node=index, function_id=function_id, outputs=[index + 1], report=index in reporting)
        node.inputs.add(value=index)
        plan.actions.add().run.CopyFrom(node)
        if 0 < index + 1 < n:
            plan.local_intermediates.add(value=index + 1)
    core.on_control(pb.Envelope(register_program=plan), [])
    core.on_control(pb.Envelope(run_program=pb.RunProgram(
        program_id=9, base_seq=10, base_call_id=100, input_array_ids=[5], output_array_ids=[6],
        first_intermediate_id=1000)), [])
    dones = [(d.call_id, d.seq, d.ok, d.device_ns, d.failure.message) for d in outbox.dones()]
    stored = core.store.get((6, 0, 0))
    details = {event[6] for event in core.trace._events}
    return dones, core.num_computations, backend.free_at, stored.value or stored.failure, details


@pytest.mark.parametrize("functions", [(1, 1, 1, 1), (1, 2, 2, 1), (1, 3, 1, 1)])   # 3: never loaded
def test_a_simulated_segment_in_one_pass_reports_what_step_by_step_does(functions):
    at_once, by_step = _run_sim_chain(True, functions), _run_sim_chain(False, functions)
    assert at_once[:3] == by_step[:3]
    value, reference = at_once[3], by_step[3]
    assert type(value) is type(reference)
    assert "simulated segment" not in by_step[4]
    if functions == (1, 3, 1, 1):   # a failure passes on: the one-pass run declines, the same Dones come
        assert not at_once[0][-1][2] and "never loaded" in at_once[0][-1][4]
        assert "simulated segment" not in at_once[4]
    else:
        assert "simulated segment" in at_once[4]
        assert value.shape == (3,) and at_once[2] == 100.0 + sum(0.25 if f == 1 else 0.5 for f in functions)
        assert [d[3] for d in at_once[0]] == [int(0.25e9) + int((0.5 if functions[1] == 2 else 0.25) * 1e9),
                                              int((0.5 if functions[2] == 2 else 0.25) * 1e9) + int(0.25e9)]


def test_a_waiting_client_flushes_frees_only_for_a_megabyte_or_more():
    """At N executors a flush is N Free messages: dropped scalars wait for the next message to their executors."""
    import torch

    from pathways_torch.array import _nbytes
    from pathways_torch.dispatcher import IDLE_FLUSH_BYTES, Dispatcher

    from pathways_torch.wire.seam import FlushFrees

    class Client:
        flushes = 0

        def request(self, op):
            Client.flushes += isinstance(op, FlushFrees)

    dispatch = Dispatcher(Client(), None)
    dispatch.release(1, nbytes=_nbytes((1024,), torch.float32))
    assert not dispatch.frees_worth_flushing()          # 4 KB dropped: a wait sends nothing (and waits once)
    dispatch.release(2, nbytes=_nbytes((512, 512), torch.float32))
    assert dispatch.frees_worth_flushing()              # 1 MB more: a wait past 50 ms sends them
    dispatch.flush_frees()
    assert Client.flushes == 1 and not dispatch.frees_worth_flushing()   # counted afresh
    assert _nbytes((512, 512), torch.float32) == IDLE_FLUSH_BYTES and _nbytes((None, 3), torch.float32) > IDLE_FLUSH_BYTES
