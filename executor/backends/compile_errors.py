"""A backend's compile failure, located at the op that caused it.

When XLA (through torchax) cannot compile a stage, the error from deep inside the
lowering names neither the op nor the user's code. The stage is traced again, node by
node, to find the op it fails at; the error then carries the op's aten name and its
position among the function's call_function nodes (``pathways_index``, stamped when the
graph arrived), which the client maps back to the user's line (`pathways_torch.capture`).
"""

from __future__ import annotations

import os

__all__ = ["BackendCompileError", "failing_node", "refused_lowerings"]

# Tests only: aten ops (comma-separated, e.g. "aten.cos.default") whose lowering fails, to drive this path.
REFUSE_ENV = "PATHWAYS_REFUSE_LOWERING"


class BackendCompileError(RuntimeError):
    """A backend could not compile ``op``, the ``node_index``-th call of the function (0: unknown)."""

    def __init__(self, message: str, *, op: str = "", node_index: int = 0):
        super().__init__(message)
        self.op, self.node_index = op, node_index


def failing_node(graph_module, trace):
    """The first node ``trace(callable)`` fails at when the graph runs node by node, or None.

    ``trace`` takes a function of the graph's inputs and traces it as the backend does."""
    import torch

    current = {}

    class Locating(torch.fx.Interpreter):
        def run_node(self, node):
            current["node"] = node
            return super().run_node(node)

    try:
        trace(lambda *args: Locating(graph_module).run(*args))
    except Exception:
        return current.get("node")
    return None


def refused_lowerings() -> list[str]:
    return [name.strip() for name in os.environ.get(REFUSE_ENV, "").split(",") if name.strip()]
