"""A tensor-parallel plan applied to one model: which module gets which style, how each parameter is split.

`assign` matches the plan's patterns against the model's module paths the way ``parallelize_module``
does (the path and the pattern split at dots, each part matched with ``fnmatch``), reads every value
(`styles.read_style`) and derives each parameter's `ParamSplit`. It checks all of it before anything is
placed: a pattern that matches nothing (naming the nearest paths), a style on a module it cannot split,
a size the axis does not divide, two styles that split one (tied) parameter two ways. The result,
`TensorPlan`, prints as the placements table ``trainer.runner.placements`` shows.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch

from ..errors import PlacementError
from .styles import Style, read_style

__all__ = ["ParamSplit", "TensorPlan", "assign", "refuse_frozen_splits", "module_kind", "SPLIT", "WHOLE", "PARTIAL"]

# How a parameter lives on the model axis, as the state's buckets are cut (one kind per bucket).
SPLIT, WHOLE, PARTIAL = "split", "whole", "partial"

# Head counts of a transformers config: every shard must hold whole heads.
_HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads", "n_head")


@dataclasses.dataclass(frozen=True)
class ParamSplit:
    """How one parameter lives on the model axis: split on ``dim`` (in ``chunks`` side-by-side parts, each split
    on its own), or whole (``dim`` None) with a gradient that is a partial sum (``partial_grad``: it was computed
    from a sequence slice, and is summed over the axis) or the same on every shard."""

    dim: int | None
    chunks: int = 1
    partial_grad: bool = False

    def describe(self) -> str:
        if self.dim is None:
            return "Replicate(), gradient summed over the axis" if self.partial_grad else "Replicate()"
        return f"Shard({self.dim})" + (f" in {self.chunks} chunks" if self.chunks > 1 else "")


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """The styles by module path and the split of every parameter, for a model axis of ``size`` shards."""

    axis: str
    size: int
    modules: tuple[tuple[str, Style], ...]           # (module path, style), in model order
    splits: dict                                     # parameter name → ParamSplit (split or partial-grad ones)
    shapes: dict                                     # parameter name → global shape

    def split_of(self, name: str) -> ParamSplit:
        return self.splits.get(name, ParamSplit(None))

    def kind_of(self, name: str) -> str:
        """SPLIT, PARTIAL (whole, its gradient a partial sum over the axis) or WHOLE."""
        split = self.split_of(name)
        return SPLIT if split.dim is not None else PARTIAL if split.partial_grad else WHOLE

    def local_shape(self, name: str) -> tuple[int, ...]:
        shape, split = list(self.shapes[name]), self.split_of(name)
        if split.dim is not None:
            shape[split.dim] //= self.size
        return tuple(shape)

    def describe(self, data: str = "") -> str:
        """One line per module style, then one per parameter: global shape, local shape, placement."""
        lines = [f"model axis {self.axis!r} of {self.size}" + (f"; {data}" if data else "")]
        lines += [f"  {path or '(the model)'}: {style.describe()}" for path, style in self.modules]
        width = max((len(n) for n in self.shapes), default=0)
        for name, shape in self.shapes.items():
            local = self.local_shape(name)
            lines.append(f"  {name:<{width}}  {list(shape)} -> {list(local)}  {self.axis}: "
                         f"{self.split_of(name).describe()}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def module_kind(module) -> str | None:
    """"linear", "conv1d" (transformers' ``Conv1D``: weight [in, out]) or "embedding"; None for other modules."""
    import torch.nn as nn

    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None:
        return "conv1d"
    return None


# (style kind, module kind) → (weight's split dim, bias's split dim or None)
_WEIGHT_DIMS = {("colwise", "linear"): (0, 0), ("colwise", "conv1d"): (1, 0), ("colwise", "embedding"): (1, None),
                ("rowwise", "linear"): (1, None), ("rowwise", "conv1d"): (0, None), ("rowwise", "embedding"): (0, None)}


def _matches(pattern: str, path: str) -> bool:
    parts, atoms = path.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(fnmatch.fnmatchcase(p, a) for p, a in zip(parts, atoms))


def _matched_paths(model, pattern: str) -> list[str]:
    paths = [path for path, _ in model.named_modules() if path]
    found = [path for path in paths if _matches(pattern, path)]
    if not found:
        near = difflib.get_close_matches(pattern, paths, n=5, cutoff=0.3) or paths[:5]
        raise PlacementError(f"TensorParallel plan: pattern {pattern!r} matches no module of "
                             f"{type(model).__name__}; the nearest module paths are {near} (patterns are module "
                             f"paths relative to the model you wrap, '*' standing for one part)")
    return found


def _check_divides(where: str, size: int, what: str, axis: str, count: int, chunks: int = 1) -> None:
    if size % (count * chunks):
        by = f"the {count} shards of axis {axis!r}" + (f" x {chunks} chunks" if chunks > 1 else "")
        raise PlacementError(f"{where}: {what} is {size}, not divisible by {by}; use a model axis that divides "
                             f"it, or leave this module out of the plan")


def _param_splits(path: str, module, style: Style, axis: str, size: int) -> dict:
    """Parameter (module-local name) → ParamSplit that ``style`` gives ``module`` at ``path``."""
    if style.kind == "sequence":
        return {name: ParamSplit(None, partial_grad=True) for name, _ in module.named_parameters()}
    if style.kind == "attention":
        return _attention_splits(path, module, style, axis, size)
    if style.kind not in ("colwise", "rowwise"):
        return {}
    kind = module_kind(module)
    if kind is None:
        raise PlacementError(f"{path}: {style.source} splits nn.Linear, nn.Embedding and transformers' Conv1D; "
                             f"this module is a {type(module).__name__}: name its projections instead")
    weight_dim, bias_dim = _WEIGHT_DIMS[(style.kind, kind)]
    splits = {"weight": ParamSplit(weight_dim, style.chunks)}
    _check_divides(f"{path}.weight", module.weight.shape[weight_dim], f"dim {weight_dim} of shape "
                   f"{list(module.weight.shape)}", axis, size, style.chunks)
    if kind == "embedding":
        _check_embedding(path, module, style)
    if getattr(module, "bias", None) is not None:
        # A row-parallel bias is added after the reduction; to a split output (a sequence slice, or a feature
        # slice of the bias) its gradient is partial on each shard.
        partial = style.kind == "rowwise" and style.output_layouts[0].kind == "S"
        splits["bias"] = ParamSplit(bias_dim, style.chunks if bias_dim is not None else 1, partial_grad=partial)
    return splits


def _check_embedding(path: str, module, style: Style) -> None:
    """Options a split embedding cannot honour: a norm over a whole row (``max_norm``) whichever way it is split;
    per-id counts and sparse gradients over a vocabulary each shard sees a part of."""
    refused = ["max_norm"] if module.max_norm else []
    if style.kind == "rowwise":
        refused += [o for o in ("scale_grad_by_freq", "sparse") if getattr(module, o)]
    if refused:
        raise PlacementError(f"{path}: {style.source} on an nn.Embedding with {refused[0]} set is refused: "
                             f"{'a row is renormalised as a whole, and each shard holds a part of it' if refused[0] == 'max_norm' else 'each shard sees only the ids of its rows'}; "
                             f"leave this embedding out of the plan")


def _attention_splits(path: str, module, style: Style, axis: str, size: int) -> dict:
    import torch.nn as nn

    if not isinstance(module, nn.MultiheadAttention):
        raise PlacementError(f"{path}: {style.source} splits an nn.MultiheadAttention; this module is a "
                             f"{type(module).__name__}")
    for option, value in (("kdim/vdim", not same_qkv_dims(module)), ("add_bias_kv", module.bias_k is not None),
                          ("add_zero_attn", module.add_zero_attn)):
        if value:
            raise PlacementError(f"{path}: {style.source} with {option} set is refused: the heads are split from "
                                 f"one q, k, v projection; leave this module out of the plan")
    _check_divides(path, module.num_heads, "num_heads", axis, size)
    splits = {"in_proj_weight": ParamSplit(0, 3), "out_proj.weight": ParamSplit(1)}
    if module.in_proj_bias is not None:
        splits["in_proj_bias"] = ParamSplit(0, 3)
    return splits


def _in_attention(path: str, modules: dict) -> bool:
    """Whether the module at ``path`` is (in) an attention module, whose heads the axis must divide."""
    parts = path.split(".")
    return any("attention" in type(modules[".".join(parts[:i])]).__name__.lower()
               or "attn" in parts[i - 1].lower() for i in range(1, len(parts) + 1))


def _check_heads(model, axis: str, size: int) -> None:
    config = getattr(model, "config", None)
    for field in _HEAD_FIELDS:
        count = getattr(config, field, None)
        if isinstance(count, int):
            _check_divides(f"{type(model).__name__}.config.{field}", count, "the head count", axis, size)


def assign(model, plan: dict, axis: str, size: int) -> TensorPlan:
    """The `TensorPlan` of ``plan`` on ``model`` with a model axis of ``size``; refuses bad input first."""
    if not isinstance(plan, dict) or not plan:
        raise PlacementError(f"TensorParallel: plan must be a non-empty dict of module path pattern -> style, "
                             f"got {plan!r}; pw.tensor_parallel_plan(model) proposes one")
    modules = dict(model.named_modules())
    styles: dict[str, list[Style]] = {}
    for pattern, value in plan.items():
        if not isinstance(pattern, str):
            raise PlacementError(f"TensorParallel plan: keys are module path patterns (str), got {pattern!r}")
        for path in _matched_paths(model, pattern):
            styles.setdefault(path, []).append(read_style(value, path))
    names = {id(p): n for n, p in model.named_parameters()}
    splits: dict[str, ParamSplit] = {}
    for path, path_styles in styles.items():
        module = modules[path]
        kinds = [s.kind for s in path_styles if s.kind in ("colwise", "rowwise", "sequence", "attention")]
        if len(kinds) > 1:
            raise PlacementError(f"{path}: patterns give it {kinds}; a module takes one of them")
        for style in path_styles:
            if style.kind == "attributes":
                for attr in style.attributes:
                    value = getattr(module, attr, None)
                    if not isinstance(value, int):
                        raise PlacementError(f"{path}: ShardedAttributes names {attr!r}, but "
                                             f"{type(module).__name__}.{attr} is {value!r}, not an int")
                    _check_divides(f"{path}.{attr}", value, "its value", axis, size)
            for local, split in _param_splits(path, module, style, axis, size).items():
                name = names.get(id(module.get_parameter(local)))
                if name is None:
                    continue
                if splits.setdefault(name, split) != split:
                    tied = " (tied: another module holds it too)" if not name.startswith(f"{path}.") else ""
                    raise PlacementError(f"{name}{tied}, reached from {path}: the plan splits it as "
                                         f"{splits[name].describe()} and as {split.describe()}; a parameter "
                                         f"needs one split: give the styles that reach it matching splits")
    if any(_in_attention(path, modules) for path in styles if any(
            s.kind in ("colwise", "attention") for s in styles[path])):
        _check_heads(model, axis, size)
    order = {path: i for i, path in enumerate(modules)}
    ordered = sorted(((p, s) for p, ss in styles.items() for s in ss), key=lambda item: order[item[0]])
    return TensorPlan(axis=axis, size=size, modules=tuple(ordered), splits=splits,
                      shapes={n: tuple(p.shape) for n, p in model.named_parameters()})


def refuse_frozen_splits(model, plan: TensorPlan) -> None:
    """Frozen parameters live with the buffers, whole on every shard: the plan may not split one."""
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad and plan.split_of(n).dim is not None]
    if frozen:
        raise PlacementError(f"pw.TensorParallel: frozen parameters {frozen} would be split; splitting a frozen "
                             f"parameter is not supported: leave its module out of the plan")


def same_qkv_dims(module) -> bool:
    """Whether an ``nn.MultiheadAttention``'s keys and values have its embedding's width (no ``kdim``/``vdim``):
    then one fused in-projection holds q, k and v, which a split by heads needs (torch's own test)."""
    return module.kdim == module.embed_dim and module.vdim == module.embed_dim
