"""The optimizer update of a captured training step, written as plain tensor ops.

``torch.optim``'s own functional forms call ``.item()`` on the step count unless
``capturable=True``, which refuses CPU tensors (FINDINGS): they cannot be traced.
So the update is rewritten here, op for op as ``torch.optim``'s single-tensor path
does it, on one flat buffer per parameter group. Hyper-parameters are read from
the user's ``optimizer.param_groups``; the learning rate and the step number come
in as a float64 tensor each step, so a schedule never recompiles. Anything the
rewrite does not implement is refused by name (`UnsupportedOptimizerError`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import CaptureError

__all__ = ["OptimizerSpec", "GroupHyper", "read_optimizer", "apply_update", "UnsupportedOptimizerError"]


class UnsupportedOptimizerError(CaptureError):
    """An optimizer, or an option of one, that the captured update does not implement."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupHyper:
    """A parameter group's hyper-parameters other than the learning rate (baked into the graph)."""

    weight_decay: float = 0.0
    maximize: bool = False
    momentum: float = 0.0          # SGD
    dampening: float = 0.0         # SGD
    nesterov: bool = False         # SGD
    beta1: float = 0.9             # Adam/AdamW
    beta2: float = 0.999           # Adam/AdamW
    eps: float = 1e-8              # Adam/AdamW
    decoupled: bool = False        # AdamW-style weight decay


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """What the captured step needs to know of the user's optimizer."""

    kind: str                                  # "sgd" or "adam"
    groups: tuple[GroupHyper, ...]

    @property
    def state_names(self) -> tuple[str, ...]:
        """Per-parameter state tensors, named as ``torch.optim`` names them."""
        if self.kind == "adam":
            return ("exp_avg", "exp_avg_sq")
        if any(g.momentum != 0 for g in self.groups):
            return ("momentum_buffer",)
        return ()

    def static_key(self) -> tuple:
        """Hashable form: part of the step's trace signature, so changing one re-captures."""
        return (self.kind,) + tuple(tuple(sorted(dataclasses.asdict(g).items())) for g in self.groups)


# Options that only choose an implementation of the same math: accepted and ignored.
_IMPLEMENTATION_OPTIONS = {"foreach", "fused", "capturable", "differentiable"}
_KNOWN = {
    "sgd": {"params", "lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "initial_lr"},
    "adam": {"params", "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay",
             "initial_lr"},
}


def read_optimizer(optimizer) -> OptimizerSpec:
    """Read the kind and hyper-parameters of a ``torch.optim`` optimizer; refuse what is not implemented."""
    import torch

    # AdamW subclasses Adam in torch 2.9: test it first.
    if isinstance(optimizer, torch.optim.AdamW):
        kind, decoupled = "adam", True
    elif isinstance(optimizer, torch.optim.Adam):
        kind, decoupled = "adam", None
    elif isinstance(optimizer, torch.optim.SGD):
        kind, decoupled = "sgd", False
    else:
        raise UnsupportedOptimizerError(
            f"optimizer: expected torch.optim.SGD, Adam or AdamW, got {type(optimizer).__name__}; "
            f"the captured step implements those updates only")
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        groups.append(_read_group(kind, decoupled, index, group))
    return OptimizerSpec(kind=kind, groups=tuple(groups))


def _read_group(kind: str, decoupled, index: int, group: dict) -> GroupHyper:
    where = f"optimizer param_groups[{index}]"
    for key, value in group.items():
        if key in _IMPLEMENTATION_OPTIONS:
            continue
        if key not in _KNOWN[kind]:
            raise UnsupportedOptimizerError(f"{where}: option {key!r} is not implemented by the captured update; "
                                            f"remove it (implemented: {sorted(_KNOWN[kind] - {'params'})})")
    if group.get("amsgrad"):
        raise UnsupportedOptimizerError(f"{where}: amsgrad=True is not implemented by the captured update; "
                                        f"use amsgrad=False")
    common = dict(weight_decay=_number(group.get("weight_decay", 0.0), where, "weight_decay"),
                  maximize=bool(group.get("maximize", False)))
    if kind == "sgd":
        hyper = GroupHyper(momentum=_number(group["momentum"], where, "momentum"),
                           dampening=_number(group["dampening"], where, "dampening"),
                           nesterov=bool(group["nesterov"]), **common)
        if hyper.nesterov and (hyper.momentum <= 0 or hyper.dampening != 0):
            raise UnsupportedOptimizerError(f"{where}: nesterov needs momentum > 0 and dampening 0 "
                                            f"(as torch.optim.SGD requires)")
        return hyper
    beta1, beta2 = (_number(b, where, "betas") for b in group["betas"])
    if decoupled is None:
        decoupled = bool(group.get("decoupled_weight_decay", False))
    return GroupHyper(beta1=beta1, beta2=beta2, eps=_number(group["eps"], where, "eps"), decoupled=decoupled,
                      **common)


def _number(value: Any, where: str, name: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UnsupportedOptimizerError(f"{where}: {name} must be a number, got {value!r}") from None


def apply_update(spec: OptimizerSpec, group: int, param, grad, state: tuple, step, lr):
    """One update of a flat parameter buffer. ``step`` (1-based) and ``lr`` are float64 0-d tensors.

    Returns (new param, new state tuple). Written without in-place ops on inputs, so
    the traced graph is functional.
    """
    hyper = spec.groups[group]
    if hyper.maximize:
        grad = -grad
    if spec.kind == "sgd":
        return _sgd(hyper, param, grad, state, step, lr)
    return _adam(hyper, param, grad, state, step, lr)


def _sgd(h: GroupHyper, param, grad, state, step, lr):
    import torch

    if h.weight_decay != 0:
        grad = grad + h.weight_decay * param
    # Another group may keep a momentum buffer while this one has none: pass it through.
    new_state = tuple(state)
    if h.momentum != 0:
        (buf,) = state
        # torch starts the buffer as a copy of the first gradient (no dampening on step 1).
        updated = torch.where(step <= 1, grad, buf * h.momentum + grad * (1 - h.dampening))
        new_state = (updated,)
        grad = grad + h.momentum * updated if h.nesterov else updated
    return param - lr.to(param.dtype) * grad, new_state


def _adam(h: GroupHyper, param, grad, state, step, lr):
    exp_avg, exp_avg_sq = state
    if h.weight_decay != 0:
        if h.decoupled:
            param = param * (1 - lr * h.weight_decay).to(param.dtype)
        else:
            grad = grad + h.weight_decay * param
    exp_avg = exp_avg.lerp(grad, 1 - h.beta1)
    exp_avg_sq = exp_avg_sq * h.beta2 + grad * grad * (1 - h.beta2)
    # torch computes these in Python floats (double precision): float64 tensors here.
    bias_correction1 = 1 - h.beta1 ** step
    bias_correction2_sqrt = (1 - h.beta2 ** step).sqrt()
    step_size = (lr / bias_correction1).to(param.dtype)
    denom = exp_avg_sq.sqrt() / bias_correction2_sqrt.to(param.dtype) + h.eps
    return param - step_size * (exp_avg / denom), (exp_avg, exp_avg_sq)
