"""The training every throughput benchmark shares: the example Transformer (`examples/transformer.py`, reversal task,
dropout 0), its initial weights (``torch.manual_seed``), AdamW, the global batches, and tokens per second."""

from __future__ import annotations

import os
import sys

# The example model lives beside the package, not in it.
_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import torch  # noqa: E402

from transformer import DecoderOnlyTransformer, ReverseTask, TransformerConfig, loss_fn  # noqa: E402

__all__ = ["LR", "SEED", "make_config", "make_model", "make_batches", "tokens_per_s", "ReverseTask", "loss_fn"]

LR = 1e-3
SEED = 0


def make_config(args) -> TransformerConfig:
    return TransformerConfig(vocab=24, length=12, width=args.width, depth=args.depth, heads=4, dropout=0.0)


def make_model(cfg: TransformerConfig):
    torch.manual_seed(SEED)
    model = DecoderOnlyTransformer(cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def make_batches(cfg: TransformerConfig, args) -> list[tuple[torch.Tensor, torch.Tensor]]:
    task = ReverseTask(cfg, SEED)
    return [task.batch(i, args.batch) for i in range(args.warmup + args.repeats * args.steps)]


def tokens_per_s(args, cfg, window_s: float) -> float:
    return args.steps * args.batch * cfg.context / window_s
