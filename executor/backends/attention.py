"""CPU flash attention written in plain torch ops, for the XLA routes.

``F.scaled_dot_product_attention`` traces on CPU to
``aten._scaled_dot_product_flash_attention_for_cpu`` (output, log-sum-exp) and, in a
training step, its ``_backward``. Neither XLA route has a correct lowering of the pair:
torch's decomposition of the forward returns the attention matrix where the kernel
returns the log-sum-exp (right for inference, wrong for the backward that reads it);
the backward has no lowering or decomposition at all (torchax fails, torch_xla runs it
on the host on the wrong log-sum-exp: wrong gradients, measured). These two functions
compute both in ops every XLA route lowers; `flash_attention_decompositions` maps the
aten ops to them.
"""

from __future__ import annotations

__all__ = ["flash_attention_cpu", "flash_attention_cpu_backward", "flash_attention_decompositions"]


def flash_attention_decompositions() -> dict:
    """``{aten op: implementation}`` for the CPU flash attention forward and backward."""
    import torch

    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu.default: flash_attention_cpu,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default: flash_attention_cpu_backward}


def _attention_scores(query, key, attn_mask, is_causal, scale):
    import math

    import torch

    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    if is_causal:
        causal = torch.ones(scores.shape[-2], scores.shape[-1], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    return scores, scale


def _no_dropout(dropout_p) -> None:
    if dropout_p:
        raise NotImplementedError("xla:torchax: scaled_dot_product_attention with dropout_p > 0 inside the kernel "
                                  "cannot be replayed in its backward; apply dropout outside the attention")


def flash_attention_cpu(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    """``aten._scaled_dot_product_flash_attention_for_cpu``: (output, log-sum-exp ``[B, H, L]``)."""
    import torch

    _no_dropout(dropout_p)
    scores, _ = _attention_scores(query, key, attn_mask, is_causal, scale)
    logsumexp = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - logsumexp.unsqueeze(-1)) @ value, logsumexp


def flash_attention_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False,
                                 attn_mask=None, scale=None):
    """``aten._scaled_dot_product_flash_attention_for_cpu_backward`` in plain torch ops.

    Softmax attention's backward from the saved output and log-sum-exp (``[B, H, L]``):
    ``P = exp(QK^T * scale - lse)``, ``dV = P^T dO``, ``dS = P * (dO V^T - rowsum(dO * O))``,
    ``dQ = dS K * scale``, ``dK = dS^T Q * scale``. Dropout inside the kernel cannot be
    replayed (its mask is not saved), so ``dropout_p > 0`` is refused.
    """
    import torch

    _no_dropout(dropout_p)
    scores, scale = _attention_scores(query, key, attn_mask, is_causal, scale)
    probs = torch.exp(scores - logsumexp.unsqueeze(-1).to(scores.dtype))
    grad_value = probs.transpose(-2, -1) @ grad_out
    grad_probs = grad_out @ value.transpose(-2, -1)
    grad_scores = probs * (grad_probs - (grad_out * out).sum(-1, keepdim=True))
    grad_query = (grad_scores @ key) * scale
    grad_key = (grad_scores.transpose(-2, -1) @ query) * scale
    return grad_query, grad_key, grad_value
