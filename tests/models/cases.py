"""Model code written outside this repo, as people bring it: the cases of the conformance suite.

Each case builds a model (seeded), an optimizer factory, a few batches in the form the
model's ecosystem uses, and the loss function (None: the model returns its loss). The
oracle is single-process eager (`eager_oracle`), or DDP's semantics for BatchNorm under
data parallelism (`ddp_oracle`: each shard normalises with its own batch statistics,
gradients averaged, running buffers taken from shard 0); ``nn.SyncBatchNorm`` (global
statistics) against single-process eager.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, LENGTH, BATCH = 48, 8, 4
STEPS = 3


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    make_model: Callable[[], nn.Module]
    batches: Callable[[], list]
    loss_fn: Callable | None
    tolerance: float            # relative, on losses and final parameters
    ddp_buffers: bool = False   # BatchNorm: compare data parallelism with DDP, not with one process


def _tokens(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)


def _seeded(build):
    def make():
        torch.manual_seed(0)
        return build()
    return make


# ------------------------------------------------------------ Hugging Face transformers

def _gpt2():
    import transformers

    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _llama():
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config)


def _hf_batches():
    # As a Hugging Face training loop writes them: keywords, the model computes its own loss from labels.
    return [{"input_ids": ids, "labels": ids} for ids in (_tokens(s) for s in range(STEPS))]


# ------------------------------------------------------------ a GPT written the usual way (nanoGPT's idioms)

class _Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class _Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), _Attention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """Token + position embeddings, pre-norm blocks, the head tied to the token embedding; ``(logits, loss)``."""

    def __init__(self, width: int = 32, heads: int = 4, depth: int = 2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, width), nn.Embedding(LENGTH, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight   # tied
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * depth))

    def forward(self, idx, targets=None):
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def _next_token_batches():
    batches = []
    for s in range(STEPS):
        ids = _tokens(s)
        batches.append((ids, torch.roll(ids, -1, dims=1)))
    return batches


# ------------------------------------------------------------ torch.nn's own Transformer layers

class EncoderClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.encoder = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.attend = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, ids):
        x = self.encoder(self.embed(ids))
        x, _ = self.attend(x, x, x, need_weights=False)
        return self.head(x.mean(dim=1))


def _classification_batches():
    g = torch.Generator().manual_seed(5)
    return [(_tokens(s), torch.randint(0, 5, (BATCH,), generator=g)) for s in range(STEPS)]


# ------------------------------------------------------------ a CNN with BatchNorm and a residual block

class ResidualCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.conv1, self.bn1 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.stem(x)
        x = F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))
        return self.head(x.mean(dim=(2, 3)))


def _image_batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH, 3, 8, 8, generator=g, dtype=torch.float64),
             torch.randint(0, 4, (BATCH,), generator=g)) for _ in range(STEPS)]


# ------------------------------------------------------------ frozen parameters, a buffer updated in forward

class FrozenAndCounted(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(6, 6)
        for p in self.frozen.parameters():
            p.requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        self.calls.add_(1)
        return self.body(self.frozen(x)) * (1 + 0 * self.calls)


def _regression_batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, 6, generator=g, dtype=torch.float64),
             torch.randn(BATCH, 1, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def _cross_entropy(output, target):
    return F.cross_entropy(output, target)


CASES = [
    Case("hf-gpt2", _seeded(_gpt2), _hf_batches, None, 1e-4),
    Case("hf-llama", _seeded(_llama), _hf_batches, None, 1e-4),
    Case("nanogpt", _seeded(NanoGPT), _next_token_batches, None, 1e-4),
    # float64: the key projection's bias has a gradient that is zero in exact arithmetic (softmax does not
    # see a shift of every key), so in float32 Adam turns rounding noise into steps that differ by 1e-4.
    Case("torch-transformer", _seeded(lambda: EncoderClassifier().double()), _classification_batches,
         _cross_entropy, 1e-9),
    Case("resnet-batchnorm", _seeded(lambda: ResidualCNN().double()), _image_batches, _cross_entropy, 1e-9,
         ddp_buffers=True),
    # nn.SyncBatchNorm: global statistics over the data axis, so the oracle is one process with the whole batch.
    Case("resnet-syncbatchnorm", _seeded(lambda: nn.SyncBatchNorm.convert_sync_batchnorm(ResidualCNN().double())),
         _image_batches, _cross_entropy, 1e-9),
    Case("frozen-and-buffer", _seeded(lambda: FrozenAndCounted().double()), _regression_batches,
         F.mse_loss, 1e-9),
]


# ------------------------------------------------------------ the oracles

def _loss(model, loss_fn, batch):
    from pathways_torch.training.batches import loss_from_output

    if isinstance(batch, dict):
        output = model(**batch)
        return loss_fn(output, batch) if loss_fn else loss_from_output(output, model)
    if loss_fn is None:
        return loss_from_output(model(*batch), model)
    return loss_fn(model(*batch[:-1]), batch[-1])


def eager_oracle(case: Case, make_optimizer) -> tuple[list[float], dict]:
    """Single-process eager: the losses and the final parameters."""
    model = case.make_model()
    optimizer = make_optimizer(model)
    losses = []
    for batch in case.batches():
        optimizer.zero_grad()
        loss = _loss(model, case.loss_fn, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _shard(batch, index: int, shards: int):
    def split(t):
        size = t.shape[0] // shards
        return t[index * size:(index + 1) * size]
    if isinstance(batch, dict):
        return {k: split(v) for k, v in batch.items()}
    return tuple(split(t) for t in batch)


def ddp_oracle(case: Case, make_optimizer, shards: int) -> tuple[list[float], dict]:
    """DDP's semantics in one process: each shard's forward on its own batch (its own BatchNorm statistics),
    gradients and losses averaged over shards, shard 0's buffers kept (broadcast_buffers=True)."""
    model = case.make_model()
    optimizer = make_optimizer(model)
    losses = []
    for batch in case.batches():
        optimizer.zero_grad()
        replicas = [copy.deepcopy(model) for _ in range(shards)]
        shard_losses = []
        for index, replica in enumerate(replicas):
            loss = _loss(replica, case.loss_fn, _shard(batch, index, shards))
            loss.backward()
            shard_losses.append(loss.item())
        for name, p in model.named_parameters():
            grads = [dict(r.named_parameters())[name].grad for r in replicas]
            p.grad = None if grads[0] is None else sum(grads) / shards
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(dict(replicas[0].named_buffers())[name])
        optimizer.step()
        losses.append(sum(shard_losses) / shards)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
