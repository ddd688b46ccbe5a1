"""An executor stores no run output past the bytes the controller counts for it (issue 46, point 4: the controller's
budget is what executors store). `ExecutorCore` in process, with the fakes of test_executor_core: a Run or RunProgram
that carries ``output_budget_bytes`` gets an output larger than its budget stored as a failure of 0 bytes (its Done
fails, its owner reads why); one within its budget is stored; one with no budget (no limit: the embedded context) is
stored as before."""

from __future__ import annotations

import pytest
import torch

from pathways_torch.errors import OUTPUT_OVER_BUDGET
from pathways_torch.wire import pb
from tests.unit.test_executor_core import fetch, fetch_tensor, load, make_core, put, ref

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20


def _grow(x):
    return x.new_zeros(2 * MIB) + x.sum()       # 8 MiB of float32, whatever the input's size


def _run(core, *, budgets=(), call_id=42, inputs=(10,), outputs=(12,)):
    msg = pb.Run(seq=1, call_id=call_id, function_id=1, inputs=[ref(i) for i in inputs],
                 outputs=[ref(o) for o in outputs], output_budget_bytes=list(budgets))
    core.on_control(pb.Envelope(run=msg), [])


def _loaded_with_input():
    core, outbox = make_core()
    load(core, 1, _grow, torch.ones(2), name="grow")
    put(core, ref(10), torch.ones(2))
    return core, outbox


def test_an_output_over_its_budget_is_stored_as_a_failure_and_its_done_fails():
    core, outbox = _loaded_with_input()
    before = core.store.bytes
    _run(core, budgets=[8])                                  # declared 8 bytes per shard; it makes 8 MiB
    [done] = outbox.dones()
    assert not done.ok and done.failure.type == OUTPUT_OVER_BUDGET
    assert "output 0 of call 42 of function 'grow' is 8388608 bytes" in done.failure.message
    assert "declared 8 bytes per shard" in done.failure.message and "Fix:" in done.failure.message
    assert core.store.bytes == before                        # nothing of it stored
    reply, payload = fetch(core, outbox, ref(12))
    assert reply.failed and reply.failure.type == OUTPUT_OVER_BUDGET and not payload
    assert core.counters["outputs_over_budget"] == 1          # reported with Stats


def test_an_output_within_its_budget_is_stored():
    core, outbox = _loaded_with_input()
    before = core.store.bytes
    _run(core, budgets=[8 * MIB])
    [done] = outbox.dones()
    assert done.ok
    assert core.store.bytes == before + 8 * MIB
    assert fetch_tensor(core, outbox, ref(12))[0].item() == 2.0
    assert core.counters["outputs_over_budget"] == 0


def test_without_a_budget_nothing_is_checked():
    core, outbox = _loaded_with_input()
    before = core.store.bytes
    _run(core)                                               # no limit: the embedded context's runs
    [done] = outbox.dones()
    assert done.ok and core.store.bytes == before + 8 * MIB
    assert core.store.get((12, 0, 0)).budget is None


def test_a_queued_run_is_held_to_its_budget_too():
    core, outbox = make_core()
    load(core, 1, _grow, torch.ones(2), name="grow")
    _run(core, budgets=[8])                                  # its input is not here yet: queued, not started at once
    assert not outbox.dones()
    before = core.store.bytes
    put(core, ref(10), torch.ones(2))
    [done] = outbox.dones()
    assert not done.ok and done.failure.type == OUTPUT_OVER_BUDGET
    assert core.store.bytes == before + 8                    # the input put only


def _register_two_outputs(core):
    """%0 -> grow -> %1 -> add one -> %2; both %1 and %2 are program outputs (nodes 0 and 1 report)."""
    load(core, 2, lambda y: y + 1, torch.zeros(2 * MIB), name="add one")
    plan = pb.RegisterProgram(program_id=9, name="two", input_values=[0], output_values=[1, 2], num_nodes=2)
    for index in range(2):
        node = pb.ProgramNode(node=index, function_id=1 + index, outputs=[index + 1], report=True)
        node.inputs.add(value=index)
        plan.actions.add().run.CopyFrom(node)
    core.on_control(pb.Envelope(register_program=plan), [])


def _run_program(core, budgets=()):
    run = pb.RunProgram(program_id=9, base_seq=10, base_call_id=100, input_array_ids=[10],
                        output_array_ids=[21, 22], first_intermediate_id=1000, output_budget_bytes=list(budgets))
    core.on_control(pb.Envelope(run_program=run), [])


def test_a_program_output_over_its_budget_fails_and_the_one_within_is_stored():
    core, outbox = _loaded_with_input()
    _register_two_outputs(core)
    before = core.store.bytes
    _run_program(core, budgets=[8 * MIB, 8])                 # the second output lies: 8 bytes declared
    dones = {d.call_id: d for d in outbox.dones()}
    assert dones[100].ok
    assert not dones[101].ok and dones[101].failure.type == OUTPUT_OVER_BUDGET
    assert "output 0 of call 101 of function 'add one'" in dones[101].failure.message
    assert core.store.bytes == before + 8 * MIB              # the first output only
    assert fetch(core, outbox, ref(22))[0].failed
    assert fetch_tensor(core, outbox, ref(21), request_id=101)[0].item() == 2.0


def test_a_program_run_without_budgets_stores_every_output():
    core, outbox = _loaded_with_input()
    _register_two_outputs(core)
    before = core.store.bytes
    _run_program(core)
    assert all(d.ok for d in outbox.dones())
    assert core.store.bytes == before + 16 * MIB
