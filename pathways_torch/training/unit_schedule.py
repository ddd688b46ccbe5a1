"""The per-unit schedule of a sharded step: a pass over its traced graph (FSDP's order, in one captured function).

The sharded step is traced as one graph: every bucket's all-gather first, then the forward, the backward, every
bucket's reduce-scatter and the update. Run in that order, an executor holds every gathered parameter for the
whole step and every full-size gradient until the end: the peak of a replicated step. This pass reorders the graph
(executors run a graph's nodes in order and drop each value after its last reader):

- **Forward.** Each bucket's all-gather, and the views of it, move to just before the first op that reads them:
  one unit's parameters are gathered when its forward starts, and dropped when its forward ends.
- **Backward** (``reshard_after_forward``, FSDP's default). Each backward op that reads a gathered parameter reads
  a second all-gather of the same shard, placed before the first such op: the forward's copy is not kept for the
  backward. With ``reshard_after_forward=False`` the forward's copy is kept (more memory, one collective fewer).
  Two gathers are always kept, as FSDP keeps them: the rest's (``keep``: the root's parameters, gathered once)
  and the unit the forward reaches last (its backward comes next).
- **Gradients.** Each bucket's gradient is flattened and reduce-scattered as soon as the backward has made all of
  it: its full-size gradient lives only until then.
- **Prefetch** (``prefetch=True``). The next unit's all-gather moves before the current unit's first op. An eager
  executor issues such a gather where it stands and waits for it just before its first reader
  (`pathways_torch.wire.collective_ops.call_runtime_directly`), so it overlaps the current unit's compute; one more
  unit's parameters are held. On the XLA routes the graph is cut at every collective and the gather runs where
  it stands: there prefetch only holds one unit more.

Where the forward ends is marked in the trace by `forward_end()` (a no-op the step calls after its loss); the pass
removes the marker. Every executor runs the same reordered graph, so collectives keep one order on all of them.
`describe` prints a graph's schedule as text: gathers, reduce-scatters and the ops between them.
"""

from __future__ import annotations

import dataclasses
import operator

import torch

__all__ = ["UnitSchedule", "forward_end", "describe", "gathered_high_water"]


@torch.library.custom_op("pathways::forward_end", mutates_args=())
def _forward_end() -> None:
    return None


@_forward_end.register_fake
def _() -> None:
    return None


def forward_end() -> None:
    """Mark, in a traced step, where the forward ends and the backward begins (no effect when run)."""
    torch.ops.pathways.forward_end()


# Ops by the names printed graphs and the wire give them (`_op_name`: "aten.view.default").
# Ops that only re-present a gathered buffer (views, casts, splits): recomputed with it rather than kept.
_DERIVED = frozenset({
    "aten.slice.Tensor", "aten.view.default", "aten._unsafe_view.default", "aten.t.default", "aten.transpose.int",
    "aten.permute.default", "aten.expand.default", "aten.alias.default", "aten.detach.default", "aten.select.int",
    "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.default", "aten.reshape.default",
    "aten.as_strided.default", "aten._to_copy.default", "aten.clone.default", "aten.split.Tensor",
    "aten.split_with_sizes.default", "aten.unbind.int", "aten.narrow.default", "operator.getitem",
})
# Ops that only lay a gradient out for its collective (flatten, pad, concatenate): moved with it.
_LAYOUT = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.t.default", "aten.transpose.int", "aten.permute.default",
    "aten.reshape.default", "aten.cat.default", "aten.new_zeros.default", "aten.constant_pad_nd.default",
    "aten._to_copy.default", "aten.clone.default", "aten.alias.default", "aten.detach.default",
})


def _op_name(target) -> str:
    """A node's target as `_DERIVED` and `_LAYOUT` name it."""
    return "operator.getitem" if target is operator.getitem else str(target)


@dataclasses.dataclass(frozen=True)
class UnitSchedule:
    """The pass, as configured by the plan: ``graph_module`` in, the same module reordered out."""

    reshard_after_forward: bool = True
    prefetch: bool = False
    # The inputs (positions) whose gathers are kept for the backward whatever reshard_after_forward says: the
    # rest's buckets (FSDP's root), gathered once.
    keep: frozenset = frozenset()

    def __call__(self, graph_module):
        graph = graph_module.graph
        gather_op, scatter_op = torch.ops.pathways.all_gather.default, torch.ops.pathways.reduce_scatter.default
        marker = next((n for n in graph.nodes if n.target is torch.ops.pathways.forward_end.default), None)
        inputs = [n for n in graph.nodes if n.op == "placeholder"]
        gathers = [n for n in graph.nodes if n.target is gather_op and n.args[0].op == "placeholder"]
        backward_gathers = []
        if marker is not None and self.reshard_after_forward:
            # The last unit the forward gathers is read by the backward at once: dropping it would only gather
            # it again (FSDP does not reshard it either).
            last = max(gathers, key=lambda g: _first_use(g, _positions(graph)), default=None)
            again = [g for g in gathers if g is not last and inputs.index(g.args[0]) not in self.keep]
            backward_gathers = [g for g in (_regather_for_backward(graph, g, marker) for g in again) if g]
        for gather in gathers:
            _sink(graph, _derived_from(gather))
        if self.prefetch:
            _prefetch(graph, gathers)
            _prefetch(graph, backward_gathers)
        _reduce_early(graph, [n for n in graph.nodes if n.target is scatter_op])
        if marker is not None:
            graph.erase_node(marker)
        graph.lint()
        graph_module.recompile()
        return graph_module


def _positions(graph) -> dict:
    return {node: i for i, node in enumerate(graph.nodes)}


def _derived_from(gather) -> list:
    """``gather`` and the nodes computed from it alone by `_DERIVED` ops, in graph order."""
    chain, frontier = {gather}, [gather]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in chain or _op_name(user.target) not in _DERIVED:
                continue
            if all(i in chain for i in user.all_input_nodes):
                chain.add(user)
                frontier.append(user)
    order = _positions(gather.graph)
    return sorted(chain, key=order.__getitem__)


def _regather_for_backward(graph, gather, marker):
    """Rewire the backward's readers of ``gather``'s values to a second gather placed before the first of them;
    returns that gather (None when the backward reads none)."""
    order = _positions(graph)
    chain = _derived_from(gather)
    members = set(chain)
    readers = {(node, user) for node in chain for user in node.users
               if user not in members and order[user] > order[marker]}
    if not readers:
        return None
    needed = _ancestors_within({node for node, _ in readers}, members)
    first = min((user for _, user in readers), key=order.__getitem__)
    copies = {}
    with graph.inserting_before(first):
        for node in chain:
            if node in needed:
                copies[node] = graph.node_copy(node, lambda n: copies.get(n, n))
    for node, user in readers:
        user.replace_input_with(node, copies[node])
    for node in reversed(chain):      # the forward's chain nodes the backward read (t of t …) are dead now
        if not node.users and node is not gather:
            graph.erase_node(node)
    return copies[gather]


def _first_use(gather, order: dict) -> int:
    """Where the forward first reads ``gather``'s values (a view included)."""
    return min((order[u] for node in _derived_from(gather) for u in node.users), default=order[gather])


def _ancestors_within(nodes: set, members: set) -> set:
    seen, frontier = set(), list(nodes)
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        frontier.extend(i for i in node.all_input_nodes if i in members)
    return seen


def _sink(graph, chain: list) -> None:
    """Move each node of ``chain`` (graph order) to just before its first reader: last first, so that a node's
    readers are in place when it moves."""
    for node in reversed(chain):
        if not node.users:
            continue
        order = _positions(graph)
        first = min(node.users, key=order.__getitem__)
        if order[first] > order[node] + 1:
            first.prepend(node)


def _prefetch(graph, gathers: list) -> None:
    """Issue each gather before the first reader of the gather before it (in run order)."""
    order = _positions(graph)
    ordered = sorted(gathers, key=order.__getitem__)
    starts = [_first_reader(g, order) for g in ordered]
    for start, following in zip(starts, ordered[1:]):
        if start is not None:
            start.prepend(following)


def _first_reader(gather, order: dict):
    """The first op that reads ``gather``'s values other than through views."""
    readers = [u for node in _derived_from(gather) for u in node.users if _op_name(u.target) not in _DERIVED]
    return min(readers, key=order.__getitem__) if readers else None


def _reduce_early(graph, scatters: list) -> None:
    """Move each reduce-scatter, and the flatten/pad/concatenate ops that feed it alone, to just after the last
    value they read: a bucket's gradient is reduced as soon as the backward has made it."""
    moving = set(scatters)
    changed = True
    while changed:
        changed = False
        for node in graph.nodes:
            if node in moving or _op_name(node.target) not in _LAYOUT or not node.users:
                continue
            if all(user in moving for user in node.users):
                moving.add(node)
                changed = True
    order = _positions(graph)
    for node in sorted(moving, key=order.__getitem__):
        order = _positions(graph)
        inputs = [i for i in node.all_input_nodes if i.op != "placeholder"]
        if inputs:
            latest = max(inputs, key=order.__getitem__)
            if order[latest] + 1 < order[node]:
                latest.append(node)


def gathered_high_water(graph_module) -> tuple[int, int]:
    """(most gathered buffers alive at once, their bytes) when ``graph_module`` runs in order: a gathered buffer
    lives from its all-gather to the last reader of it or of a view of it."""
    order = _positions(graph_module.graph)
    gather_op = torch.ops.pathways.all_gather.default
    events = []
    for gather in (n for n in graph_module.graph.nodes if n.target is gather_op):
        readers = [u for node in _derived_from(gather) for u in node.users]
        end = max((order[u] for u in readers), default=order[gather])
        value = gather.meta.get("val")
        nbytes = value.numel() * value.element_size() if value is not None else 0
        events += [(order[gather], 1, nbytes), (end + 0.5, -1, -nbytes)]
    count = most = nbytes = most_bytes = 0
    for _, step, size in sorted(events):
        count, nbytes = count + step, nbytes + size
        most, most_bytes = max(most, count), max(most_bytes, nbytes)
    return most, most_bytes


def describe(graph_module) -> str:
    """The schedule of a graph as text: one line per all-gather and reduce-scatter, the other ops counted
    between them (``12 ops``), then how many gathered buffers are alive at most."""
    lines, ops = [], 0
    names = {torch.ops.pathways.all_gather.default: "all_gather", torch.ops.pathways.reduce_scatter.default:
             "reduce_scatter", torch.ops.pathways.all_reduce.default: "all_reduce"}
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        name = names.get(node.target)
        if name is None:
            if _op_name(node.target) not in _DERIVED:
                ops += 1
            continue
        if ops:
            lines.append(f"  {ops} ops")
            ops = 0
        source = node.args[0]
        lines.append(f"{name}({source.name}) -> {tuple(node.meta['val'].shape) if 'val' in node.meta else '?'}")
    if ops:
        lines.append(f"  {ops} ops")
    most, nbytes = gathered_high_water(graph_module)
    lines.append(f"at most {most} gathered buffer{'s' * (most != 1)} alive at once ({nbytes} bytes)")
    return "\n".join(lines)
