"""``F.scaled_dot_product_attention`` in forms every backend can carry, applied while capturing.

Model code from the ecosystem (Hugging Face ``transformers``' ``sdpa`` attention, nanoGPT)
calls SDPA with options that trace to kernels some routes cannot lower:
``enable_gqa=True`` (grouped-query attention: fewer key/value heads) and ``dropout_p > 0``
(in training mode). While a function is captured, `portable_attention` rewrites those
calls into the same math in plain ops: key and value heads repeated for GQA (exactly
what SDPA does), and, for dropout, the reference math attention with the dropout of
the training step's counter-based RNG (`pathways_torch.training.random`), so that the
masks are reproducible across executors and resumptions.
"""

from __future__ import annotations

import contextlib
import math

__all__ = ["portable_attention", "math_attention", "sdpa_arguments"]

_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def sdpa_arguments(args, kwargs) -> dict:
    """SDPA's arguments by name, defaults filled in."""
    bound = dict(zip(_NAMES, args))
    bound.update(kwargs)
    for name, default in (("attn_mask", None), ("dropout_p", 0.0), ("is_causal", False), ("scale", None),
                          ("enable_gqa", False)):
        bound.setdefault(name, default)
    return bound


def repeat_kv_heads(query, key, value):
    """GQA as SDPA does it: each key/value head serves ``query heads // key heads`` query heads."""
    groups = query.shape[-3] // key.shape[-3]
    return key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)


def math_attention(a: dict, dropout):
    """The reference math of SDPA (torch's documented equivalent), with ``dropout(weights, p)`` applied."""
    import torch

    query, key, value, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    if a["enable_gqa"]:
        key, value = repeat_kv_heads(query, key, value)
    length, source = query.shape[-2], key.shape[-2]
    scale = 1 / math.sqrt(query.shape[-1]) if a["scale"] is None else a["scale"]
    weights = (query @ key.transpose(-2, -1)) * scale
    if a["is_causal"]:
        causal = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        weights = weights.masked_fill(~causal, float("-inf"))
    if mask is not None:
        weights = weights.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else weights + mask
    weights = torch.softmax(weights, dim=-1)
    return dropout(weights, a["dropout_p"]) @ value


class _PortableAttention:
    """The TorchFunctionMode body: GQA calls become plain SDPA on repeated heads."""

    @staticmethod
    def handle(func, args, kwargs):
        a = sdpa_arguments(args, kwargs)
        if not a["enable_gqa"] or a["query"].shape[-3] == a["key"].shape[-3]:
            a["enable_gqa"] = False
            return func(**a)
        a["key"], a["value"] = repeat_kv_heads(a["query"], a["key"], a["value"])
        a["enable_gqa"] = False
        return func(**a)


@contextlib.contextmanager
def portable_attention():
    """Within: SDPA calls with ``enable_gqa=True`` run as SDPA on repeated key/value heads."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class PortableAttentionMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.scaled_dot_product_attention:
                return _PortableAttention.handle(func, args, kwargs or {})
            return func(*args, **(kwargs or {}))

    with PortableAttentionMode():
        yield
