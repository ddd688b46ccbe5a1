"""The torchax compatibility layer (executor/backends/torchax_compat.py): one test per shim, failing once the shim
is no longer needed, and a check that the placeholders reach torchax only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.compat, pytest.mark.timeout(120)]



def _torch_at_least(major: int, minor: int) -> bool:
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return version >= (major, minor)


@pytest.fixture(scope="module")
def without_shims() -> dict:
    from pathways_torch.wire.backend_names import route_installed

    if not route_installed("xla:torchax"):
        pytest.skip("torchax and jax are not installed")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT)
    done = subprocess.run([sys.executable, "-m", "tests.unit.torchax_without_shims"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_removed_overloads_shim_is_needed_exactly_on_torch_2_13_and_later(without_shims):
    if _torch_at_least(2, 13):
        assert without_shims["plain_import"] != "ok", (
            f"torchax now imports on torch {torch.__version__} without the placeholders for removed ops: "
            "remove _placeholders_for_removed_ops from executor/backends/torchax_compat.py")
        assert "overload name" in without_shims["plain_import"] or "has no attribute" in without_shims["plain_import"]
    else:
        assert without_shims["plain_import"] == "ok", without_shims["plain_import"]


def test_layer_norm_backward_replacement_is_needed(without_shims):
    assert without_shims["native_layer_norm_backward"] != "ok", (
        "torchax's own native_layer_norm_backward now gives the right gradients: remove it from REPLACED_LOWERINGS")


def test_flash_attention_lowerings_are_needed(without_shims):
    assert without_shims["flash_attention_for_cpu"] != "ok", (
        "torchax now lowers CPU flash attention forward and backward correctly: remove ADDED_LOWERINGS")


def test_convolution_backward_lowering_is_needed(without_shims):
    assert without_shims["convolution_backward"] != "ok", (
        "torchax now lowers aten.convolution_backward: remove it from ADDED_LOWERINGS (executor/backends/convolution.py)")


def test_placeholders_reach_torchax_only():
    from pathways_torch.wire.backend_names import route_installed

    if not route_installed("xla:torchax"):
        pytest.skip("torchax and jax are not installed")
    from executor.backends.torchax_compat import import_torchax, removed_names_seen

    import_torchax()
    if _torch_at_least(2, 13):
        assert "aten.prod.dim_Dimname" in removed_names_seen()
        # Outside torchax's own lookups, a removed overload is still an AttributeError, and hasattr is honest.
        with pytest.raises(AttributeError):
            torch.ops.aten.prod.dim_Dimname
        assert not hasattr(torch.ops.aten, "cholesky")
    else:
        assert removed_names_seen() == []
    assert hasattr(torch.ops.aten.prod, "dim_int")
