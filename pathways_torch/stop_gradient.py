"""``x.detach()`` that survives a graph being differentiated after it was traced.

``make_fx`` records ``detach`` as ``aten.alias``: in a graph that is traced first and differentiated
later (a pipeline's chunks, `pipeline.autograd`), the alias passes the gradient through and the
forward's stop-gradient is lost; the model then trains on a gradient eager PyTorch never computes.
``pathways_graph::stop_gradient`` is an op of its own whose registered gradient is none, so the
re-traced backward stops where the forward said. `kept_detach` turns every ``detach`` of the forward
into it while such a graph is traced, and every floating value the forward computes where gradients
are off (``torch.no_grad()``, ``torch.inference_mode()``, ``torch.set_grad_enabled(False)``). The
executors never see the op: `capture` runs its forward (an alias) in its place (`capture.DECOMPOSITIONS`).
`differentiable` gives any such op its gradient in both kinds of graph (the tensor-parallel moves use it too).
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

    # The op's qualified name, from its repr ("<CustomOpDef(pathways_graph::stop_gradient)>"): what errors show.
    Differentiable.__name__ = f"Differentiable[{str(op).partition('(')[2].removesuffix(')>') or op}]"
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
    floating tensor computed where the model's code turned gradients off (``torch.no_grad()``,
    ``torch.inference_mode()``, ``torch.set_grad_enabled(False)``: its own, torch's or a model library's, as eager
    runs them), and every output of an autograd Function applied there. Gradients off inside an autograd Function's
    forward do not count: autograd turns them off there (and pathways_torch's Functions compute under ``no_grad``).
    ``user_functions(cls, apply, args, kwargs)``, where given, applies each user's autograd Function in place of
    ``apply`` (`pipeline.user_functions`). Entering turns gradients on, so that only the model's regions count."""

    _DETACH = {torch.Tensor.detach, torch.detach}

    def __init__(self, user_functions=None):
        super().__init__()
        self._user_functions = user_functions

    def __enter__(self):
        self._grad = torch.enable_grad()
        self._grad.__enter__()
        self._functions = _FunctionApplications(self._user_functions)
        self._functions.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._functions.__exit__(*exc)
            self._grad.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._DETACH and args and isinstance(args[0], torch.Tensor):
            return stop_gradient(args[0])
        out = func(*args, **(kwargs or {}))
        if self._functions.depth or torch.is_grad_enabled():
            return out
        return _all_stopped(out)


def _all_stopped(out):
    if isinstance(out, (tuple, list)) and any(_floating(o) for o in out):
        return type(out)([_stopped(o) for o in out])     # tuple, list, torch.return_types
    return _stopped(out)


def _floating(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _stopped(value):
    return stop_gradient(value) if _floating(value) else value


def _is_users(cls) -> bool:
    """Whether an autograd Function is the user's (a model's or its library's), not torch's nor pathways_torch's."""
    module = getattr(cls, "__module__", "") or ""
    return not (module == "torch" or module.startswith(("torch.", "pathways_torch.")))


class _FunctionApplications:
    """Within: ``depth`` counts the autograd Function forwards this thread is inside (``Function.apply`` is wrapped
    meanwhile; the caller holds `graph_cut.CAPTURE_LOCK`, so one trace at a time wraps it). An application where
    the model turned gradients off has its outputs stopped, as eager gives them no gradient; a user's Function goes
    to ``user_functions`` where given."""

    def __init__(self, user_functions):
        self._user_functions = user_functions

    def __enter__(self):
        import inspect
        import threading

        function = torch.autograd.Function
        thread, self.depth = threading.get_ident(), 0
        self._own = "apply" in vars(function)    # else inherited: removing the wrapper gives it back
        self._apply = original = inspect.getattr_static(function, "apply")
        regions, user_functions = self, self._user_functions

        def applied(cls, *args, **kwargs):
            apply = original.__get__(None, cls)
            if threading.get_ident() != thread:
                return apply(*args, **kwargs)
            in_region = regions.depth == 0 and not torch.is_grad_enabled()
            regions.depth += 1
            try:
                if user_functions is not None and _is_users(cls):
                    out = user_functions(cls, apply, args, kwargs)
                else:
                    out = apply(*args, **kwargs)
                return _all_stopped(out) if in_region else out   # its own stop_gradient: no region again
            finally:
                regions.depth -= 1
        function.apply = classmethod(applied)
        return self

    def __exit__(self, *exc):
        if self._own:
            torch.autograd.Function.apply = self._apply
        else:
            del torch.autograd.Function.apply
        return False
