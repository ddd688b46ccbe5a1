"""Flat parameter buckets: every trained parameter of one optimizer group and dtype in one 1-d buffer.

One buffer per bucket (like DDP's gradient buckets and FSDP's FlatParameter)
means a training step carries a handful of arrays instead of one per tensor,
all-reduces each bucket's gradient in one collective, and updates it with one
run of vector ops. Under a sharded plan the buffer is padded to a multiple of
the shard count and split evenly.
"""

from __future__ import annotations

import dataclasses

from ..errors import CaptureError

__all__ = ["Slot", "Bucket", "make_buckets", "flatten", "unflatten", "split_for_exchange", "rebased", "itemsize"]


@dataclasses.dataclass(frozen=True)
class Slot:
    """One parameter's place in a bucket."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclasses.dataclass(frozen=True)
class Bucket:
    """The parameters of optimizer group ``group`` with dtype ``dtype``, flattened in model order."""

    group: int
    dtype: object
    slots: tuple[Slot, ...]

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    def padded_numel(self, num_shards: int) -> int:
        return -(-self.numel // num_shards) * num_shards

    def describe(self) -> str:
        names = ", ".join(s.name for s in self.slots)
        return f"group {self.group} {str(self.dtype).removeprefix('torch.')}[{self.numel}]: {names}"


def make_buckets(model, optimizer, only=None) -> tuple[list[Bucket], list[str]]:
    """(buckets of trained parameters, names of the parameters the optimizer does not train).

    ``only``: the parameter names to bucket (a pipeline chunk's), in model order; default all.
    """
    named = list(model.named_parameters())
    name_of = {id(p): n for n, p in named}
    named = [(n, p) for n, p in named if only is None or n in only]
    trained: dict[int, int] = {}
    for index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in name_of:
                raise CaptureError(f"optimizer param_groups[{index}] holds a tensor of shape {list(p.shape)} that is "
                                   f"not a parameter of {type(model).__name__}; build the optimizer from "
                                   f"model.parameters()")
            if id(p) in trained:
                raise CaptureError(f"parameter {name_of[id(p)]!r} appears in two optimizer param groups")
            trained[id(p)] = index
    by_key: dict[tuple, list] = {}
    frozen = []
    for name, p in named:
        if id(p) not in trained or not p.requires_grad:
            frozen.append(name)
            continue
        by_key.setdefault((trained[id(p)], p.dtype), []).append((name, p))
    buckets = []
    for (group, dtype), members in by_key.items():
        slots, offset = [], 0
        for name, p in members:
            slots.append(Slot(name, tuple(p.shape), offset, p.numel()))
            offset += p.numel()
        buckets.append(Bucket(group, dtype, tuple(slots)))
    if not buckets and only is None:
        raise CaptureError(f"{type(model).__name__}: the optimizer trains none of its parameters")
    return buckets, frozen


def flatten(bucket: Bucket, tensors: dict, padded_numel: int | None = None):
    """The bucket's tensors (by name) as one 1-d buffer, zero-padded to ``padded_numel``."""
    import torch

    parts = [tensors[s.name].reshape(-1) for s in bucket.slots]
    pad = (padded_numel or bucket.numel) - bucket.numel
    if pad:
        parts.append(parts[0].new_zeros(pad))
    return torch.cat(parts)


def unflatten(bucket: Bucket, flat) -> dict:
    """Views of a flat buffer as the bucket's named tensors (the padding is ignored)."""
    return {s.name: flat.narrow(0, s.offset, s.numel).view(s.shape) for s in bucket.slots}


def split_for_exchange(buckets: list[Bucket], cap_bytes: int, first_cap_bytes: int) -> list[Bucket]:
    """The buckets cut into pieces of at most ``cap_bytes`` (the first ``first_cap_bytes``), last parameters first.

    A gradient bucket that crosses islands leaves as soon as the backward has produced it, and
    the backward produces the last layers' gradients first, so the pieces run from the model's
    last parameter to its first (DDP orders its buckets the same way, with a small first one so
    that communication starts early). A parameter larger than the cap is a piece of its own.
    """
    pieces: list[Bucket] = []
    for bucket in buckets:
        members, size = [], 0
        for slot in reversed(bucket.slots):
            nbytes = slot.numel * itemsize(bucket.dtype)
            cap = first_cap_bytes if not pieces else cap_bytes
            if members and size + nbytes > cap:
                pieces.append(rebased(bucket, members[::-1]))
                members, size = [], 0
            members.append(slot)
            size += nbytes
        if members:
            pieces.append(rebased(bucket, members[::-1]))
    return pieces


def itemsize(dtype) -> int:
    """The bytes of one element of ``dtype``."""
    import torch

    return torch.empty((), dtype=dtype).element_size()


def rebased(bucket: Bucket, slots: list[Slot]) -> Bucket:
    """A bucket of ``bucket``'s ``slots`` (in the order given), offsets from 0."""
    placed, offset = [], 0
    for slot in slots:
        placed.append(Slot(slot.name, slot.shape, offset, slot.numel))
        offset += slot.numel
    return Bucket(bucket.group, bucket.dtype, tuple(placed))
