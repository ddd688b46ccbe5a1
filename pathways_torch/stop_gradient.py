"""``x.detach()`` that survives a graph being differentiated after it was traced.

``make_fx`` records ``detach`` as ``aten.alias``: in a graph that is traced first and differentiated
later (a pipeline's chunks, `pipeline.autograd`), the alias passes the gradient through and the
forward's stop-gradient is lost; the model then trains on a gradient eager PyTorch never computes.
``pathways_graph::stop_gradient`` is an op of its own whose registered gradient is none, so the
re-traced backward stops where the forward said. `kept_detach` turns every ``detach`` of the forward
into it while such a graph is traced, and every floating value the forward computes under
``torch.no_grad()``. The executors never see the op: `capture` runs its forward (an
alias) in its place (`capture.DECOMPOSITIONS`).
"""

from __future__ import annotations

import torch

from .capture import DECOMPOSITIONS

__all__ = ["stop_gradient", "kept_detach"]


@torch.library.custom_op("pathways_graph::stop_gradient", mutates_args=())
def _stop_op(x: torch.Tensor) -> torch.Tensor:
    return x.clone()      # an op's output may not alias its input when run eagerly


_stop_op.register_fake(lambda x: torch.empty_like(x))
_stop_op.register_autograd(lambda ctx, grad: None)
DECOMPOSITIONS[torch.ops.pathways_graph.stop_gradient.default] = lambda x: x.view_as(x)


class _StopGradient(torch.autograd.Function):
    """The op for a step differentiated by ``torch.func`` (which runs no op's registered gradient)."""

    @staticmethod
    def forward(x):
        with torch.no_grad():
            return _stop_op(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return None


def stop_gradient(x):
    """``x`` with no gradient flowing back through it, in any graph that holds it."""
    return _StopGradient.apply(x)


class kept_detach(torch.overrides.TorchFunctionMode):
    """Within (for a forward traced now and differentiated later): ``detach`` is `stop_gradient`, and so is every
    floating tensor computed where the forward turned gradients off (``with torch.no_grad():``). Entering turns
    gradients on, so that only the forward's own ``no_grad`` regions count."""

    _DETACH = {torch.Tensor.detach, torch.detach}

    def __enter__(self):
        self._grad = torch.enable_grad()
        self._grad.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._grad.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._DETACH and args and isinstance(args[0], torch.Tensor):
            return stop_gradient(args[0])
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            return out
        if isinstance(out, (tuple, list)) and any(_stopped(o) is not o for o in out):
            return type(out)([_stopped(o) for o in out])     # tuple, list, torch.return_types
        return _stopped(out)


def _stopped(value):
    return stop_gradient(value) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
