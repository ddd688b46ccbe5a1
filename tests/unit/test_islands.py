"""Islands in the resource manager: meshes inside one island or across islands on an outer "island" axis,
mapped island by island; what does not fit is refused with the sizes and the fix; collectives that would
cross islands are refused before anything is sent."""

from __future__ import annotations

import types

import pytest

import pathways_torch as pw
from controller.resources import ResourceManager
from executor.__main__ import parse_args
from pathways_torch.islands import IslandTable, check_collectives_in_islands

pytestmark = pytest.mark.timeout(30)


def _resources(*sizes) -> ResourceManager:
    resources = ResourceManager()
    index = 0
    for island, size in enumerate(sizes):
        for _ in range(size):
            resources.register(f"e{index}", data_address=f"tcp://127.0.0.1:{9000 + index}", device="cpu",
                               backend="eager", pid=index, island=str(island))
            index += 1
    return resources


def test_a_mesh_across_islands_takes_each_islands_executors_in_turn():
    mesh = _resources(2, 2).allocate({"island": 2, "data": 2})
    assert mesh.executor_ids == ("e0", "e1", "e2", "e3")
    assert mesh.axis_members("data", 2) == ("e2", "e3")          # the data axis stays inside island 1
    assert mesh.axis_members("island", 1) == ("e1", "e3")


def test_a_mesh_without_an_island_axis_lies_in_the_first_island_with_room():
    resources = _resources(1, 3)
    assert resources.allocate({"data": 2}).executor_ids == ("e1", "e2")
    assert resources.allocate({"data": 1}).executor_ids == ("e0",)


@pytest.mark.parametrize("axes,executors,message", [
    ({"data": 4}, None, r"needs 4 executors in one island, and no island has that many \(live executors per "
                        r"island: \{'0': 2, '1': 2\}\); a mesh spans islands only on an outer 'island' axis"),
    ({"island": 3, "data": 1}, None, r"asks for 3 islands of 1 live executors; the cluster has islands "
                                     r"\{'0': 2, '1': 2\}"),
    ({"island": 2, "data": 3}, None, r"asks for 2 islands of 3 live executors"),
    ({"data": 2, "island": 2}, None, r"the 'island' axis must be the first \(outermost\) axis"),
    ({"data": 2}, ["e1", "e2"], r"splits an island on an inner axis"),
    ({"island": 2, "data": 2}, ["e0", "e2", "e1", "e3"], r"splits an island on an inner axis"),
    ({"data": 8}, None, r"needs 8 executors, the cluster has 4 live"),
])
def test_meshes_that_do_not_fit_the_islands_are_refused(axes, executors, message):
    with pytest.raises(pw.PlacementError, match=message):
        _resources(2, 2).allocate(axes, executors)


def test_a_collective_across_islands_is_refused_and_one_inside_is_not():
    resources = _resources(2, 2)
    mesh = resources.allocate({"island": 2, "data": 2})
    check_collectives_in_islands(types.SimpleNamespace(name="f", collective_axes=("data",)), mesh, resources.island_of)
    with pytest.raises(pw.PlacementError, match=r"f: its collective over axis 'island' would join executors of "
                                                r"islands \['0', '1'\] \(e0, e2\)"):
        check_collectives_in_islands(types.SimpleNamespace(name="f", collective_axes=("island",)), mesh,
                                     resources.island_of)


def test_the_island_table_prints_each_island():
    table = IslandTable.of(_resources(2, 1))
    assert str(table).splitlines() == [
        "2 islands; link between islands: ZeroMQ over loopback (one host)",
        "island 0: 2 executors: e0 [cpu], e1 [cpu]",
        "island 1: 1 executors: e2 [cpu]"]


def test_an_executor_declares_its_island():
    config = parse_args(["--controller", "tcp://127.0.0.1:1", "--keys", "/tmp/k", "--island", "east"])
    assert config.island == "east"
    assert parse_args(["--controller", "tcp://127.0.0.1:1", "--keys", "/tmp/k"]).island == ""


def test_context_islands_must_agree_with_num_executors():
    from pathways_torch.context import ContextConfig

    assert ContextConfig(num_executors=4, islands=(2, 2)).executor_islands() == ["0", "0", "1", "1"]
    with pytest.raises(ValueError, match=r"islands=\[2, 2\] make 4 executors but num_executors=3"):
        ContextConfig(num_executors=3, islands=(2, 2))
    with pytest.raises(ValueError, match="islands: expected executors per island"):
        ContextConfig(num_executors=1, islands=(0,))
