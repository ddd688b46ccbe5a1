"""``x.detach()`` that survives a graph being differentiated after it was traced.

``make_fx`` records ``detach`` as ``aten.alias``: in a graph that is traced first and differentiated
later (a pipeline's chunks, `pipeline.autograd`), the alias passes the gradient through and the
forward's stop-gradient is lost; the model then trains on a gradient eager PyTorch never computes.
``pathways_graph::stop_gradient`` is an op of its own whose registered gradient is none, so the
re-traced backward stops where the forward said. `kept_detach` turns every ``detach`` of the forward
into it while such a graph is traced, and every floating value the forward computes under
``torch.no_grad()``. The executors never see the op: `capture` runs its forward (an
alias) in its place (`capture.DECOMPOSITIONS`). `differentiable` gives any such op its gradient in
both kinds of graph (the tensor-parallel moves use it too).
"""

from __future__ import annotations

import torch

from .capture import DECOMPOSITIONS

__all__ = ["stop_gradient", "kept_detach", "differentiable"]


def _keep_args(ctx, inputs, output):
    ctx.args = inputs[1:]      # what a backward reads besides the gradient: the op's arguments after the tensor


def differentiable(op, backward):
    """Give ``op`` the gradient ``backward(ctx, grad)`` (``ctx.args``: the op's arguments after the first) in both
    places a gradient is taken: registered on the op, for a graph traced first and differentiated later (a
    pipeline's chunks); and the autograd Function returned, for a step differentiated by ``torch.func``, which
    runs no op's registered gradient (op and gradient run under ``no_grad`` there: only the Function counts)."""
    op.register_autograd(backward, setup_context=_keep_args)

    class Differentiable(torch.autograd.Function):
        @staticmethod
        def forward(*args):
            with torch.no_grad():
                return op(*args)

        setup_context = staticmethod(_keep_args)

        @staticmethod
        def backward(ctx, grad):
            with torch.no_grad():
                return backward(ctx, grad)

    Differentiable.__name__ = f"Differentiable[{op._name}]"
    return Differentiable


@torch.library.custom_op("pathways_graph::stop_gradient", mutates_args=())
def _stop_op(x: torch.Tensor) -> torch.Tensor:
    return x.clone()      # an op's output may not alias its input when run eagerly


_stop_op.register_fake(lambda x: torch.empty_like(x))
_StopGradient = differentiable(_stop_op, lambda ctx, grad: None)
DECOMPOSITIONS[torch.ops.pathways_graph.stop_gradient.default] = lambda x: x.view_as(x)


def stop_gradient(x):
    """``x`` with no gradient flowing back through it, in any graph that holds it."""
    return _StopGradient.apply(x)


class kept_detach(torch.overrides.TorchFunctionMode):
    """Within (for a forward traced now and differentiated later): ``detach`` is `stop_gradient`, and so is every
    floating tensor computed inside a ``torch.no_grad()`` the model's code entered (its own, torch's or a model
    library's, as eager runs them; not pathways_torch's, whose autograd Functions compute their forwards under
    ``no_grad`` by design). Entering turns gradients on, so that only those regions count."""

    _DETACH = {torch.Tensor.detach, torch.detach}

    def __enter__(self):
        self._grad = torch.enable_grad()
        self._grad.__enter__()
        self._regions = _ModelNoGrad()
        self._regions.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._regions.__exit__(*exc)
            self._grad.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._DETACH and args and isinstance(args[0], torch.Tensor):
            return stop_gradient(args[0])
        out = func(*args, **(kwargs or {}))
        if not self._regions.depth or torch.is_grad_enabled():
            return out
        if isinstance(out, (tuple, list)) and any(_floating(o) for o in out):
            return type(out)([_stopped(o) for o in out])     # tuple, list, torch.return_types
        return _stopped(out)


def _floating(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _stopped(value):
    return stop_gradient(value) if _floating(value) else value


class _ModelNoGrad:
    """Within: ``depth`` counts the ``torch.no_grad()`` regions this thread's model code is inside (entered from a
    file outside pathways_torch). ``no_grad``'s enter and exit are wrapped meanwhile; the caller holds
    `graph_cut.CAPTURE_LOCK`, so one trace at a time wraps them."""

    def __enter__(self):
        import os
        import sys
        import threading

        from torch.autograd.grad_mode import no_grad

        ours = os.path.dirname(os.path.abspath(__file__))
        thread, self.depth = threading.get_ident(), 0
        self._enter, self._exit = no_grad.__enter__, no_grad.__exit__
        regions, enter, leave = self, self._enter, self._exit

        def counted_enter(grad_mode):
            caller = os.path.abspath(sys._getframe(1).f_code.co_filename)
            grad_mode._pathways_counted = threading.get_ident() == thread and not caller.startswith(ours)
            regions.depth += grad_mode._pathways_counted
            return enter(grad_mode)

        def counted_exit(grad_mode, *exc):
            regions.depth -= getattr(grad_mode, "_pathways_counted", False)
            return leave(grad_mode, *exc)
        no_grad.__enter__, no_grad.__exit__ = counted_enter, counted_exit
        return self

    def __exit__(self, *exc):
        from torch.autograd.grad_mode import no_grad

        no_grad.__enter__, no_grad.__exit__ = self._enter, self._exit
        return False
