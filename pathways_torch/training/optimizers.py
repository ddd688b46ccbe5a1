"""The optimizer update of a captured training step, written as plain tensor ops.

``torch.optim``'s own functional forms call ``.item()`` on the step count unless
``capturable=True``, which refuses CPU tensors (FINDINGS): they cannot be traced.
So the update is rewritten here, op for op as ``torch.optim``'s single-tensor path
does it, on one flat buffer per parameter group. Hyper-parameters are read from
the user's ``optimizer.param_groups`` at every step. What a scheduler changes — the
learning rate, SGD's momentum, Adam's betas, the weight decay — comes in as float64
tensors each step (`DYNAMIC`), so no schedule in ``torch.optim.lr_scheduler``
recompiles; only what changes the update's structure (momentum on or off, Nesterov,
eps, ...) is part of the graph. Keys a group carries that the update does not read
(``"name"``, ``"initial_lr"``, ``"max_lr"`` ...) are carried; a ``torch.optim`` option
the rewrite does not implement is refused by name (`UnsupportedOptimizerError`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import CaptureError

__all__ = ["OptimizerSpec", "GroupHyper", "read_optimizer", "apply_update", "UnsupportedOptimizerError", "DYNAMIC"]

# The hyper-parameters that are step inputs (a float64 row per group), in this order.
DYNAMIC = ("lr", "momentum", "beta1", "beta2", "weight_decay")


class UnsupportedOptimizerError(CaptureError):
    """An optimizer, or an option of one, that the captured update does not implement."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupHyper:
    """A parameter group's hyper-parameters as read this step (the `DYNAMIC` ones are step inputs)."""

    lr: float = 0.0
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
        """What shapes the update's graph (part of the step's trace signature: changing one re-captures).
        The values of `DYNAMIC` are not in it; whether momentum and weight decay are used at all is."""
        return (self.kind,) + tuple(
            tuple(sorted({**{k: v for k, v in dataclasses.asdict(g).items() if k not in DYNAMIC},
                          "uses_momentum": g.momentum != 0, "uses_weight_decay": g.weight_decay != 0}.items()))
            for g in self.groups)

    def dynamic_values(self) -> list[float]:
        """The `DYNAMIC` hyper-parameters of every group, group after group (the step's float64 inputs)."""
        return [float(getattr(g, name)) for g in self.groups for name in DYNAMIC]


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
    options = set(getattr(optimizer, "defaults", {}))   # torch.optim's own options for this optimizer
    for index, group in enumerate(optimizer.param_groups):
        groups.append(_read_group(kind, decoupled, index, group, options))
    return OptimizerSpec(kind=kind, groups=tuple(groups))


def _read_group(kind: str, decoupled, index: int, group: dict, options: set) -> GroupHyper:
    where = f"optimizer param_groups[{index}]"
    for key in group:
        # A torch.optim option we do not implement changes the update: refused. Any other key (a group's
        # "name", a scheduler's "initial_lr" / "max_lr" ...) is the user's or a scheduler's: carried.
        if key in options and key not in _KNOWN[kind] and key not in _IMPLEMENTATION_OPTIONS:
            raise UnsupportedOptimizerError(f"{where}: option {key!r} is not implemented by the captured update; "
                                            f"remove it (implemented: {sorted(_KNOWN[kind] - {'params'})})")
    if group.get("amsgrad"):
        raise UnsupportedOptimizerError(f"{where}: amsgrad=True is not implemented by the captured update; "
                                        f"use amsgrad=False")
    common = dict(lr=_number(group["lr"], where, "lr"),
                  weight_decay=_number(group.get("weight_decay", 0.0), where, "weight_decay"),
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


def apply_update(spec: OptimizerSpec, group: int, param, grad, state: tuple, step, hyper, in_place: bool = False):
    """One update of a flat parameter buffer. ``step`` (1-based) is a float64 0-d tensor; ``hyper`` the
    group's `DYNAMIC` values, a float64 tensor in that order.

    Returns (new param, new state tuple). ``in_place``: Adam's update writes ``param`` and its state where
    they are (the step that donates them: executors copy an input first unless the step alone holds it) and
    returns them; the values are the same, op for op, as the functional form, which keeps the traced graph
    free of writes to its inputs.
    """
    h = spec.groups[group]
    values = dict(zip(DYNAMIC, hyper.unbind(0)))
    if h.maximize:
        grad = -grad
    if spec.kind == "sgd":
        return _sgd(h, values, param, grad, state, step)
    if in_place:
        return _adam_in_place(h, values, param, grad, state, step)
    return _adam(h, values, param, grad, state, step)


def _sgd(h: GroupHyper, v: dict, param, grad, state, step):
    import torch

    dtype = param.dtype
    if h.weight_decay != 0:
        grad = grad + v["weight_decay"].to(dtype) * param
    # Another group may keep a momentum buffer while this one has none: pass it through.
    new_state = tuple(state)
    if h.momentum != 0:
        (buf,) = state
        # torch starts the buffer as a copy of the first gradient (no dampening on step 1).
        updated = torch.where(step <= 1, grad, buf * v["momentum"].to(dtype) + grad * (1 - h.dampening))
        new_state = (updated,)
        grad = grad + v["momentum"].to(dtype) * updated if h.nesterov else updated
    return param - v["lr"].to(dtype) * grad, new_state


def _adam(h: GroupHyper, v: dict, param, grad, state, step):
    exp_avg, exp_avg_sq = state
    dtype, lr, beta1, beta2 = param.dtype, v["lr"], v["beta1"], v["beta2"]
    if h.weight_decay != 0:
        if h.decoupled:
            param = param * (1 - lr * v["weight_decay"]).to(dtype)
        else:
            grad = grad + v["weight_decay"].to(dtype) * param
    exp_avg = exp_avg.lerp(grad, (1 - beta1).to(dtype))
    exp_avg_sq = exp_avg_sq * beta2.to(dtype) + grad * grad * (1 - beta2).to(dtype)
    # torch computes these in Python floats (double precision): float64 tensors here.
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = (1 - beta2 ** step).sqrt()
    step_size = (lr / bias_correction1).to(dtype)
    denom = exp_avg_sq.sqrt() / bias_correction2_sqrt.to(dtype) + h.eps
    return param - step_size * (exp_avg / denom), (exp_avg, exp_avg_sq)


def _adam_in_place(h: GroupHyper, v: dict, param, grad, state, step):
    """`_adam`'s ops in its order, each written into a buffer that is no longer needed: the state itself, or
    a temporary. Eager holds the state and the gradient plus about one buffer of their size at any time."""
    exp_avg, exp_avg_sq = state
    dtype, lr, beta1, beta2 = param.dtype, v["lr"], v["beta1"], v["beta2"]
    if h.weight_decay != 0:
        if h.decoupled:
            param.mul_((1 - lr * v["weight_decay"]).to(dtype))
        else:
            grad = grad + v["weight_decay"].to(dtype) * param
    exp_avg.lerp_(grad, (1 - beta1).to(dtype))
    squared = grad * grad
    squared.mul_((1 - beta2).to(dtype))
    exp_avg_sq.mul_(beta2.to(dtype)).add_(squared)
    del squared
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = (1 - beta2 ** step).sqrt()
    step_size = (lr / bias_correction1).to(dtype)
    denom = exp_avg_sq.sqrt()
    denom.div_(bias_correction2_sqrt.to(dtype)).add_(h.eps)
    update = exp_avg / denom
    del denom
    param.sub_(update.mul_(step_size))
    return param, (exp_avg, exp_avg_sq)
