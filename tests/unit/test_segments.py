"""Segments: how an executor cuts a registered program, and how a segment runs (in-process core)."""

from __future__ import annotations

import pytest
import torch

from controller import CallSpec
from controller.program import ProgramSpec, lower
from controller.resources import MeshAllocation
from executor.segments import plan_segments
from pathways_torch.wire import pb
from tests.unit.test_executor_core import fetch, fetch_tensor, load, make_core, put, ref

pytestmark = pytest.mark.timeout(30)

MESH_A = MeshAllocation(1, (("data", 2),), ("e0", "e1"))
MESH_B = MeshAllocation(2, (("data", 2),), ("e2", "e3"))
ADDRESSES = {f"e{i}": f"tcp://127.0.0.1:900{i}" for i in range(4)}


def _node(index, mesh, inputs, outputs, collective=False):
    return CallSpec(name=f"f{index}", function_id=1, mesh=mesh, inputs=inputs, outputs=outputs,
                    collective_axes=("data",) if collective else ())


def _describe(items) -> list[str]:
    return [item.describe() if hasattr(item, "describe") else f"send %{item.value} -> n{item.to_node}"
            for item in items]


def test_a_local_chain_is_one_segment_and_a_copy_or_a_push_cuts_it():
    # A: n0 -> n1 (collective) -> n2 -> n3 (also reads %1); %3 is pushed to B: n4 -> n5. Outputs %4, %6.
    spec = ProgramSpec(name="p", input_values=(0,), input_meshes=(MESH_A,), output_values=(4, 6), nodes=(
        _node(0, MESH_A, (0,), (1,)), _node(1, MESH_A, (1,), (2,), collective=True),
        _node(2, MESH_A, (2,), (3,)), _node(3, MESH_A, (3, 1), (4,)),
        _node(4, MESH_B, (3,), (5,)), _node(5, MESH_B, (5,), (6,))))
    lowered = lower(spec, 1, ADDRESSES, axis_groups={1: {"data": [5, 5]}})
    assert _describe(plan_segments(lowered.plans["e0"])) == [
        # %3 leaves (pushed to e2): the segment ends after n2, so e2 need not wait for n3
        "segment n0..n2 (3 steps, 1 in, 2 out, collective)",
        "segment n3..n3 (1 step, 2 in, 1 out)",
        "send %3 -> n4",
    ]
    assert _describe(plan_segments(lowered.plans["e2"])) == [
        "segment n4..n5 (2 steps, 1 in, 1 out)",   # starts with the copy; %5 never reaches the store
    ]
    first = plan_segments(lowered.plans["e0"])[0]
    # stored: %1 (read by the next segment) and %3 (pushed); %2 stays on the compute thread
    assert [(value, shard) for value, shard, _ in first.outputs] == [(1, 0), (3, 0)]


def _register_chain(core, functions):
    """A program of len(functions) nodes on one executor: %0 -> f0 -> %1 -> f1 -> ... ; output the last."""
    n = len(functions)
    plan = pb.RegisterProgram(program_id=9, name="chain", input_values=[0], output_values=[n], num_nodes=n)
    for index, function_id in enumerate(functions):
        run = pb.ProgramNode(node=index, function_id=function_id, outputs=[index + 1], report=index == n - 1)
        run.inputs.add(value=index)
        plan.actions.add().run.CopyFrom(run)
        if 0 < index + 1 < n:
            plan.local_intermediates.add(value=index + 1)
    core.on_control(pb.Envelope(register_program=plan), [])


def _run_chain(core, input_id, output_id):
    run = pb.RunProgram(program_id=9, base_seq=10, base_call_id=100, input_array_ids=[input_id],
                        output_array_ids=[output_id], first_intermediate_id=1000)
    core.on_control(pb.Envelope(run_program=run), [])


def test_a_segment_runs_every_step_and_stores_only_what_leaves_it():
    core, outbox = make_core()
    load(core, 1, lambda x: x * 2 + 1, torch.zeros(3))
    put(core, ref(5), torch.ones(3))
    _register_chain(core, [1, 1, 1])
    _run_chain(core, 5, 6)
    torch.testing.assert_close(fetch_tensor(core, outbox, ref(6)), torch.full((3,), 15.0))
    assert [(d.call_id, d.seq, d.ok) for d in outbox.dones()] == [(102, 12, True)]   # the reporting node only
    assert core.num_computations == 3
    assert not any(key[0] >= 1000 for key in core.store._entries), "an intermediate reached the store"


def test_a_failed_step_fails_what_reads_it_with_its_own_call_id():
    core, outbox = make_core()
    load(core, 1, lambda x: x * 2 + 1, torch.zeros(3))
    put(core, ref(5), torch.ones(3))
    _register_chain(core, [1, 2, 1])          # function 2 was never loaded
    _run_chain(core, 5, 6)
    (done,) = outbox.dones()
    assert not done.ok and done.call_id == 102
    assert done.failure.origin_call_id == 101 and "never loaded" in done.failure.message
    reply, _ = fetch(core, outbox, ref(6))
    assert reply.failed and reply.failure.origin_call_id == 101
    assert core.num_computations == 1
