"""Carving fx subgraphs out of one traced graph: the one carver, and what every such trace shares.

The pipeline cuts a traced forward + loss into chunks (`pipeline.split`), a chunk into its
forward and backward (`pipeline.autograd`), and a training step into one segment per gradient
bucket (`training.bucket_cut`). Each of them

- traces under `CAPTURE_LOCK`, since ``make_fx`` patches process-wide state;
- hands its pieces values that arrive with other strides than the trace saw, so that every
  carved graph has its views turned into reshapes (`views_as_reshapes`);
- the chunks and the segments are built by `carve`: some of a graph's nodes, in order, over
  named placeholders, returning chosen values.

Nothing here imports torch until it is called.
"""

from __future__ import annotations

import threading

__all__ = ["CAPTURE_LOCK", "ancestors", "carve", "views_as_reshapes"]

# make_fx patches process-wide state while it traces (dispatch modes, Module.__call__): two client threads
# capturing at once would see each other's. Captures are rare (once per signature), so they take turns.
CAPTURE_LOCK = threading.RLock()
"""Held by every ``make_fx`` trace in the process (`capture`, the pipeline splitter and autograd, the bucket cut)."""


def carve(graph_module, members: list, inputs: list, results: list):
    """A ``GraphModule`` of ``members`` (nodes of ``graph_module``, copied in the order given).

    ``inputs``: ``(node, name)`` pairs, in order: the new graph's placeholders, each standing for
    ``node`` (a placeholder of ``graph_module`` or a value another piece computes) and keeping its
    ``meta``. ``results``: what the graph returns, as a tuple: nodes among ``members`` and ``inputs``,
    or constants. The ``get_attr`` targets the members read are copied onto the new root module.
    """
    import torch
    import torch.fx as fx

    graph, env = fx.Graph(), {}
    for node, name in inputs:
        env[node] = graph.placeholder(name)
        env[node].meta.update(node.meta)
    root = torch.nn.Module()
    for node in members:
        if node.op == "get_attr":
            setattr(root, node.target, getattr(graph_module, node.target))
        env[node] = graph.node_copy(node, lambda arg: env[arg])
    graph.output(tuple(env[r] if hasattr(r, "op") else r for r in results))
    views_as_reshapes(graph)   # an input may arrive with other strides than the trace saw
    return fx.GraphModule(root, graph)


def ancestors(roots: list, within: set | None = None) -> set:
    """``roots`` and every node they are computed from; with ``within``, only through nodes in it."""
    seen, stack = set(), list(roots)
    while stack:
        node = stack.pop()
        if node in seen or (within is not None and node not in within):
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def views_as_reshapes(graph) -> None:
    """``aten.view`` → ``aten.reshape`` in ``graph``: the same values whatever the input's strides.

    A graph traced here meets its inputs later with other strides than the trace saw: a kept
    value that was a strided op's output arrives contiguous (captured on contiguous examples,
    stored, sent), and a view remade in the backward reads it. ``view`` refuses strides it
    cannot express; ``reshape`` is ``view`` where it can be and a copy where it cannot.
    """
    import torch

    aten = torch.ops.aten
    for node in graph.nodes:
        if node.op == "call_function" and str(node.target) in ("aten.view.default", "aten._unsafe_view.default"):
            node.target = aten.reshape.default
