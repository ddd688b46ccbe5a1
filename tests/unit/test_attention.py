"""Ecosystem SDPA options rewritten while capturing (pathways_torch/attention.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pathways_torch.attention import math_attention, portable_attention, sdpa_arguments
from pathways_torch.capture import InputSpec, capture

pytestmark = pytest.mark.timeout(60)


def _qkv(query_heads=4, kv_heads=2):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, query_heads, 6, 8, generator=g), torch.randn(2, kv_heads, 6, 8, generator=g),
            torch.randn(2, kv_heads, 6, 8, generator=g))


def test_grouped_query_attention_becomes_attention_on_repeated_heads():
    q, k, v = _qkv()
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with portable_attention():
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got, expected)
    by_hand = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(got, by_hand)


def test_a_captured_gqa_call_has_no_gqa_left():
    q, k, v = _qkv()

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    version = capture(attend, "attend", [InputSpec(tuple(t.shape), torch.float32) for t in (q, k, v)],
                      lambda tensors: (list(tensors), {}))
    code = version.graph_module.code
    assert "repeat_interleave" in code or "expand" in code, code
    out = version.graph_module(q, k, v)
    torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, attend(q, k, v))


@pytest.mark.parametrize("mask", ["none", "bool", "float"])
def test_math_attention_is_sdpa_without_dropout(mask):
    q, k, v = _qkv(4, 4)
    attn_mask = {"none": None, "bool": torch.rand(6, 6, generator=torch.Generator().manual_seed(1)) > 0.3,
                 "float": torch.randn(6, 6)}[mask]
    if mask == "bool":
        attn_mask[:, 0] = True   # no row fully masked
    arguments = sdpa_arguments((q, k, v), {"attn_mask": attn_mask, "scale": 0.3})
    torch.testing.assert_close(math_attention(arguments, lambda w, p: w),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=0.3))
