"""The example model and task: a small decoder-only Transformer that learns to reverse sequences.

Task ("reverse"): a sequence of ``length`` random symbols, a separator, then the
same symbols in reverse order. The model reads ``x₁ … x_L SEP x_L … x₂`` and is
trained to predict the next token on the answer half only (the first half is
random, nothing to learn). Held-out accuracy is per answer token, with the true
prefix given (teacher forcing), on batches drawn from a seed never used for training.
Batches are a pure function of (seed, step), so a resumed run sees the same data.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["TransformerConfig", "DecoderOnlyTransformer", "ReverseTask", "loss_fn", "IGNORE"]

IGNORE = -100
SEP = 1          # token 0 is unused padding, 1 separates question from answer


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    vocab: int = 24
    length: int = 12           # symbols to reverse; the model's context is 2 * length
    width: int = 64
    depth: int = 2
    heads: int = 4
    dropout: float = 0.0

    @property
    def context(self) -> int:
        return 2 * self.length


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        if cfg.width % cfg.heads:
            raise ValueError(f"width {cfg.width} must be divisible by heads {cfg.heads}")
        self.heads = cfg.heads
        # No bias: a key bias gets an exactly-zero gradient (softmax ignores it) that Adam would
        # turn into float32 noise-driven updates.
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.heads))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        weights = self.drop(scores.masked_fill(causal, float("-inf")).softmax(dim=-1))
        y = (weights @ v).transpose(1, 2).reshape(b, t, c)
        return self.drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.width), nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(), nn.Linear(4 * cfg.width, cfg.width),
                                 nn.Dropout(cfg.dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class DecoderOnlyTransformer(nn.Module):
    """Token + position embeddings, ``depth`` pre-LayerNorm blocks, a final LayerNorm and a linear head."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.tokens = nn.Embedding(cfg.vocab, cfg.width)
        self.positions = nn.Embedding(cfg.context, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tokens(tokens) + self.positions(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def loss_fn(logits, targets):
    """Mean cross-entropy over the answer tokens."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)


class ReverseTask:
    """Batches of the reversal task, a pure function of (seed, index)."""

    def __init__(self, cfg: TransformerConfig, seed: int = 0):
        if cfg.vocab < 4:
            raise ValueError(f"vocab: expected >= 4 (2 reserved tokens + symbols), got {cfg.vocab}")
        self.cfg, self.seed = cfg, seed

    def batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs int64[batch, 2L], targets int64[batch, 2L]) for batch number ``index``."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        length = self.cfg.length
        symbols = torch.randint(2, self.cfg.vocab, (batch_size, length), generator=g)
        sep = torch.full((batch_size, 1), SEP, dtype=torch.int64)
        full = torch.cat([symbols, sep, symbols.flip(1)], dim=1)
        inputs, targets = full[:, :-1], full[:, 1:].clone()
        targets[:, :length] = IGNORE     # up to the separator: random symbols (and the separator itself)
        return inputs.contiguous(), targets

    @staticmethod
    @torch.no_grad()
    def accuracy(model: nn.Module, inputs, targets) -> tuple[float, float]:
        """(per-token accuracy, whole-sequence accuracy) on the answer tokens."""
        was_training = model.training
        model.eval()
        predicted = model(inputs).argmax(-1)
        model.train(was_training)
        answer = targets != IGNORE
        correct = (predicted == targets) & answer
        token = correct.sum().item() / answer.sum().item()
        sequence = (correct | ~answer).all(dim=1).float().mean().item()
        return token, sequence
