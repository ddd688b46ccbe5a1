"""What a tensor-parallel plan's values mean here: torch's own `ParallelStyle` objects, read into per-shard rules.

A plan maps module path patterns to the objects ``torch.distributed.tensor.parallel.parallelize_module``
takes: ``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``,
``PrepareModuleOutput`` and ``PrepareModuleInputOutput``. torch runs them on DTensors; here each is
read into a `Style` of local layouts, and the lowering (`lowering.py`) inserts the collectives a shard
needs into the captured program. A layout is where a tensor lives on the model axis, as the shard sees
it: `R` (every shard holds all of it), `S(dim)` (each holds its 1/size slice of ``dim``), or `P` (each
holds a partial sum: only inside a row-parallel module, before its reduction).

Two styles are our own, for shapes torch's cannot express: `FusedColwiseParallel` (a fused projection
like GPT-2's ``c_attn``, whose output is ``chunks`` tensors side by side, each split on its own) and
`ShardedAttributes` (integer attributes a module's forward reads as sizes, divided by the axis size while
it runs, e.g. GPT-2's ``split_size``). Options a per-shard program cannot honour (DTensor outputs,
``use_local_output=False``) are refused, naming the option.
"""

from __future__ import annotations

import dataclasses

from ..errors import PlacementError

__all__ = ["Layout", "R", "P", "S", "Style", "read_style", "FusedColwiseParallel", "ShardedAttributes",
           "MultiheadAttentionParallel"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a local tensor lives on the model axis: ``kind`` "R", "S" (``dim``) or "P"."""

    kind: str
    dim: int | None = None

    def __repr__(self) -> str:
        return f"S({self.dim})" if self.kind == "S" else self.kind


R, P = Layout("R"), Layout("P")


def S(dim: int) -> Layout:
    return Layout("S", dim)


@dataclasses.dataclass(frozen=True)
class FusedColwiseParallel:
    """``ColwiseParallel`` for a projection whose output is ``chunks`` tensors side by side (q, k, v in one
    ``Linear`` or ``Conv1D``): each chunk is split over the axis on its own, so a shard's output is its slice
    of every chunk, side by side again. Pair it with `ShardedAttributes` for the size the forward splits by."""

    chunks: int = 3
    input_layouts: object = None
    output_layouts: object = None

    def __post_init__(self):
        if not isinstance(self.chunks, int) or self.chunks < 1:
            raise PlacementError(f"pw.FusedColwiseParallel: chunks must be a positive int, got {self.chunks!r}")

    def __repr__(self) -> str:
        given = [f"{n}={getattr(self, n)!r}" for n in ("input_layouts", "output_layouts") if getattr(self, n)]
        return f"FusedColwiseParallel({', '.join([f'chunks={self.chunks}', *given])})"


@dataclasses.dataclass(frozen=True)
class MultiheadAttentionParallel:
    """``nn.MultiheadAttention`` with its heads split (torch's styles split only Linear and Embedding, and this
    module keeps its q, k, v projection as one parameter): each shard projects its heads' slice of q, k and v
    (column-parallel), attends over them, and projects back with its rows of ``out_proj`` (row-parallel,
    reduced before the bias). Inputs and output are whole (``Replicate()``)."""


@dataclasses.dataclass(frozen=True)
class ShardedAttributes:
    """The sizes a module's forward reads, as its shard sees them: integer attributes (heads, a split size)
    divided by the model axis size while the forward runs, restored after; and with ``input_width=True`` the
    last dim of its (whole) first input reads as its shard's width too, for a forward that takes the width
    from its input (nanoGPT's ``B, T, C = x.size()``) to shape the split projections' outputs. The input
    itself is not sliced: the projections reading it still see all of it."""

    names: tuple[str, ...]
    input_width: bool = False

    def __init__(self, *names: str, input_width: bool = False):
        if not all(isinstance(n, str) for n in names) or not (names or input_width):
            raise PlacementError(f"pw.ShardedAttributes: expected attribute names, got {names!r}")
        object.__setattr__(self, "names", tuple(names))
        object.__setattr__(self, "input_width", bool(input_width))

    def __repr__(self) -> str:
        width = ["input_width=True"] if self.input_width else []
        return f"ShardedAttributes({', '.join([*map(repr, self.names), *width])})"


@dataclasses.dataclass(frozen=True)
class Style:
    """One plan value, read: ``kind`` "colwise", "rowwise", "sequence", "attention", "prepare" or "attributes"."""

    kind: str
    source: str                                 # the plan value as the user wrote it (for errors and text)
    input_layouts: tuple = ()                   # per positional input (None: left alone)
    desired_inputs: tuple = ()
    kwarg_layouts: tuple = ()                   # ((name, layout, desired), ...)
    output_layouts: tuple = ()                  # "prepare": per output; colwise/rowwise: one
    desired_outputs: tuple = ()
    chunks: int = 1
    sequence_dim: int = 1
    attributes: tuple[str, ...] = ()
    input_width: bool = False

    def describe(self) -> str:
        if self.kind in ("colwise", "rowwise"):
            fused = f", {self.chunks} chunks" if self.chunks > 1 else ""
            return f"{self.kind}(in {self.input_layouts[0]!r} -> out {self.output_layouts[0]!r}{fused})"
        if self.kind == "attention":
            return "attention heads split (q, k, v column-parallel, out_proj row-parallel)"
        if self.kind == "sequence":
            return f"sequence(dim {self.sequence_dim})"
        if self.kind == "attributes":
            width = ["input width"] if self.input_width else []
            return f"sizes({', '.join([*self.attributes, *width])} / size)"
        parts = []
        if self.input_layouts:
            parts.append(f"inputs {list(self.input_layouts)} -> {list(self.desired_inputs)}")
        for name, layout, desired in self.kwarg_layouts:
            parts.append(f"{name} {layout!r} -> {desired!r}")
        if self.output_layouts:
            parts.append(f"outputs {list(self.output_layouts)} -> {list(self.desired_outputs)}")
        return f"prepare({'; '.join(parts)})"


def _layout(placement, where: str) -> Layout | None:
    """A torch ``Placement`` (or None) as a `Layout`; refuses the ones a plan cannot start from."""
    if placement is None:
        return None
    from torch.distributed.tensor import Partial, Replicate, Shard

    if isinstance(placement, Replicate):
        return R
    if isinstance(placement, Shard):
        return S(placement.dim)
    if isinstance(placement, Partial):
        raise PlacementError(f"{where}: a Partial() layout is refused: a module's inputs and outputs are whole "
                             f"(Replicate()) or split (Shard(dim)) between modules; reduce inside the module")
    raise PlacementError(f"{where}: expected Replicate() or Shard(dim), got {placement!r}")


def _one(placements, where: str) -> Layout:
    (only,) = placements
    return _layout(only, where)


def _refuse_dtensor_output(style, where: str) -> None:
    if not style.use_local_output:
        raise PlacementError(f"{where}: use_local_output=False is refused: it hands DTensors to the next module, "
                             f"and a per-shard program holds plain local tensors; drop the option (True is the "
                             f"default), and a loss over a sharded vocabulary as loss_parallel() computes it is "
                             f"not supported: use output_layouts=Replicate() on the head")


def read_style(value, where: str) -> Style:
    """The plan value ``value`` (matched at ``where``) as a `Style`; anything else is refused, naming it."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   PrepareModuleOutput, RowwiseParallel, SequenceParallel)

    source = repr(value)
    if isinstance(value, FusedColwiseParallel):
        return Style("colwise", source, input_layouts=(_layout(value.input_layouts, where) or R,),
                     output_layouts=(_layout(value.output_layouts, where) or S(-1),), chunks=value.chunks)
    if isinstance(value, MultiheadAttentionParallel):
        return Style("attention", source, input_layouts=(R,), output_layouts=(R,), chunks=3)
    if isinstance(value, ShardedAttributes):
        return Style("attributes", source, attributes=value.names, input_width=value.input_width)
    if isinstance(value, (ColwiseParallel, RowwiseParallel)):
        _refuse_dtensor_output(value, f"{where}: {type(value).__name__}")
        kind = "colwise" if isinstance(value, ColwiseParallel) else "rowwise"
        return Style(kind, source, input_layouts=(_one(value.input_layouts, where),),
                     output_layouts=(_one(value.output_layouts, where),))
    if isinstance(value, SequenceParallel):
        (shard,) = value.sequence_sharding
        return Style("sequence", source, sequence_dim=shard.dim)
    if isinstance(value, PrepareModuleInputOutput):
        inputs, outputs = read_style(value.prepare_module_input, where), read_style(value.prepare_module_output, where)
        return dataclasses.replace(inputs, source=source, output_layouts=outputs.output_layouts,
                                   desired_outputs=outputs.desired_outputs)
    if isinstance(value, PrepareModuleInput):
        layouts = tuple(_layout(p, where) for p in (value.input_layouts or ()))
        desired = tuple(_layout(p, where) for p in (value.desired_input_layouts or ()))
        kwargs = tuple((name, _layout(p, where), _layout(value.desired_input_kwarg_layouts.get(name), where))
                       for name, p in value.input_kwarg_layouts.items())
        return Style("prepare", source, input_layouts=layouts, desired_inputs=desired, kwarg_layouts=kwargs)
    if isinstance(value, PrepareModuleOutput):
        _refuse_dtensor_output(value, f"{where}: PrepareModuleOutput")
        return Style("prepare", source, output_layouts=tuple(_layout(p, where) for p in value.output_layouts),
                     desired_outputs=tuple(_layout(p, where) for p in value.desired_output_layouts))
    raise PlacementError(f"{where}: expected one of torch.distributed.tensor.parallel's ColwiseParallel(), "
                         f"RowwiseParallel(), SequenceParallel(), PrepareModuleInput(...), PrepareModuleOutput(...), "
                         f"or pw.FusedColwiseParallel / pw.MultiheadAttentionParallel / pw.ShardedAttributes, got "
                         f"{source}")
