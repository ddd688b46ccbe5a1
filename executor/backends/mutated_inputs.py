"""Which inputs a graph writes in place (a training step that updates its state where it lies).

On backends whose values are mutable (torch's), a computation may only write an input it alone holds: one
handed over by the store (`ObjectStore.hand_over`) and read by no later step. Any other input it writes is
copied first, so the stored array, and whoever else reads it, keeps its value. XLA's values are immutable:
there an in-place op makes a new value, and nothing needs copying.
"""

from __future__ import annotations

__all__ = ["mutated_inputs"]


def mutated_inputs(graph_module) -> frozenset[int]:
    """Positions of the placeholders that an in-place op writes, directly or through a view of them."""
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    position = {node: index for index, node in enumerate(placeholders)}
    source = dict(position)   # node → the placeholder it is (a view of)
    written = set()
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is None:
            continue
        for argument, value in zip(schema.arguments, node.args):
            if argument.alias_info is not None and argument.alias_info.is_write and value in source:
                written.add(source[value])
        # The result of a view (or of an in-place op: itself) shares its first argument's memory.
        aliases = any(r.alias_info is not None for r in schema.returns)
        if aliases and node.args and node.args[0] in source:
            source[node] = source[node.args[0]]
    return frozenset(written)
