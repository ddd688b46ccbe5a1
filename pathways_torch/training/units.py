"""Units of a sharded step: the groups of parameters gathered together, just before their forward (FSDP's units).

A unit is one of the model's repeated blocks — found as the pipeline split finds them (the model itself if it is
an ``nn.Sequential``, else its largest block list: ``self.layers``, ``self.h``, ``self.blocks`` …) — or a module
the user names (``pw.ShardedDataParallel(axis, units=["encoder", "decoder.layers.0", ...])``). The parameters in
no unit (embeddings, a final norm, a head) form the *rest*: one more bucket per optimizer group and dtype, gathered
once and kept through the step (FSDP's root). Each unit's parameters are flat buckets of their own
(`split_by_units`), so that one all-gather brings one unit and one reduce-scatter takes its gradient. Found blocks
smaller than ``min_unit_mb`` join the next ones: each gather costs a round trip whatever its size.

A model with no repeated blocks and no ``units=`` falls back to one unit per bucket of at most `LOCAL_BUCKET_MB`,
with a warning that says so. ``print(trainer.runner.units)`` shows the units.
"""

from __future__ import annotations

import dataclasses
import logging

from ..errors import PlacementError
from .buckets import Bucket, itemsize, rebased, split_for_exchange

__all__ = ["Units", "plan_units", "block_list", "split_by_units", "BLOCK_LIST_NAMES"]

log = logging.getLogger(__name__)

BLOCK_LIST_NAMES = ("layers", "h", "blocks", "layer", "block", "decoder_layers", "encoder_layers")


def block_list(model) -> tuple[str, list] | None:
    """The model's block list: ``(name, [modules])`` — the model itself if it is an ``nn.Sequential``, else the
    largest ``nn.ModuleList``/``nn.Sequential`` named like a block list (else the largest one) — or None."""
    import torch

    if isinstance(model, torch.nn.Sequential):
        return "", list(model.children())
    candidates = []
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and len(module) > 1:
            short = name.rsplit(".", 1)[-1]
            numel = sum(p.numel() for p in module.parameters())
            candidates.append((short in BLOCK_LIST_NAMES, numel, name, list(module)))
    if not candidates:
        return None
    _, _, name, blocks = max(candidates, key=lambda c: (c[0], c[1]))
    return name, blocks


@dataclasses.dataclass(frozen=True)
class Units:
    """The gather groups of a sharded step: ``names[u]`` is unit u's module; ``bucket_units[b]`` the unit of
    bucket b (None: the rest, parameters in no unit). ``how``: where the units came from."""

    names: tuple[str, ...]
    bucket_units: tuple[int | None, ...]
    buckets: tuple[Bucket, ...]
    how: str

    def __str__(self) -> str:
        n = len(self.names)
        lines = [f"{n} unit{'s' * (n != 1)} ({self.how}), {len(self.buckets)} bucket{'s' * (len(self.buckets) != 1)}:"]
        for u, name in enumerate(self.names):
            lines.append(f"unit {u} {name!r}: {self._summary([b for b, owner in self._owned() if owner == u])}")
        rest = [b for b, owner in self._owned() if owner is None]
        if rest:
            names = [s.name for b in rest for s in b.slots]
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            lines.append(f"rest ({shown}): {self._summary(rest)}")
        return "\n".join(lines)

    def _owned(self):
        return zip(self.buckets, self.bucket_units)

    @staticmethod
    def _summary(buckets: list[Bucket]) -> str:
        params = sum(len(b.slots) for b in buckets)
        nbytes = sum(b.numel * itemsize(b.dtype) for b in buckets)
        return f"{params} parameters, {_size(nbytes)} in {len(buckets)} bucket{'s' * (len(buckets) != 1)}"


def plan_units(model, buckets: list[Bucket], units: tuple[str, ...] | None, fallback_bytes: int,
               min_unit_bytes: int = 0) -> Units:
    """The units of ``model`` (``units``: module names the user chose, else its repeated blocks) and ``buckets``
    cut so that each holds one unit's parameters (the rest's: one piece per bucket). Raises `PlacementError` for
    names that are no module or that overlap; warns and falls back to buckets of ``fallback_bytes`` when the model
    has no blocks. Found blocks smaller than ``min_unit_bytes`` join the next ones (a gather costs a round trip
    whatever its size)."""
    if units is not None:
        groups, how = [[name] for name in _checked_names(model, units)], "units= given"
    else:
        groups, how = [[name] for name in _block_names(model)], "the model's repeated blocks"
        if len(groups) < 2:
            pieces = split_for_exchange(buckets, fallback_bytes, fallback_bytes)
            log.warning("pw.ShardedDataParallel: %s has no repeated blocks (no nn.Sequential, self.layers, self.h "
                        "...) and no units= was given; falling back to one unit per bucket of at most %.0f MB; "
                        "pass units=[module names] to choose", type(model).__name__, fallback_bytes / 2**20)
            return Units(tuple(f"bucket {i}" for i in range(len(pieces))), tuple(range(len(pieces))),
                         tuple(pieces), f"fallback: one per bucket of at most {fallback_bytes / 2**20:.0f} MB")
        if min_unit_bytes:
            joined = _merged(model, [name for [name] in groups], min_unit_bytes)
            if len(joined) == 1:
                # All blocks together are one unit: the rest joins it (one gather of the whole model, kept: the
                # gather-all step's collectives, with the gradient reduced as soon as it is made).
                joined, how = [[""]], f"its blocks make one unit of at least {_size(min_unit_bytes)}"
            elif len(joined) < len(groups):
                how += f", joined into units of at least {_size(min_unit_bytes)}"
            groups = joined
    names = ["(the whole model)" if group == [""] else " + ".join(group) for group in groups]
    cut, owners = split_by_units(buckets, lambda name: _unit_of(name, groups))
    return Units(tuple(names), tuple(owners), tuple(cut), how)


def _merged(model, names: list[str], min_unit_bytes: int) -> list[list[str]]:
    """Consecutive blocks joined until each unit holds at least ``min_unit_bytes`` (a last short one joins the
    unit before it), as lists of block names."""
    modules = dict(model.named_modules())
    sizes = [sum(p.numel() * p.element_size() for p in modules[name].parameters()) for name in names]
    joined, run, size = [], [], 0
    for name, nbytes in zip(names, sizes):
        run.append(name)
        size += nbytes
        if size >= min_unit_bytes:
            joined.append(run)
            run, size = [], 0
    if run:
        if joined:
            joined[-1].extend(run)
        else:
            joined.append(run)
    return joined


def split_by_units(buckets: list[Bucket], unit_of) -> tuple[list[Bucket], list]:
    """Each bucket cut into one piece per unit (``unit_of(parameter name)``), in model order, and one piece for
    its parameters in no unit (None), first: (pieces, each piece's unit)."""
    pieces, owners = [], []
    for bucket in buckets:
        by_unit: dict = {}
        for slot in bucket.slots:
            by_unit.setdefault(unit_of(slot.name), []).append(slot)
        for unit in sorted(by_unit, key=lambda u: -1 if u is None else u):
            pieces.append(rebased(bucket, by_unit[unit]))
            owners.append(unit)
    return pieces, owners


def _unit_of(parameter: str, groups: list[list[str]]) -> int | None:
    for index, names in enumerate(groups):
        if any(name == "" or parameter.startswith(name + ".") for name in names):
            return index
    return None


def _block_names(model) -> list[str]:
    """The names of the model's repeated blocks that hold parameters."""
    found = block_list(model)
    if found is None:
        return []
    ids = {id(module): name for name, module in model.named_modules()}
    return [ids[id(block)] for block in found[1] if any(True for _ in block.parameters())]


def _checked_names(model, units) -> list[str]:
    """``units`` (module names: the plan checked their type) if each is a module of ``model`` and none overlaps."""
    modules = dict(model.named_modules())
    missing = [u for u in units if u not in modules]
    if missing:
        known = [n for n in modules if n][:8]
        raise PlacementError(f"pw.ShardedDataParallel: units= names modules that {type(model).__name__} does not "
                             f"have: {missing}; its modules include {known}")
    overlapping = sorted({(a, b) for i, a in enumerate(units) for j, b in enumerate(units)
                          if i != j and (a == b or b.startswith(a + ".") or a == "")})
    if overlapping:
        pairs = ", ".join(f"{a!r} holds {b!r}" if a != b else f"{a!r} twice" for a, b in overlapping)
        raise PlacementError(f"pw.ShardedDataParallel: units= overlap ({pairs}); name each parameter's unit once")
    return list(units)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"
