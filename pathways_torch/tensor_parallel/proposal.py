"""`pw.tensor_parallel_plan(model)`: the Megatron plan for the common transformer shapes, proposed and printed.

It reads the model's modules, not its class names, and knows these shapes:

- attention with separate projections (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``: Llama-style) and
  no other parameter (a per-head norm, as Qwen3's, would read split heads: such attention is left whole): q, k,
  v column-parallel (their heads split), the output projection row-parallel;
- attention with one fused projection ``c_attn`` and ``c_proj``: transformers' GPT-2 (``Conv1D``, its
  ``split_size`` divided) or a nanoGPT-style ``Linear`` (its head count divided and the width it takes
  from its input read as the shard's);
- ``nn.MultiheadAttention`` (``nn.TransformerEncoderLayer``'s too): its heads split;
- an MLP, column-then-row: gated (``gate_proj``/``up_proj``/``down_proj``, ``w1``/``w3``/``w2``), or a pair such as ``c_fc``/``c_proj``,
  ``fc1``/``fc2``, ``linear1``/``linear2``, ``w1``/``w2``, or an ``nn.Sequential`` of two Linears and
  modules without parameters between and after (activation, dropout), that widens then narrows back;
- the vocabulary: the token embedding row-parallel (each shard its rows of the vocabulary) and the head
  column-parallel with its logits gathered, when they hold at least `VOCAB_SHARE` of the parameters and
  the axis size (if given) divides the vocabulary; a tied pair is split together or not at all.

Paths that differ only in a block index become one ``*`` pattern. The result is a dict (pass it as
``plan=``) that prints as the plan with the reason for each line, and what it left whole and why.
"""

from __future__ import annotations

__all__ = ["tensor_parallel_plan", "ProposedPlan", "VOCAB_SHARE"]

VOCAB_SHARE = 0.10         # split the embedding and head when they hold this share of the parameters or more
_HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "heads", "num_attention_heads")
_WIDTH_ATTRS = ("n_embd", "embed_dim", "hidden_size")
_GATED = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))      # (gate, up, down)
_MLP_PAIRS = (("c_fc", "c_proj"), ("fc1", "fc2"), ("linear1", "linear2"), ("w1", "w2"),
              ("dense_h_to_4h", "dense_4h_to_h"), ("fc_in", "fc_out"))


class ProposedPlan(dict):
    """A plan (pattern → style) with its reasons; prints as the plan."""

    def __init__(self, entries: list, notes: list):
        super().__init__((pattern, style) for pattern, style, _ in entries)
        self.reasons = {pattern: why for pattern, _, why in entries}
        self.notes = list(notes)

    def __str__(self) -> str:
        width = max((len(p) for p in self), default=0)
        lines = [f"{p:<{width}}  {_style_text(s)}  # {self.reasons[p]}" for p, s in self.items()]
        lines += [f"(whole) {note}" for note in self.notes]
        return "\n".join(lines)

    __repr__ = __str__


def _style_text(style) -> str:
    """``style`` as one would write it: its class and the arguments that differ from the defaults."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    defaults = {ColwiseParallel: ("Replicate()", "Shard(dim=-1)"), RowwiseParallel: ("Shard(dim=-1)", "Replicate()")}
    if type(style) not in defaults:
        return repr(style)
    given = (repr(style.input_layouts[0]), repr(style.output_layouts[0]))
    args = [f"{name}={value}" for name, value, default in zip(("input_layouts", "output_layouts"), given,
                                                                defaults[type(style)]) if value != default]
    return f"{type(style).__name__}({', '.join(args)})"


def _patterns(model) -> dict:
    """Each module path → its pattern: the index of a ``ModuleList`` (repeated blocks) as ``*``."""
    import torch.nn as nn

    lists = {path for path, m in model.named_modules() if isinstance(m, nn.ModuleList)}
    patterns = {}
    for path, _ in model.named_modules():
        atoms = path.split(".")
        patterns[path] = ".".join("*" if atom.isdigit() and ".".join(atoms[:i]) in lists else atom
                                  for i, atom in enumerate(atoms))
    return patterns


def tensor_parallel_plan(model, size: int | None = None) -> ProposedPlan:
    """The Megatron plan for ``model``'s attention, MLPs, vocabulary embedding and head (see the module
    docstring); ``size``: the model axis size, to leave whole what it does not divide."""
    entries: dict[str, tuple] = {}
    notes: list[str] = []
    patterns = _patterns(model)

    def add(path: str, style, why: str) -> None:
        entries.setdefault(patterns[path], (style, why))

    for path, module in model.named_modules():
        _attention(path, patterns[path], module, size, add, notes)
        _mlp(path, module, add)
    _vocabulary(model, size, add, notes)
    return ProposedPlan([(p, s, why) for p, (s, why) in entries.items()], sorted(set(notes)))


def _join(path: str, child: str) -> str:
    return f"{path}.{child}" if path else child


def _divides(size, *counts) -> bool:
    return size is None or all(isinstance(c, int) and c % size == 0 for c in counts)


def _attention(path: str, pattern: str, module, size, add, notes: list) -> None:
    import torch.nn as nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from .assign import module_kind, same_qkv_dims
    from .styles import FusedColwiseParallel, MultiheadAttentionParallel, ShardedAttributes

    children = dict(module.named_children())
    if isinstance(module, nn.MultiheadAttention):
        if same_qkv_dims(module) and module.bias_k is None and _divides(size, module.num_heads):
            add(path, MultiheadAttentionParallel(), "nn.MultiheadAttention: its heads split")
        else:
            notes.append(f"{pattern}: nn.MultiheadAttention with kdim/vdim, bias_k or heads the axis "
                         f"does not divide")
        return
    if all(module_kind(children.get(n)) == "linear" for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        others = [n for n, c in children.items() if n not in ("q_proj", "k_proj", "v_proj", "o_proj")
                  and list(c.parameters())]
        if others or list(module.parameters(recurse=False)):
            # A whole parameter applied to each head (Qwen3's q_norm/k_norm) would see only this shard's heads.
            notes.append(f"{pattern}: attention with parameters beside its projections ({others or 'its own'}), "
                         f"which would read split heads")
            return
        for name in ("q_proj", "k_proj", "v_proj"):
            add(_join(path, name), ColwiseParallel(), "attention: its heads split")
        add(_join(path, "o_proj"), RowwiseParallel(), "attention output: reduced over the heads")
        return
    fused, out = children.get("c_attn"), children.get("c_proj")
    if fused is None or out is None or module_kind(fused) != module_kind(out):
        return
    if module_kind(fused) == "conv1d" and isinstance(getattr(module, "split_size", None), int) \
            and fused.nf == 3 * module.split_size:
        add(path, ShardedAttributes("split_size"), "GPT-2 attention: splits q, k, v by split_size")
    elif module_kind(fused) == "linear" and fused.out_features == 3 * fused.in_features:
        attrs = [a for a in (*_HEAD_ATTRS, *_WIDTH_ATTRS) if isinstance(getattr(module, a, None), int)]
        if not any(a in _HEAD_ATTRS for a in attrs):
            notes.append(f"{pattern}: a fused q, k, v projection without a head-count attribute")
            return
        add(path, ShardedAttributes(*attrs, input_width=True), "nanoGPT-style attention: the sizes its forward "
            "reads, as a shard sees them")
    else:
        return
    add(_join(path, "c_attn"), FusedColwiseParallel(3), "q, k, v in one projection: each split on its own")
    add(_join(path, "c_proj"), RowwiseParallel(), "attention output: reduced over the heads")


def _widens_then_narrows(first, second) -> bool:
    from .assign import module_kind

    kinds = (module_kind(first), module_kind(second))
    if kinds not in (("linear", "linear"), ("conv1d", "conv1d")):
        return False
    if kinds[0] == "linear":
        return first.out_features == second.in_features and first.in_features == second.out_features
    return first.nf == second.weight.shape[0] and first.weight.shape[0] == second.nf


def _mlp(path: str, module, add) -> None:
    import torch.nn as nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from .assign import module_kind

    children = dict(module.named_children())
    for gate, up, down in _GATED:
        if all(module_kind(children.get(n)) == "linear" for n in (gate, up, down)):
            add(_join(path, gate), ColwiseParallel(), "gated MLP: its hidden units split")
            add(_join(path, up), ColwiseParallel(), "gated MLP: its hidden units split")
            add(_join(path, down), RowwiseParallel(), "gated MLP output: reduced")
            return
    pairs = [(a, b) for a, b in _MLP_PAIRS if a in children and b in children]
    if isinstance(module, nn.Sequential):      # Linear, activation, Linear (dropout, ...): the rest holds nothing
        linears = [n for n, c in children.items() if module_kind(c) == "linear"]
        if len(linears) == 2 and all(not list(c.parameters()) for n, c in children.items() if n not in linears):
            pairs.append(tuple(linears))
    for first, second in pairs:
        if _widens_then_narrows(children[first], children[second]):
            add(_join(path, first), ColwiseParallel(), "MLP: its hidden units split")
            add(_join(path, second), RowwiseParallel(), "MLP output: reduced")
            return


def _vocabulary(model, size, add, notes: list) -> None:
    import torch.nn as nn
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    embeddings = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        return
    linears = [m for _, m in model.named_modules() if isinstance(m, nn.Linear)]
    # The vocabulary: an embedding a head shares its weight with, else one a head's shape matches, else the largest.
    path, embedding = max(embeddings, key=lambda item: (
        any(m.weight is item[1].weight for m in linears),
        any(tuple(m.weight.shape) == tuple(item[1].weight.shape) for m in linears), item[1].num_embeddings))
    vocab, width = embedding.weight.shape
    heads = [(p, m) for p, m in model.named_modules()
             if isinstance(m, nn.Linear) and tuple(m.weight.shape) == (vocab, width)]
    total = sum(p.numel() for p in model.parameters())
    share = sum(t.numel() for t in {id(t): t for t in [embedding.weight, *(m.weight for _, m in heads)]}.values())
    if share < VOCAB_SHARE * total:
        notes.append(f"{path}: the vocabulary embedding holds {share / total:.0%} of the parameters, under "
                     f"{VOCAB_SHARE:.0%}: splitting it would cost a collective per step for little memory")
        return
    if not _divides(size, vocab) or embedding.max_norm or embedding.sparse or embedding.scale_grad_by_freq:
        why = f"the vocabulary {vocab} is not divisible by {size}" if not _divides(size, vocab) else \
            "it sets max_norm, sparse or scale_grad_by_freq"
        notes.append(f"{path}: {why}")
        return
    add(path, RowwiseParallel(input_layouts=Replicate()), "vocabulary embedding: each shard its rows")
    for head_path, _ in heads:
        add(head_path, ColwiseParallel(output_layouts=Replicate()), "head: each shard its rows of the "
            "vocabulary, the logits gathered")
