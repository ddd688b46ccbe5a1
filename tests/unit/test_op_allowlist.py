"""The allow-list of ops a graph may name: every entry is a real op, and none admits a file, storage or the process."""

import pytest
import torch

from pathways_torch.wire import collective_ops  # noqa: F401  (registers torch.ops.pathways.*)
from pathways_torch.wire.op_allowlist import (ALLOWED_FAMILIES, ALLOWED_OVERLOADS, ALLOWED_PREFIXES, NEVER_ALLOWED,
                                              is_allowed)

pytestmark = pytest.mark.timeout(60)


def _packet(family: str):
    namespace, op = family.split(".", 1)
    return getattr(getattr(torch.ops, namespace), op)


def test_every_entry_names_an_op_of_this_torch():
    """A misspelt family would admit nothing (and hide that a needed op is missing)."""
    unknown = []
    for family in sorted(ALLOWED_FAMILIES | {name.rpartition(".")[0] for name in ALLOWED_OVERLOADS}):
        try:
            _packet(family)
        except (AttributeError, RuntimeError):
            unknown.append(family)
    assert not unknown, f"expected every allow-list entry to be an op of torch {torch.__version__}, got {unknown}"


def test_no_entry_admits_what_must_never_run():
    assert not ALLOWED_FAMILIES & NEVER_ALLOWED
    assert not [family for family in NEVER_ALLOWED if family.startswith(ALLOWED_PREFIXES)]
    for name in ("aten.from_file.default", "aten.set_.source_Storage", "aten.set_.source_Storage_storage_offset",
                 "aten.set_.source_Tensor", "aten.resize_.default", "aten._local_scalar_dense.default"):
        assert not is_allowed(name), name


def test_families_admit_every_overload_and_nothing_else():
    assert is_allowed("aten.add.Tensor") and is_allowed("aten.add.Scalar") and is_allowed("aten.add_.Tensor")
    assert is_allowed("aten._foreach_mul_.Scalar") and is_allowed("pathways.all_reduce.default")
    assert not is_allowed("aten.addx.Tensor") and not is_allowed("pathways.pipe_split.default")
    assert not is_allowed("aten") and not is_allowed("")
