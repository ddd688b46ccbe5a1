"""A user's ``torch.autograd.Function`` in a pipelined forward: kept whole through the split, so its backward runs.

A pipeline traces the forward to aten ops first and differentiates each chunk's graph later (`autograd`). A
Function traced through would leave only its forward's ops, differentiated by their own rules: a straight-through
estimator (forward: round, backward: identity) would get round's zero gradient, and train wrong without an error.
So while the forward is traced for the split, each application of a user's Function (a model's or its library's;
torch's and pathways_torch's are traced through as before) becomes one node, ``pathways_graph::user_function``,
whose shapes come from running the Function's forward on the fake inputs. Once traced, every such node is given
back its Function (`UserFunctions.replay_in`): the chunk's joint trace applies it under autograd, its forward's
ops land in the chunk's forward and its ``backward``'s in the chunk's backward, as eager runs them. Old-style
Functions (``forward(ctx, ...)``) and new-style ones (``setup_context``) alike.

Its forward runs outside the trace's dropout keys, so a Function whose forward draws random numbers is refused.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import CaptureError

__all__ = ["UserFunctions"]

_RECORDING: list = []     # the UserFunctions whose node is being traced (under CAPTURE_LOCK: one trace at a time)


@dataclasses.dataclass
class _Application:
    """One call of ``cls.apply`` in the traced forward: its arguments with the tensors taken out, and its result's."""

    cls: type
    apply: object              # the unwrapped ``cls.apply``, while the trace wraps ``Function.apply``
    spec: object               # pytree spec of (args, kwargs)
    leaves: list               # its leaves; None where a tensor goes
    out_spec: object = None    # known once the forward ran on fake tensors
    out_leaves: list = None

    def arguments(self, tensors) -> tuple:
        it = iter(tensors)
        leaves = [next(it) if leaf is None else leaf for leaf in self.leaves]
        return pytree.tree_unflatten(leaves, self.spec)

    def outputs(self, tensors):
        it = iter(tensors)
        leaves = [next(it) if leaf is None else leaf for leaf in self.out_leaves]
        return pytree.tree_unflatten(leaves, self.out_spec)

    def run_fake(self, tensors) -> list:
        """The forward on fake inputs, for the node's shapes (copies: an op's output may not alias its input)."""
        args, kwargs = self.arguments(tensors)
        with _NoRandom(self.cls):
            out = self.apply(*args, **kwargs)
        leaves, self.out_spec = pytree.tree_flatten(out)
        self.out_leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        return [leaf.clone() for leaf in leaves if isinstance(leaf, torch.Tensor)]

    def replay(self):
        """The node's target once traced: the Function applied, so that autograd runs its backward."""
        cls, application = self.cls, self

        def applied(tensors):
            args, kwargs = application.arguments(tensors)
            leaves = pytree.tree_leaves(cls.apply(*args, **kwargs))
            return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]

        applied.__name__ = applied.__qualname__ = f"apply_{cls.__name__}"
        return applied


class UserFunctions:
    """Records the user's Function applications of one trace (the hook `stop_gradient.kept_detach` calls) and gives
    the traced graph its Functions back (`replay_in`)."""

    def __init__(self):
        self._applications: list[_Application] = []

    def __call__(self, cls, apply, args, kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        if not tensors:
            return apply(*args, **kwargs)
        application = _Application(cls, apply, spec, [None if isinstance(x, torch.Tensor) else x for x in leaves])
        self._applications.append(application)
        _RECORDING.append(self)
        try:
            outs = torch.ops.pathways_graph.user_function(tensors, len(self._applications) - 1)
        finally:
            _RECORDING.pop()
        return application.outputs(outs)

    def fake(self, key: int, tensors) -> list:
        return self._applications[key].run_fake(tensors)

    def replay_in(self, graph_module) -> None:
        """Each recorded node of ``graph_module`` (traced while this recorded) applies its Function again."""
        op = torch.ops.pathways_graph.user_function.default
        for node in graph_module.graph.nodes:
            if node.op == "call_function" and node.target is op:
                tensors, key = node.args
                node.target, node.args = self._applications[key].replay(), (tensors,)
        graph_module.recompile()


class _NoRandom(TorchDispatchMode):
    """Refuses a random op: the Function's forward is applied again later, outside the trace's dropout keys."""

    def __init__(self, cls):
        super().__init__()
        self._cls = cls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            raise CaptureError(
                f"pw.Pipeline: the forward of autograd Function {self._cls.__qualname__} draws random numbers "
                f"({func}); a pipeline applies a Function's forward again when it differentiates the chunk, "
                f"outside the step's dropout keys, so the two draws would differ. Fix: draw the random tensor "
                f"outside the Function and pass it in as an argument")
        return func(*args, **(kwargs or {}))


@torch.library.custom_op("pathways_graph::user_function", mutates_args=())
def _user_function(tensors: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    raise AssertionError("pathways_graph::user_function exists only while a pipeline's forward is traced")


@_user_function.register_fake
def _(tensors, key):
    return _RECORDING[-1].fake(key, tensors)
