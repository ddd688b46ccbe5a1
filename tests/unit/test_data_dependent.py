"""Functions whose output sizes depend on the data: capture, and the shapes the client can know before the run."""

from __future__ import annotations

import pytest
import torch

from pathways_torch.capture import InputSpec, capture
from pathways_torch.errors import CaptureError
from pathways_torch.placement import Replicate, Shard, data_dependent_global_shape
from tests.unit.test_placement import make_mesh

pytestmark = pytest.mark.timeout(60)


def _capture(fn, *shapes):
    return capture(fn, "f", [InputSpec(s, torch.float32) for s in shapes], lambda tensors: (list(tensors), {}))


def test_a_mask_or_nonzero_gives_an_unknown_size_and_everything_else_stays_static():
    masked = _capture(lambda x: (x[x > 0] * 2, x.sum(), torch.nonzero(x)), (8,))
    assert masked.data_dependent
    assert masked.describe() == "f(float32[8]) -> (float32['?'], float32[], int64['?', 1])"
    assert [list(meta.shape) for meta in masked.graph.outputs] == [[-1], [], [-1, 1]]   # -1 on the wire
    static = _capture(lambda x: x * 2, (8,))
    assert not static.data_dependent and static.outputs[0].shape == (8,)


def test_a_data_dependent_size_used_as_a_number_is_refused_with_the_fix():
    with pytest.raises(CaptureError, match=r"uses a size that depends on the data as a number.*fix: keep"):
        _capture(lambda x: x[x > 0] / x[x > 0].shape[0], (8,))


def test_global_shapes_keep_the_unknown_sizes_unknown():
    mesh = make_mesh({"data": 2})
    assert data_dependent_global_shape((None, 3), (Shard(1),), mesh) == (None, 6)
    assert data_dependent_global_shape((None,), (Shard(0),), mesh) == (None,)
    assert data_dependent_global_shape((4, None), (Replicate(),), mesh) == (4, None)
    assert data_dependent_global_shape((4, 3), (Shard(0),), mesh) == (8, 3)


def test_a_simulated_device_refuses_data_dependent_sizes_at_load():
    from executor.sim import SimBackend
    from pathways_torch.wire import pb

    load = pb.LoadFunction(function_id=1, name="positive", sim_seconds=0.001)
    load.graph.outputs.add(dtype="float32", shape=[-1])
    with pytest.raises(ValueError, match="depend on the data; a simulated device has no data"):
        SimBackend().prepare(load, [])
