"""The boxed calling convention for an eager graph: ``forward(args_list)`` takes its inputs from a list and
clears it, so that an input the caller handed over (a donated or no longer stored array: `executor/store.py`)
is freed at its last use inside the graph instead of when the call returns.

torch's own ``_BoxedCodeGen`` arrived after torch 2.9; this is the same few lines, for every torch we run on.
"""

from __future__ import annotations

__all__ = ["boxed"]


def boxed(graph_module):
    """``graph_module`` recompiled to take one list of inputs (which it clears); returns it."""
    from torch.fx.graph import CodeGen

    class _Boxed(CodeGen):
        def gen_fn_def(self, free_vars, maybe_return_annotation, *args, **kwargs):
            names = [v.split(":")[0].split("=")[0].strip() for v in free_vars if v != "self"]
            lines = [f"def {self._func_name}(self, args_list){maybe_return_annotation}:"]
            if names:
                lines.append("    args_iter = iter(args_list)")
                lines.extend(f"    {name} = next(args_iter)" for name in names)
                lines.append("    args_list.clear()")
            return "\n".join(lines)

    graph_module.graph.set_codegen(_Boxed())
    graph_module.recompile()
    return graph_module
