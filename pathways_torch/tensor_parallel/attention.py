"""``nn.MultiheadAttention`` per shard (`styles.MultiheadAttentionParallel`): this shard's heads, attended, reduced.

The module keeps q, k and v's projections in one ``in_proj_weight`` ([3E, E], split in 3 chunks, each
on its own) and calls ``F.multi_head_attention_forward``, which checks the whole width; so the per-shard
forward is written here, as that function computes it on the paths a split can take: self- or
cross-attention with one projection, an ``attn_mask`` of shape (L, S) and a ``key_padding_mask``, bool
(True: not attended) or float (added), dropout on the weights in training. Asking for the attention
weights (``need_weights=True``, the module's default) is refused: they are averaged over all heads, which
no shard holds; ``TransformerEncoderLayer`` asks for none.
"""

from __future__ import annotations

from ..errors import CaptureError

__all__ = ["sharded_attention"]


def _as_additive(mask, dtype):
    import torch

    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


def sharded_attention(lowered, module, where: str):
    """The per-shard ``forward`` of ``module`` (an ``nn.MultiheadAttention``) under ``lowered``."""
    import torch
    import torch.nn.functional as F

    size = lowered.plan.size

    def forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if need_weights:
            raise CaptureError(f"{where}: need_weights=True asks for the weights averaged over all heads, which no "
                               f"shard holds; call it with need_weights=False")
        if attn_mask is not None and attn_mask.dim() != 2:
            raise CaptureError(f"{where}: an attn_mask of shape {list(attn_mask.shape)} (per head) is not "
                               f"supported with the heads split; pass one of shape (L, S)")
        # f once per input tensor (self-attention: one gradient all-reduce), before any transpose makes three.
        query, key, value = (lowered.enter_once(t) for t in (query, key, value))
        if not module.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        w_q, w_k, w_v = module.in_proj_weight.chunk(3)
        b_q, b_k, b_v = module.in_proj_bias.chunk(3) if module.in_proj_bias is not None else (None,) * 3
        heads = module.num_heads // size

        def project(x, w, b):
            y = F.linear(x, w, b)      # this shard's heads: column-parallel
            return y.unflatten(-1, (heads, module.head_dim)).transpose(1, 2)

        q, k, v = project(query, w_q, b_q), project(key, w_k, b_k), project(value, w_v, b_v)
        mask = _as_additive(attn_mask, q.dtype)
        if key_padding_mask is not None:
            padding = _as_additive(key_padding_mask, q.dtype)[:, None, None, :]
            mask = padding if mask is None else mask + padding
        if is_causal and mask is not None:     # a padding mask too: the causal one joins it
            causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
            mask = mask + _as_additive(causal, q.dtype)
        dropout = module.dropout if module.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                           is_causal=is_causal and mask is None)
        y = y.transpose(1, 2).flatten(-2)
        out = lowered.reduce_rows(F.linear(y, module.out_proj.weight))     # row-parallel, then the bias
        if module.out_proj.bias is not None:
            out = out + module.out_proj.bias
        return (out if module.batch_first else out.transpose(0, 1)), None

    return forward
