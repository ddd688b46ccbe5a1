"""Lowering a program, tested as text in, text out."""

from __future__ import annotations

import pytest

from controller import CallSpec
from pathways_torch.wire import pb
from controller.program import ProgramSpec, lower
from controller.resources import MeshAllocation

pytestmark = pytest.mark.timeout(30)

MESH_A = MeshAllocation(1, (("data", 2),), ("e0", "e1"))
MESH_B = MeshAllocation(2, (("data", 2),), ("e2", "e3"))
ADDRESSES = {f"e{i}": f"tcp://127.0.0.1:900{i}" for i in range(4)}


def _spec():
    # %0 on A → inc on A (%1) → inc on B (%2) → total with a collective on B (%3); outputs %2, %3
    return ProgramSpec(
        name="chain", input_values=(0,), input_meshes=(MESH_A,), output_values=(2, 3),
        nodes=(
            CallSpec(name="inc", function_id=7, mesh=MESH_A, inputs=(0,), outputs=(1,)),
            CallSpec(name="inc", function_id=7, mesh=MESH_B, inputs=(1,), outputs=(2,)),
            CallSpec(name="total", function_id=8, mesh=MESH_B, inputs=(2,), outputs=(3,),
                     collective_axes=("data",)),
        ))


def test_lowered_program_prints_placement_transfers_and_buffer_plan():
    lowered = lower(_spec(), 1, ADDRESSES, axis_groups={2: {"data": [5, 5]}})
    assert lowered.describe() == """\
lowered chain: 3 nodes on 4 executors
executor e0:
  n0: %1[0] = inc(%0[0])
  send %1[0] -> n1 at tcp://127.0.0.1:9002
  free after use: %1[0]
executor e1:
  n0: %1[1] = inc(%0[1])
  send %1[1] -> n1 at tcp://127.0.0.1:9003
  free after use: %1[1]
executor e2:
  n1: %2[0] = inc(%1[0] (copy))  [report]
  n2: %3[0] = total(%2[0])  [collective, first here in the run; report]
executor e3:
  n1: %2[1] = inc(%1[1] (copy))  [report]
  n2: %3[1] = total(%2[1])  [collective, first here in the run; report]"""
    assert lowered.reporting_nodes == [1, 2]
    assert lowered.last_collective_node == {"e2": 3, "e3": 3}
    assert dict(lowered.plans["e2"].actions[1].run.axis_groups) == {"data": 5}


def test_consecutive_collectives_chain_on_each_executor():
    spec = ProgramSpec(
        name="two", input_values=(0,), input_meshes=(MESH_A,), output_values=(2,),
        nodes=(CallSpec(name="ar", function_id=1, mesh=MESH_A, inputs=(0,), outputs=(1,),
                        collective_axes=("data",)),
               CallSpec(name="ar", function_id=1, mesh=MESH_A, inputs=(1,), outputs=(2,),
                        collective_axes=("data",))))
    text = lower(spec, 2, ADDRESSES, axis_groups={0: {"data": [3, 3]}, 1: {"data": [3, 3]}}).describe()
    assert "n0: %1[0] = ar(%0[0])  [collective, first here in the run]" in text
    assert "n1: %2[0] = ar(%1[0])  [collective, after n0; report]" in text
    assert "free after use: %1[0]" in text


def test_debug_mode_digests_only_replicated_outputs_of_reporting_nodes():
    spec = ProgramSpec(
        name="dbg", input_values=(0,), input_meshes=(MESH_A,), output_values=(2,),
        nodes=(CallSpec(name="inc", function_id=1, mesh=MESH_A, inputs=(0,), outputs=(1,),
                        replicated_outputs=(True,), debug=True),          # internal: no Done, no digest
               CallSpec(name="total", function_id=2, mesh=MESH_A, inputs=(1,), outputs=(2,),
                        replicated_outputs=(True,), debug=True)))
    text = lower(spec, 3, ADDRESSES).describe()
    assert "n0: %1[0] = inc(%0[0])\n" in text
    assert "n1: %2[0] = total(%1[0])  [report; digest]" in text


def _field_by_field(spec, program_id, addresses, axis_groups):
    """The plans as lowering built them before it wrote bytes (controller/plan_bytes.py): the oracle."""
    where, outputs, inputs = spec.value_meshes(), set(spec.output_values), set(spec.input_values)
    plans, last_collective, produced = {}, {}, {}

    def plan_for(executor_id):
        return plans.setdefault(executor_id, pb.RegisterProgram(
            program_id=program_id, name=spec.name, input_values=spec.input_values,
            output_values=spec.output_values, num_nodes=len(spec.nodes)))

    for index, node in enumerate(spec.nodes):
        report = any(v in outputs for v in node.outputs)
        for position, executor_id in enumerate(node.mesh.executor_ids):
            run = pb.ProgramNode(node=index, function_id=node.function_id, shard=position, outputs=node.outputs,
                                 report=report, digest_outputs=report and node.debug and any(node.replicated_outputs))
            for value in node.inputs:
                source = where[value].executor_ids[position]
                run.inputs.add(value=value, shard=position, copy=source != executor_id)
                if source != executor_id:
                    plan_for(source).actions.add().send.CopyFrom(pb.ProgramSend(
                        value=value, shard=position, to_node=index, to_address=addresses[executor_id]))
            if node.collective_axes:
                run.collective = True
                run.prev_collective_node = last_collective.get(executor_id, 0)
                last_collective[executor_id] = index + 1
                for axis in node.collective_axes:
                    run.axis_groups[axis] = axis_groups[index][axis][position]
            plan_for(executor_id).actions.add().run.CopyFrom(run)
            produced.setdefault(executor_id, []).extend(
                (v, position) for v in node.outputs if v not in outputs and v not in inputs)
    for executor_id, shards in produced.items():
        for value, position in shards:
            plans[executor_id].local_intermediates.add(value=value, shard=position)
    return plans


def test_plans_written_as_bytes_parse_to_the_messages_built_field_by_field():
    # 300 executors (shards past one varint byte), value indices past 127, a move between two meshes with the
    # executors in another order, collectives with groups, a debug node with a replicated output.
    wide = MeshAllocation(3, (("data", 300),), tuple(f"w{i}" for i in range(300)))
    turned = MeshAllocation(4, (("data", 300),), tuple(reversed(wide.executor_ids)))
    addresses = {e: f"tcp://127.0.0.1:{7000 + i}" for i, e in enumerate(wide.executor_ids)}
    spec = ProgramSpec(
        name="wide", input_values=(0, 150), input_meshes=(wide, wide), output_values=(203, 204),
        nodes=(CallSpec(name="add", function_id=1, mesh=wide, inputs=(0, 150), outputs=(200,)),
               CallSpec(name="ar", function_id=2, mesh=wide, inputs=(200,), outputs=(201,),
                        collective_axes=("data",)),
               CallSpec(name="move", function_id=3, mesh=turned, inputs=(201, 0), outputs=(202,)),
               CallSpec(name="ar", function_id=2, mesh=turned, inputs=(202,), outputs=(203,),
                        collective_axes=("data",)),
               CallSpec(name="loss", function_id=4, mesh=wide, inputs=(203,), outputs=(204,), debug=True,
                        replicated_outputs=(True,))))
    groups = {1: {"data": [11] * 300}, 3: {"data": [400 + i for i in range(300)]}}
    lowered = lower(spec, 9, addresses, axis_groups=groups)
    expected = _field_by_field(spec, 9, addresses, groups)
    assert list(lowered.plans) == list(expected)
    for executor_id, plan in expected.items():
        assert lowered.plans[executor_id] == plan, executor_id
    assert lowered.function_ids["w0"] == {1, 2, 3, 4}
