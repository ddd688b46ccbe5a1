"""Lowering a program, tested as text in, text out."""

from __future__ import annotations

import pytest

from controller import CallSpec
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
