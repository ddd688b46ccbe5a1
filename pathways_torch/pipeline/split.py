"""Cutting a model into pipeline chunks: one traced forward + loss, split where the markers are.

The model's forward and its loss on one microbatch shard are traced once (``make_fx``
on fake tensors, every parameter, buffer and batch leaf an input), with a
`pipe_split` marker node wherever a chunk ends — the user's own ``pw.pipe_split()``
calls, or markers the splitter puts before chosen blocks of a block list
(``nn.Sequential``, or the ``self.layers`` / ``self.h`` / ``self.blocks`` a forward loops
over). The aten graph is then cut at the markers into chunk graphs:

- a chunk's inputs are the parameters, buffers and batch leaves its ops read, then
  the values an earlier chunk computed that this one or a later one reads (what
  the chunk before it sends; a value skipping a chunk passes through it);
- the last chunk returns the loss.

So embeddings go with the first chunk and the head and loss with the last, as the
forward computes them; a parameter read by two chunks (a tied embedding and head)
is an input of both (`Chunk.params`), and the trainer keeps the copies equal.

A user's autograd Function stays one node through the cut and is applied again when a chunk is
differentiated, so that its own backward runs (`user_functions`); a value computed where the model turned
gradients off passes none back (`stop_gradient.kept_detach`).
"""

from __future__ import annotations

import dataclasses
import functools

from ..errors import CaptureError, PlacementError
from ..graph_cut import CAPTURE_LOCK, carve
from ..training.units import block_list
from .marker import MARKER, count_markers_into, pipe_split, stop_counting_into
from .user_functions import UserFunctions

__all__ = ["Chunk", "SplitModel", "split_model", "find_blocks", "balanced_boundaries"]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One piece of the traced forward, as an fx graph over its inputs.

    Inputs of ``graph_module``, in order: ``params`` (trained), ``constants`` (frozen parameters
    and buffers, by name), the batch leaves ``batch_leaves`` (indices), then ``incoming`` (value
    numbers sent by the chunk before). Outputs: ``outgoing`` (value numbers), then the loss for
    the last chunk.
    """

    index: int
    graph_module: object
    params: tuple[str, ...]
    constants: tuple[str, ...]
    batch_leaves: tuple[int, ...]
    incoming: tuple[int, ...]
    outgoing: tuple[int, ...]
    has_loss: bool
    modules: tuple[str, ...]          # the top-level modules whose ops landed here (for `describe`)

    @property
    def num_inputs(self) -> int:
        return len(self.params) + len(self.constants) + len(self.batch_leaves) + len(self.incoming)


@dataclasses.dataclass(frozen=True)
class SplitModel:
    chunks: tuple[Chunk, ...]
    value_layouts: dict          # value number → (shape, dtype) of a value crossing chunks
    how: str                     # "pipe_split markers" or "blocks of model.<name>"
    rng_leaf: int = -1           # the batch-leaf index of the dropout key input: int64[1, 2] = (step, first row)
    rank_leaf: int = -1          # under tensor parallelism, the leaf of the model rank: int64[1] (else -1)

    def describe(self, param_numel: dict, rank_of=lambda c: c) -> str:
        """Which module went where and each chunk's parameter count, as text."""
        lines = [f"{len(self.chunks)} chunks, cut at {self.how}"]
        for chunk in self.chunks:
            count = sum(param_numel[name] for name in chunk.params)
            shared = [n for n in chunk.params if any(n in other.params for other in self.chunks if other is not chunk)]
            modules = ", ".join(chunk.modules) or "-"
            extra = f"; shared with another chunk: {', '.join(shared)}" if shared else ""
            loss = " + loss" if chunk.has_loss else ""
            lines.append(f"chunk {chunk.index} (rank {rank_of(chunk.index)}): {count:,} parameters; "
                         f"{modules}{loss}; sends {len(chunk.outgoing)} value(s){extra}")
        return "\n".join(lines)


def find_blocks(model) -> tuple[str, list]:
    """The model's block list: ``(name, [modules])`` (`training.units.block_list`); refuses a model without one."""
    found = block_list(model)
    if found is None:
        raise PlacementError(f"pw.Pipeline: {type(model).__name__} has no block list to split (an nn.Sequential, "
                             f"or an nn.ModuleList such as self.layers / self.h / self.blocks); mark the cuts with "
                             f"pw.pipe_split() in its forward")
    return found


def balanced_boundaries(costs: list[float], num_chunks: int) -> list[int]:
    """Indices ``b_1 < … < b_{C-1}`` cutting ``costs`` into ``num_chunks`` contiguous groups whose
    largest sum is smallest (the linear partition problem, by dynamic programming)."""
    n = len(costs)
    if num_chunks > n:
        raise PlacementError(f"pw.Pipeline: {num_chunks} chunks need at least {num_chunks} blocks, the model has {n}; "
                             f"use fewer stages (or virtual stages)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(num_chunks + 1)]
    best[0][0] = 0.0
    for k in range(1, num_chunks + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(num_chunks, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return sorted(bounds)[1:]


def split_model(model, loss_fn, form, leaves: list, *, trained: list[str], constants: list[str],
                num_chunks: int, seed: int = 0, allow_buffer_reads: bool = False, tensor=None) -> SplitModel:
    """Trace ``model`` + loss on example ``leaves`` (one microbatch shard) and cut it into ``num_chunks``.

    One more batch leaf follows the batch's own: the dropout key, int64[1, 2] = (step number, global
    index of the shard's first row); a chunk with dropout reads it (`SplitModel.rng_leaf`).
    ``allow_buffer_reads`` is for evaluation: a forward that writes a buffer is refused only in training.
    ``tensor`` (a `pipeline.tensor.StageTensor`): the forward is traced per model shard, on each parameter's
    local shape with the plan lowered into it; one more leaf, the model rank (int64[1]), follows the key.
    """
    import torch

    leaves = [*leaves, torch.empty((1, 2), dtype=torch.int64, device="meta")]
    if tensor is not None:
        leaves.append(torch.empty((1,), dtype=torch.int64, device="meta"))
    trace = _Trace(model, loss_fn, form, leaves, trained + constants, seed, tensor)
    hooks, how = [], "pipe_split markers"
    if not _has_markers(trace):
        name, blocks = find_blocks(model)
        costs = [float(sum(p.numel() for p in b.parameters())) or 1.0 for b in blocks]
        for index in balanced_boundaries(costs, num_chunks):
            hooks.append(blocks[index].register_forward_pre_hook(lambda module, args: pipe_split()))
        how = f"blocks of model.{name}" if name else "the blocks of the nn.Sequential"
    try:
        with _ModuleEntries(model) as entries:
            graph_module = trace()
    finally:
        for hook in hooks:
            hook.remove()
    # Ops whose values nothing reads (a dropout key made where no dropout follows) would make inputs of a chunk.
    graph_module.graph.eliminate_dead_code(is_impure_node=lambda n: n.target is MARKER or n.is_impure())
    markers = [n for n in graph_module.graph.nodes if n.op == "call_function" and n.target is MARKER]
    if len(markers) != num_chunks - 1:
        raise PlacementError(f"pw.Pipeline: expected {num_chunks - 1} pipe_split() markers for {num_chunks} chunks "
                             f"(stages x virtual stages), the forward has {len(markers)}; put one marker between "
                             f"each pair of chunks, or none to split the block list automatically")
    split = _cut(graph_module, trained, constants, num_chunks, how, refuse_buffer_writes=not allow_buffer_reads)
    modules = entries.by_chunk(num_chunks)
    chunks = tuple(dataclasses.replace(c, modules=m) for c, m in zip(split.chunks, modules))
    extra = {"rank_leaf": len(leaves) - 1} if tensor is not None else {}
    return dataclasses.replace(split, chunks=chunks, rng_leaf=len(leaves) - 1 - len(extra), **extra)


@dataclasses.dataclass(frozen=True)
class _Trace:
    """The model's forward and loss on one microbatch shard, traced (``make_fx`` on fake tensors) when called."""

    model: object
    loss_fn: object
    form: object
    leaves: list
    names: list
    seed: int
    tensor: object = None

    def __call__(self):
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx

        tensors = dict(self.model.named_parameters())
        tensors.update(self.model.named_buffers())
        shape = (lambda n: tensors[n].shape) if self.tensor is None else (
            lambda n: self.tensor.local_shape(n) if n in self.tensor.plan.shapes else tensors[n].shape)
        with FakeTensorMode(static_shapes=True):
            fakes = [torch.empty(shape(n), dtype=tensors[n].dtype) for n in self.names]
            fakes += [torch.empty(t.shape, dtype=t.dtype) for t in self.leaves]
        user_functions = UserFunctions()
        try:
            with CAPTURE_LOCK:   # make_fx patches process-wide state: one trace at a time
                graph_module = make_fx(functools.partial(self._whole, user_functions), tracing_mode="fake")(*fakes)
            user_functions.replay_in(graph_module)
            return graph_module
        except CaptureError:
            raise
        except Exception as exc:
            raise CaptureError(f"pw.Pipeline: tracing {type(self.model).__name__}'s forward and loss failed: "
                               f"{type(exc).__name__}: {exc}") from exc

    def _whole(self, user_functions, *flat):
        import contextlib

        import torch
        from torch.func import functional_call

        from ..attention import portable_attention
        from ..stop_gradient import kept_detach
        from ..training.batches import forward_loss
        from ..training.random import sample_keyed_rng

        names = self.names
        named = dict(zip(names, flat[:len(names)]))
        leaves = list(flat[len(names):])
        rank = leaves.pop() if self.tensor is not None else None
        batch, key = leaves[:-1], leaves[-1]
        lowered = self.tensor.lowered(self.model, rank) if rank is not None else contextlib.nullcontext()
        keyed = sample_keyed_rng(self.seed, key[0, 0], key[0, 1])
        with portable_attention(), keyed, lowered, kept_detach(user_functions):
            loss = forward_loss(functional_call, self.model, self.loss_fn, named, self.form, batch)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise CaptureError(f"pw.Pipeline: the loss must be a 0-d tensor, got {type(loss).__name__}"
                               f"{list(getattr(loss, 'shape', []))}")
        return loss


def _has_markers(trace: _Trace) -> bool:
    """Whether the user's forward calls pw.pipe_split() (seen by tracing once)."""
    graph_module = trace()
    return any(n.op == "call_function" and n.target is MARKER for n in graph_module.graph.nodes)


def _cut(graph_module, trained: list[str], constants: list[str], num_chunks: int, how: str,
         refuse_buffer_writes: bool = True) -> SplitModel:
    """Assign every op to a chunk (the markers before it) and build one graph per chunk."""
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    names = trained + constants
    role = {}   # placeholder node → ("param" | "constant", name) or ("batch", leaf index)
    for index, node in enumerate(placeholders):
        if index < len(trained):
            role[node] = ("param", names[index])
        elif index < len(names):
            role[node] = ("constant", names[index])
        else:
            role[node] = ("batch", index - len(names))
    if refuse_buffer_writes:
        _refuse_mutated_buffers(graph_module, role)
    chunk_of, current, output = {}, 0, None
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target is MARKER:
            current += 1
        elif node.op in ("call_function", "get_attr"):
            chunk_of[node] = current
        elif node.op == "output":
            output = node
    # A value crossing chunks: computed in one chunk, read by a later one.
    last_use = {}
    for node, chunk in chunk_of.items():
        for arg in node.all_input_nodes:
            if arg in chunk_of and chunk_of[arg] < chunk:
                last_use[arg] = max(last_use.get(arg, -1), chunk)
    (loss_node,) = output.all_input_nodes
    if chunk_of.get(loss_node, num_chunks - 1) != num_chunks - 1:
        last_use[loss_node] = num_chunks - 1
    numbering = {node: i for i, node in enumerate(graph_module.graph.nodes)}
    crossing = sorted(last_use, key=numbering.get)
    layouts = {numbering[n]: (tuple(n.meta["val"].shape), n.meta["val"].dtype) for n in crossing}
    chunks, incoming = [], ()
    for c in range(num_chunks):
        members = [n for n in graph_module.graph.nodes if chunk_of.get(n) == c]
        outgoing = tuple(numbering[n] for n in crossing if chunk_of[n] <= c < last_use[n])
        chunk = _chunk_graph(graph_module, c, members, role, incoming, outgoing, numbering,
                             loss_node if c == num_chunks - 1 else None)
        chunks.append(chunk)
        incoming = outgoing
    return SplitModel(tuple(chunks), layouts, how)


def _refuse_mutated_buffers(graph_module, role: dict) -> None:
    """A forward that writes a buffer (BatchNorm's running statistics, a counter) is refused: a pipeline
    step does not carry buffer updates between microbatches and stages yet."""
    for node in graph_module.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for arg, value in zip(schema.arguments, node.args):
            written = arg.alias_info is not None and arg.alias_info.is_write
            base = _view_base(value)
            if written and base in role and role[base][0] == "constant":
                raise PlacementError(
                    f"pw.Pipeline: the forward updates buffer {role[base][1]!r} in place ({node.target}); pipeline "
                    f"steps do not carry buffer updates yet (BatchNorm's running statistics, counters): use "
                    f"pw.DataParallel for this model, or a normalization without running statistics")


def _view_base(value):
    """The placeholder a chain of view ops starts from (or the value itself)."""
    while getattr(value, "op", None) == "call_function" and getattr(value.target, "is_view", False):
        value = value.args[0]
    return value


def _chunk_graph(graph_module, index, members, role, incoming, outgoing, numbering, loss_node) -> Chunk:
    used = {arg for n in members for arg in n.all_input_nodes if arg.op == "placeholder"}
    if loss_node is not None and loss_node.op == "placeholder":
        used.add(loss_node)
    ordered = sorted(used, key=numbering.get)
    params = [n for n in ordered if role[n][0] == "param"]
    consts = [n for n in ordered if role[n][0] == "constant"]
    batch = [n for n in ordered if role[n][0] == "batch"]
    by_number = {numbering[n]: n for n in graph_module.graph.nodes}
    inputs = [(node, f"{role[node][0]}_{numbering[node]}") for node in params + consts + batch]
    inputs += [(by_number[value], f"incoming_{value}") for value in incoming]
    results = [by_number[v] for v in outgoing] + ([loss_node] if loss_node is not None else [])
    module = carve(graph_module, members, inputs, results)
    return Chunk(index=index, graph_module=module, params=tuple(role[n][1] for n in params),
                 constants=tuple(role[n][1] for n in consts), batch_leaves=tuple(role[n][1] for n in batch),
                 incoming=tuple(incoming), outgoing=tuple(outgoing), has_loss=loss_node is not None,
                 modules=())


class _ModuleEntries:
    """Records, while the forward is traced, the chunk in which each named part of the model starts.

    Named parts: the items of every block list and their siblings on the way down to it
    (``transformer.wte``, ``transformer.h.3``, ``lm_head``) — what `SplitModel.describe` lists.
    """

    def __init__(self, model):
        import torch

        lists = {n for n, m in model.named_modules()
                 if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and len(m) > 1}
        # A block list inside a block (an nn.Sequential block of an nn.Sequential) is part of that block.
        lists = {n for n in lists if not any(o != n and (o == "" or n.startswith(o + ".")) for o in lists)}
        ancestors = {""} | {".".join(n.split(".")[:i]) for n in lists for i in range(1, n.count(".") + 2)}
        self._names, self._modules = {}, {}
        for name, module in model.named_modules():
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            if name and name not in ancestors and (parent in ancestors or parent in lists):
                self._names[id(module)] = name
                self._modules[id(module)] = module
        self.entries: dict[str, int] = {}
        self.markers = 0

    def __enter__(self):
        # Per-module hooks, registered after the splitter's marker hooks: they run after them, so a block
        # that starts a chunk is counted in it.
        self._hooks = [module.register_forward_pre_hook(self._entered)
                       for module in self._modules.values()]
        count_markers_into(self)
        return self

    def _entered(self, module, args):
        name = self._names[id(module)]
        self.entries.setdefault(name, self.markers)

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        stop_counting_into(self)

    def by_chunk(self, num_chunks: int) -> list[tuple[str, ...]]:
        out = [[] for _ in range(num_chunks)]
        for name, chunk in self.entries.items():
            out[min(chunk, num_chunks - 1)].append(name)
        return [tuple(names) for names in out]
