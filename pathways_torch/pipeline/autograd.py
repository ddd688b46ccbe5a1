"""A chunk's forward and backward as two graphs: what the forward keeps for the backward, and nothing more.

The chunk graph is traced once more as a *joint* graph — its forward under autograd,
then ``torch.autograd.grad`` of its outputs against the gradients that will arrive
for them — and the joint graph is partitioned (as AOT autograd does):

- forward nodes are those that read no incoming gradient; they go to the forward
  graph, which returns the chunk's outputs and the *saved* values the backward reads;
- a forward value that depends on the parameters alone (a transposed weight) is not
  saved but recomputed in the backward from the parameters, which the backward takes
  as inputs: a microbatch's saved bytes are activations only;
- everything else is the backward graph: (saved, parameters, output gradients) →
  gradients of the parameters and of the chunk's floating inputs.

Nothing of the forward is recomputed in the backward beyond those parameter-only
values (no activation recomputation).
"""

from __future__ import annotations

import dataclasses

from ..graph_cut import CAPTURE_LOCK, ancestors, views_as_reshapes

__all__ = ["ChunkAutograd", "partition_chunk"]


@dataclasses.dataclass(frozen=True)
class ChunkAutograd:
    """``forward(*inputs) -> (*outputs, *saved)``; ``backward(*saved, *params, *output_grads) -> grads``.

    ``grads`` are, in order, those of the inputs at ``differentiable`` (indices into the chunk's inputs).
    ``output_grads`` has one tensor per output at ``grad_outputs`` (floating, non-loss outputs);
    a chunk that returns the loss takes its gradient last (``loss_seed``: the value, ``loss_scale``).
    """

    forward: object
    backward: object
    num_outputs: int
    num_saved: int
    differentiable: tuple[int, ...]
    grad_outputs: tuple[int, ...]
    backward_params: tuple[int, ...]     # indices (into the chunk's inputs) of the parameters the backward reads
    saved_layouts: tuple                 # (shape, dtype) of each saved value
    loss_seed: tuple | None = None       # (value, dtype) of the loss's gradient, the backward's last input


def partition_chunk(chunk, example_inputs: list, trainable: set[int], loss_scale: float, *,
                    recompute: bool = False) -> ChunkAutograd:
    """Trace ``chunk.graph_module``'s joint forward/backward on fake ``example_inputs`` and partition it.

    ``trainable``: indices of the inputs that are trained parameters (differentiated, and
    available to the backward). ``recompute``: save only the chunk's inputs and recompute the whole
    forward in the backward (activation checkpointing).
    """
    import torch

    num_inputs = len(example_inputs)
    differentiable = tuple(i for i, t in enumerate(example_inputs)
                           if t.is_floating_point() and (i in trainable or i >= num_inputs - len(chunk.incoming)))
    outputs_meta = list(_output_metas(chunk.graph_module))
    num_outputs = len(outputs_meta)
    loss_index = num_outputs - 1 if chunk.has_loss else None
    grad_outputs = tuple(i for i, meta in enumerate(outputs_meta) if meta.dtype.is_floating_point and i != loss_index)
    joint = _joint(chunk.graph_module, differentiable, grad_outputs, loss_index)
    # The loss's gradient seed is an input of the backward too (the backward wrapper passes loss_scale):
    # were it a constant, everything would read no tangent and the whole backward would land in the forward.
    seeded = [*grad_outputs, *([loss_index] if loss_index is not None else [])]
    tangents = [torch.empty(outputs_meta[i].shape, dtype=outputs_meta[i].dtype) for i in seeded]
    graph_module = _trace_joint(joint, example_inputs, tangents)
    parts = _partition(graph_module, num_inputs, num_outputs, differentiable, grad_outputs, trainable, recompute)
    if loss_index is None:
        return parts
    return dataclasses.replace(parts, loss_seed=(loss_scale, outputs_meta[loss_index].dtype))


def _output_metas(graph_module):
    (output,) = [n for n in graph_module.graph.nodes if n.op == "output"]
    return [arg.meta["val"] for arg in output.args[0]]


def _joint(graph_module, differentiable, grad_outputs, loss_index):
    import torch

    def joint(primals, tangents):
        inputs = list(primals)
        for i in differentiable:
            inputs[i] = inputs[i].detach().requires_grad_(True)
        with torch.enable_grad():
            outputs = graph_module(*inputs)
        targets = [outputs[i] for i in grad_outputs] + ([outputs[loss_index]] if loss_index is not None else [])
        grads_in = list(tangents)
        pairs = [(t, g) for t, g in zip(targets, grads_in) if t.requires_grad]
        wrt = [inputs[i] for i in differentiable]
        grads = torch.autograd.grad([t for t, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True) \
            if pairs else [None] * len(wrt)
        grads = [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt)]
        return [o.detach() for o in outputs], grads

    return joint


def _trace_joint(joint, example_inputs, tangents):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    import torch

    with FakeTensorMode(static_shapes=True):
        primals = [torch.empty(t.shape, dtype=t.dtype) for t in example_inputs]
        fakes = [torch.empty(t.shape, dtype=t.dtype) for t in tangents]
    with CAPTURE_LOCK:   # make_fx patches process-wide state: one trace at a time
        return make_fx(joint, tracing_mode="fake")(primals, fakes)


def _partition(graph_module, num_inputs, num_outputs, differentiable, grad_outputs, trainable,
               recompute: bool) -> ChunkAutograd:
    import torch.fx as fx

    nodes = list(graph_module.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    primals, tangents = placeholders[:num_inputs], placeholders[num_inputs:]
    (output,) = [n for n in nodes if n.op == "output"]
    import torch.utils._pytree as pytree

    leaves = pytree.tree_leaves(output.args[0])
    forward_outputs, grads = leaves[:num_outputs], leaves[num_outputs:]
    # Forward: what reads no tangent. Parameter-only: what reads no data (only trained inputs).
    reads_tangent, reads_data = set(tangents), {p for i, p in enumerate(primals) if i not in trainable}
    for node in nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            if any(a in reads_tangent for a in node.all_input_nodes):
                reads_tangent.add(node)
            if any(a in reads_data for a in node.all_input_nodes):
                reads_data.add(node)
    forward_nodes = [n for n in nodes if n.op not in ("placeholder", "output") and n not in reads_tangent]
    backward_nodes = [n for n in nodes if n.op not in ("placeholder", "output") and n in reads_tangent]
    # What the backward recomputes rather than keeps: parameter-only values and views (an alias of a kept
    # value costs nothing to remake, and keeping both would store it twice); everything, with recompute.
    trainable_primals = {primals[i] for i in trainable}
    if recompute:
        recomputable = set(forward_nodes)
    else:
        recomputable = {n for n in forward_nodes if n not in reads_data or _is_view(n)}
    recomputable |= trainable_primals
    needed = {a for n in backward_nodes for a in n.all_input_nodes} | set(grads)
    recomputed = ancestors([n for n in needed if n in recomputable], within=recomputable)
    boundary = (needed - recomputed) | {a for n in recomputed for a in n.all_input_nodes if a not in recomputed}
    keepable = set(forward_nodes) | {p for p in primals if p not in trainable_primals}
    saved = [n for n in forward_nodes if n in boundary and n in keepable]
    saved += [p for p in primals if p in boundary and p in keepable]
    backward_params = tuple(i for i in sorted(trainable) if primals[i] in recomputed or primals[i] in boundary)

    forward = fx.Graph()
    env = {p: forward.placeholder(f"in_{i}") for i, p in enumerate(primals)}
    for node in forward_nodes:
        env[node] = forward.node_copy(node, lambda a: env[a])
    forward.output(tuple(env[n] for n in forward_outputs + saved))

    backward = fx.Graph()
    benv = {n: backward.placeholder(f"saved_{i}") for i, n in enumerate(saved)}
    for i in backward_params:
        benv[primals[i]] = backward.placeholder(f"param_{i}")
    for i, t in enumerate(tangents):
        benv[t] = backward.placeholder(f"grad_out_{i}")
    for node in nodes:
        if node.op != "placeholder" and (node in recomputed and node not in benv or node in backward_nodes):
            benv[node] = backward.node_copy(node, lambda a: benv[a])
    backward.output(tuple(benv[g] for g in grads))
    forward.eliminate_dead_code()
    backward.eliminate_dead_code()
    views_as_reshapes(forward)
    views_as_reshapes(backward)
    layouts = tuple((tuple(n.meta["val"].shape), n.meta["val"].dtype) for n in saved)
    return ChunkAutograd(fx.GraphModule(graph_module, forward), fx.GraphModule(graph_module, backward),
                         num_outputs, len(saved), differentiable, grad_outputs, backward_params, layouts)


def _is_view(node) -> bool:
    return node.op == "call_function" and getattr(node.target, "is_view", False)
