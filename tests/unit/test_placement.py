"""Block arithmetic of pathways_torch.placement on fake mesh allocations."""

import pytest
import torch

from controller.resources import MeshAllocation
from pathways_torch.errors import PlacementError
from pathways_torch.placement import (
    Mesh, Replicate, Shard, assemble_blocks, global_shape, local_shape, normalize_placements,
    positions_needed, split_blocks,
)

pytestmark = pytest.mark.timeout(60)


def make_mesh(axes):
    axes = tuple(axes.items())
    size = 1
    for _, n in axes:
        size *= n
    return Mesh(None, MeshAllocation(1, axes, tuple(f"e{i}" for i in range(size))))


@pytest.fixture
def mesh2x2():
    return Mesh(None, MeshAllocation(1, (("a", 2), ("b", 2)), ("e0", "e1", "e2", "e3")))


@pytest.fixture
def mesh4():
    return make_mesh({"a": 4})


# ---------------------------------------------------------------- Mesh basics

def test_mesh_shape_and_coords_are_row_major(mesh2x2):
    assert mesh2x2.size == 4
    assert mesh2x2.shape == (2, 2)
    assert mesh2x2.axis_names == ("a", "b")
    assert [mesh2x2.coords(p) for p in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_mesh_same_shape_depends_on_axis_names_and_order(mesh2x2):
    assert mesh2x2.same_shape(make_mesh({"a": 2, "b": 2}))
    assert not mesh2x2.same_shape(make_mesh({"b": 2, "a": 2}))
    assert not mesh2x2.same_shape(make_mesh({"a": 4}))


# ---------------------------------------------------------------- local/global shape

@pytest.mark.parametrize("placements, shape, block", [
    ([Shard(0), Shard(1)], (4, 6), (2, 3)),
    ([Shard(0), Shard(0)], (8, 6), (2, 6)),
    ([Replicate(), Shard(1)], (4, 6), (4, 3)),
    ([Shard(1), Replicate()], (4, 6), (4, 3)),
    ([Replicate(), Replicate()], (4, 6), (4, 6)),
    ([Shard(2), Shard(0)], (2, 3, 4), (1, 3, 2)),
])
def test_local_and_global_shape_are_inverse(mesh2x2, placements, shape, block):
    assert local_shape(shape, placements, mesh2x2) == block
    assert global_shape(block, placements, mesh2x2) == shape


def test_local_shape_1d_mesh(mesh4):
    assert local_shape((8, 3), [Shard(0)], mesh4) == (2, 3)
    assert local_shape((8, 3), [Replicate()], mesh4) == (8, 3)
    assert global_shape((2, 3), [Shard(1)], mesh4) == (2, 12)


def test_zero_d_block_under_shard0_is_a_vector_of_one_per_shard(mesh4, mesh2x2):
    assert global_shape((), [Shard(0)], mesh4) == (4,)
    assert global_shape((), [Shard(0), Shard(0)], mesh2x2) == (4,)
    assert global_shape((), [Shard(0), Replicate()], mesh2x2) == (2,)
    assert global_shape((), [Replicate()], mesh4) == ()


def test_zero_d_tensor_cannot_be_sharded(mesh4):
    with pytest.raises(PlacementError, match="0-d tensor cannot be Shard"):
        local_shape((), [Shard(0)], mesh4)
    assert local_shape((), [Replicate()], mesh4) == ()


def test_not_divisible_error_names_sizes(mesh2x2):
    with pytest.raises(PlacementError) as info:
        local_shape((5, 4), [Shard(0), Replicate()], mesh2x2)
    message = str(info.value)
    assert "dim 0" in message
    assert "(5, 4)" in message
    assert "size 5" in message
    assert "2 shards" in message
    assert "multiple of 2" in message


def test_not_divisible_error_counts_combined_shards(mesh2x2):
    # Two axes of size 2 both shard dim 1: 4 shards, and 6 is not a multiple of 4.
    with pytest.raises(PlacementError) as info:
        local_shape((4, 6), [Shard(1), Shard(1)], mesh2x2)
    message = str(info.value)
    assert "dim 1" in message and "size 6" in message and "4 shards" in message


def test_shard_dim_beyond_rank_is_refused(mesh4):
    with pytest.raises(PlacementError, match=r"Shard\(2\).*2 dims"):
        local_shape((4, 4), [Shard(2)], mesh4)


def test_shard_rejects_negative_dim():
    with pytest.raises(PlacementError, match="non-negative"):
        Shard(-1)
    with pytest.raises(PlacementError):
        Shard("0")


# ---------------------------------------------------------------- split / assemble

def _round_trip(tensor, placements, mesh):
    blocks = split_blocks(tensor, placements, mesh)
    assert len(blocks) == mesh.size
    block_shape = local_shape(tuple(tensor.shape), placements, mesh)
    for b in blocks:
        assert tuple(b.shape) == block_shape
    wanted = positions_needed(block_shape, placements, mesh)
    back = assemble_blocks({p: blocks[p].clone() for p in wanted}, block_shape, placements, mesh)
    return blocks, wanted, back


@pytest.mark.parametrize("placements", [[Shard(0)], [Shard(1)], [Replicate()]])
def test_split_assemble_round_trip_1d(mesh4, placements):
    x = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    _, _, back = _round_trip(x, placements, mesh4)
    assert torch.equal(back, x)


def test_split_1d_blocks_are_in_position_order(mesh4):
    x = torch.arange(8)
    blocks = split_blocks(x, [Shard(0)], mesh4)
    assert [b.tolist() for b in blocks] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("placements, shape", [
    ([Shard(0), Shard(1)], (4, 6)),
    ([Shard(0), Shard(0)], (8, 3)),
    ([Replicate(), Shard(1)], (3, 6)),
    ([Shard(1), Shard(0)], (4, 6)),
    ([Replicate(), Replicate()], (3, 5)),
])
def test_split_assemble_round_trip_2d(mesh2x2, placements, shape):
    x = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
    _, _, back = _round_trip(x, placements, mesh2x2)
    assert torch.equal(back, x)


def test_split_2d_shard_shard_blocks(mesh2x2):
    x = torch.arange(16).reshape(4, 4)
    blocks = split_blocks(x, [Shard(0), Shard(1)], mesh2x2)
    # position (a, b): rows from a, columns from b.
    assert torch.equal(blocks[0], x[:2, :2])
    assert torch.equal(blocks[1], x[:2, 2:])
    assert torch.equal(blocks[2], x[2:, :2])
    assert torch.equal(blocks[3], x[2:, 2:])


def test_split_2d_same_dim_twice_uses_earlier_axis_as_major(mesh2x2):
    x = torch.arange(8)
    blocks = split_blocks(x, [Shard(0), Shard(0)], mesh2x2)
    assert [b.tolist() for b in blocks] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_split_replicate_axis_gives_equal_blocks(mesh2x2):
    x = torch.arange(12).reshape(2, 6)
    blocks = split_blocks(x, [Replicate(), Shard(1)], mesh2x2)
    assert torch.equal(blocks[0], blocks[2]) and torch.equal(blocks[1], blocks[3])
    assert torch.equal(blocks[0], x[:, :3]) and torch.equal(blocks[1], x[:, 3:])


def test_split_blocks_are_views(mesh4):
    x = torch.zeros(8)
    blocks = split_blocks(x, [Shard(0)], mesh4)
    blocks[1][0] = 5.0
    assert x[2].item() == 5.0


def test_split_refuses_uneven_shapes(mesh2x2):
    with pytest.raises(PlacementError, match="size 3"):
        split_blocks(torch.zeros(3, 4), [Shard(0), Shard(1)], mesh2x2)


def test_assemble_zero_d_blocks_under_shard0(mesh4, mesh2x2):
    blocks = {p: torch.tensor(float(p) * 10) for p in range(4)}
    out = assemble_blocks(blocks, (), [Shard(0)], mesh4)
    assert out.tolist() == [0.0, 10.0, 20.0, 30.0]
    # Only the first axis shards: positions 0 and 2 stand for the two distinct blocks.
    assert positions_needed((), [Shard(0), Replicate()], mesh2x2) == [0, 2]
    out2 = assemble_blocks({0: torch.tensor(1.0), 2: torch.tensor(2.0)}, (), [Shard(0), Replicate()], mesh2x2)
    assert out2.tolist() == [1.0, 2.0]


def test_assemble_zero_d_replicated_returns_the_scalar(mesh4):
    out = assemble_blocks({0: torch.tensor(7.0)}, (), [Replicate()], mesh4)
    assert out.shape == () and out.item() == 7.0


# ---------------------------------------------------------------- positions_needed

@pytest.mark.parametrize("placements, expected", [
    ([Shard(0), Shard(1)], [0, 1, 2, 3]),
    ([Shard(0), Shard(0)], [0, 1, 2, 3]),
    ([Replicate(), Shard(1)], [0, 1]),
    ([Shard(0), Replicate()], [0, 2]),
    ([Replicate(), Replicate()], [0]),
])
def test_positions_needed_2d(mesh2x2, placements, expected):
    assert positions_needed((2, 2), placements, mesh2x2) == expected


def test_positions_needed_1d(mesh4):
    assert positions_needed((2,), [Shard(0)], mesh4) == [0, 1, 2, 3]
    assert positions_needed((2,), [Replicate()], mesh4) == [0]


# ---------------------------------------------------------------- normalize_placements

def test_normalize_single_placement_repeats_per_axis(mesh2x2):
    assert normalize_placements(Shard(0), mesh2x2) == (Shard(0), Shard(0))
    assert normalize_placements(Replicate(), mesh2x2) == (Replicate(), Replicate())


def test_normalize_dict_fills_missing_axes_with_replicate(mesh2x2):
    assert normalize_placements({"b": Shard(1)}, mesh2x2) == (Replicate(), Shard(1))
    assert normalize_placements({"b": Shard(1), "a": Shard(0)}, mesh2x2) == (Shard(0), Shard(1))
    assert normalize_placements({}, mesh2x2) == (Replicate(), Replicate())


def test_normalize_list_passes_through_as_tuple(mesh2x2):
    out = normalize_placements([Shard(0), Replicate()], mesh2x2)
    assert out == (Shard(0), Replicate()) and isinstance(out, tuple)


def test_normalize_dict_unknown_axis(mesh2x2):
    with pytest.raises(PlacementError) as info:
        normalize_placements({"c": Shard(0)}, mesh2x2)
    assert "['c']" in str(info.value) and "['a', 'b']" in str(info.value)


def test_normalize_wrong_length(mesh2x2):
    with pytest.raises(PlacementError, match="one placement per mesh axis"):
        normalize_placements([Shard(0)], mesh2x2)
    with pytest.raises(PlacementError, match="one placement per mesh axis"):
        normalize_placements([Shard(0), Shard(1), Replicate()], mesh2x2)


def test_normalize_rejects_non_placements(mesh2x2):
    with pytest.raises(PlacementError, match="expected pw.Shard"):
        normalize_placements([Shard(0), 1], mesh2x2)
    with pytest.raises(PlacementError):
        normalize_placements({"a": "shard"}, mesh2x2)


def test_placement_error_is_a_value_error():
    assert issubclass(PlacementError, ValueError)
