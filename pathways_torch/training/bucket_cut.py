"""A training step's forward and backward cut into one piece per gradient bucket, in the order backward makes them.

Across islands a bucket's gradient should leave as soon as the backward has produced it, so
that its exchange overlaps the backward of the rest. One captured function returns its
outputs only when it has ended, so the step is cut: its forward, loss and backward are traced
once (``make_fx`` on fake tensors of one shard's inputs, functionalized, so that no in-place
op is left whose order a cut could break) into one *joint* graph

    (*flats, *buffers, *frozen, scalars, rank, *batch) -> (loss, *gradient flats, *new buffers)

and its ops are dealt into segments, one per bucket: segment k holds every op that bucket k's
gradient needs and no earlier segment holds — segment 0 the forward, the loss and the backward
of the last layers; each later one the backward of earlier layers. The buckets are taken in
the order their gradients complete in the graph. The new buffer values go to the last
segment. A value one segment computes and a later one reads is an extra output of the first
and an input of the other: it stays on the executor, as the saved activations of one graph
would. Each segment is run as its own function, so the program can send bucket k's slice to
the other islands while segment k + 1 runs (`cross_island.py`).

`cut_per_bucket` returns a `BucketCut`; ``print(cut)`` lists the segments.
"""

from __future__ import annotations

import dataclasses
import operator

from ..errors import CaptureError
from ..graph_cut import CAPTURE_LOCK, ancestors, carve

__all__ = ["Segment", "BucketCut", "cut_per_bucket"]


@dataclasses.dataclass(frozen=True)
class Segment:
    """``graph_module(*joint inputs at inputs, *carried_in) -> (*carried_out, *joint outputs at outputs)``."""

    graph_module: object
    inputs: tuple[int, ...]        # indices of the joint's inputs it reads
    carried_in: tuple[int, ...]    # numbers of the values it reads from earlier segments
    carried_out: tuple[int, ...]   # numbers of the values it computes that later segments read
    outputs: tuple[int, ...]       # indices of the joint's outputs it returns
    num_ops: int

    def describe(self) -> str:
        return (f"{self.num_ops} ops; reads inputs {list(self.inputs)} and {len(self.carried_in)} carried values; "
                f"returns outputs {list(self.outputs)} and {len(self.carried_out)} carried values")


@dataclasses.dataclass(frozen=True)
class BucketCut:
    """The segments in run order; ``bucket_order[k]``: the bucket whose gradient segment k completes."""

    segments: tuple[Segment, ...]
    bucket_order: tuple[int, ...]

    def __str__(self) -> str:
        return "\n".join(f"segment {k} (bucket {b}): {s.describe()}"
                         for k, (s, b) in enumerate(zip(self.segments, self.bucket_order)))


def cut_per_bucket(joint, example_inputs: list, num_buckets: int, mesh_axes: dict,
                   functionalize_after: bool = False) -> BucketCut:
    """Trace ``joint`` (returning ``(loss, *num_buckets gradients, *buffers)``) and cut it per bucket.

    ``functionalize_after``: trace first, then functionalize the traced graph, for a joint whose autograd
    Functions functionalize cannot trace through (the tensor-parallel moves: ``NYI: Functionalize rule for
    custom_function_call``); the first trace runs their forwards (`capture.DECOMPOSITIONS`).
    """
    graph_module = _trace(joint, example_inputs, mesh_axes, functionalize_after)
    graph = graph_module.graph
    graph.eliminate_dead_code()
    numbering = {node: i for i, node in enumerate(graph.nodes)}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    (output,) = [n for n in graph.nodes if n.op == "output"]
    results = list(output.args[0])
    if len(results) < 1 + num_buckets:
        raise CaptureError(f"cut_per_bucket: expected (loss, {num_buckets} gradients, *buffers), got "
                           f"{len(results)} outputs")
    grads = results[1:1 + num_buckets]
    # The buckets in the order their gradients complete (the last op each one needs).
    ancestry = [ancestors([g]) for g in grads]
    order = sorted(range(num_buckets), key=lambda b: (max((numbering[n] for n in ancestry[b]), default=-1), b))
    wanted = [[0, 1 + order[0]]] + [[1 + b] for b in order[1:]]
    wanted[-1] += list(range(1 + num_buckets, len(results)))
    segment_of = {}
    for k, outs in enumerate(wanted):
        for index in outs:
            for node in ancestors([results[index]]) if hasattr(results[index], "op") else ():
                if node.op not in ("placeholder", "output"):
                    segment_of.setdefault(node, k)
    # A multi-output op (native_batch_norm) returns a tuple that only its getitems read: they go with it, so
    # that what crosses segments is always a tensor.
    for node in segment_of:
        if node.target is operator.getitem and node.args[0] in segment_of:
            segment_of[node] = min(segment_of[node], segment_of[node.args[0]])
    last_reader = {}
    for node, k in segment_of.items():
        for arg in node.all_input_nodes:
            if arg in segment_of and segment_of[arg] < k:
                last_reader[arg] = max(last_reader.get(arg, k), k)
    segments = []
    for k, outs in enumerate(wanted):
        members = [n for n in graph.nodes if segment_of.get(n) == k]
        carried_in = sorted({a for n in members for a in n.all_input_nodes
                             if a in segment_of and segment_of[a] < k}, key=numbering.get)
        # An output computed by an earlier segment (e.g. a gradient finished early) is carried to this one.
        carried_in += sorted({results[i] for i in outs if results[i] in segment_of and segment_of[results[i]] < k}
                             - set(carried_in), key=numbering.get)
        carried_out = [n for n in members if n in last_reader or _read_later_as_output(n, k, wanted, results)]
        segments.append(_segment_graph(graph_module, members, placeholders, carried_in, carried_out,
                                       [results[i] for i in outs], outs, numbering))
    return BucketCut(tuple(segments), tuple(order))


def _read_later_as_output(node, k: int, wanted: list, results: list) -> bool:
    return any(results[i] is node for outs in wanted[k + 1:] for i in outs)


def _segment_graph(graph_module, members, placeholders, carried_in, carried_out, returned, outs, numbering):
    used = {a for n in members for a in n.all_input_nodes if a.op == "placeholder"}
    used |= {r for r in returned if getattr(r, "op", None) == "placeholder"}
    inputs = [p for p in placeholders if p in used]
    named = [(p, f"input_{placeholders.index(p)}") for p in inputs]
    named += [(n, f"carried_{numbering[n]}") for n in carried_in]
    return Segment(graph_module=carve(graph_module, members, named, [*carried_out, *returned]),
                   inputs=tuple(placeholders.index(p) for p in inputs),
                   carried_in=tuple(numbering[n] for n in carried_in),
                   carried_out=tuple(numbering[n] for n in carried_out), outputs=tuple(outs),
                   num_ops=sum(1 for n in members if n.op == "call_function"))


def _trace(joint, example_inputs: list, mesh_axes: dict, functionalize_after: bool = False):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    from ..attention import portable_attention
    from ..collectives import tracing_mesh

    with FakeTensorMode(static_shapes=True):
        fakes = [torch.empty(t.shape, dtype=t.dtype) for t in example_inputs]
    try:
        # make_fx patches process-wide state: one trace at a time. GQA attention is rewritten as capture.py
        # does it: the XLA routes cannot lower SDPA's kernel on fewer key/value heads (Llama failed here).
        with CAPTURE_LOCK, tracing_mesh(mesh_axes), portable_attention():
            if functionalize_after:
                from ..capture import decompositions

                joint = make_fx(joint, tracing_mode="fake", decomposition_table=decompositions())(*fakes)
            return make_fx(functionalize(joint, remove="mutations"), tracing_mode="fake")(*fakes)
    except CaptureError:
        raise
    except Exception as exc:
        raise CaptureError(f"cutting the training step per gradient bucket: tracing its forward and backward "
                           f"failed: {type(exc).__name__}: {exc}") from exc
