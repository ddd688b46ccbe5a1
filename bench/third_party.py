"""A third-party GPT through ``ctx.wrap``: tokens per second on the default backend (XLA) against eager executors.

The model is the nanoGPT-style GPT the model tests train (`tests.models.cases.NanoGPT`: token and position
embeddings, pre-norm blocks with ``F.scaled_dot_product_attention``, a tied head, ``(logits, loss)`` returned), at
width 64 and depth 2 (about 0.1M parameters), trained unchanged: ``ctx.wrap(model, optimizer=AdamW, loss_fn=None,
plan=pw.DataParallel("data"))`` on N executors, the same initial weights and batches for both backends.

Both contexts stay alive; rounds interleave them (the order rotates each round). A window dispatches ``--steps``
steps back to back and waits for the last loss; tokens/s = steps x batch x length / its wall time. The ratio
default / eager is taken per round; the median and the range of the per-round ratios are reported. Target
(issue 32): at least 1.0 at N = 2.

    .venv/bin/python -m bench.third_party [--executors 2] [--steps 30] [--rounds 5] [--batch 32]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import pathways_torch as pw
from bench.common import add_quick_and_json, print_table, write_results
from tests.models.cases import LENGTH, VOCAB, NanoGPT

BACKENDS = ("xla", "eager")


def _batches(count: int, batch: int) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (batch, LENGTH), generator=g)
        out.append((ids, torch.roll(ids, -1, dims=1)))
    return out


class _Run:
    """One backend's context and trainer, warmed up."""

    def __init__(self, backend: str, model: torch.nn.Module, executors: int, batches: list, warmup: int):
        self.backend = backend
        self.ctx = pw.Context(num_executors=executors, backend=backend)
        model = copy.deepcopy(model)
        self.trainer = self.ctx.wrap(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=None,
                                     mesh=self.ctx.mesh({"data": executors}), plan=pw.DataParallel("data"))
        self.batches = batches
        for batch in batches[:warmup]:
            self.trainer.step(batch).result(600)

    def window(self, steps: int) -> float:
        """Seconds for ``steps`` steps dispatched back to back, the last loss waited for."""
        began = time.perf_counter()
        loss = None
        for i in range(steps):
            loss = self.trainer.step(self.batches[i % len(self.batches)])
        value = loss.result(600)
        if not torch.isfinite(value):
            raise RuntimeError(f"{self.backend}: the loss is {value}: a rate of a broken run means nothing")
        return time.perf_counter() - began

    def close(self) -> None:
        self.ctx.close()


def measure(executors: int, steps: int, rounds: int, batch: int, warmup: int) -> dict:
    model = NanoGPT(width=64, heads=4, depth=2)
    params = sum(p.numel() for p in model.parameters())
    batches = _batches(max(steps, warmup), batch)
    runs = [_Run(backend, model, executors, batches, warmup) for backend in BACKENDS]
    tokens = steps * batch * LENGTH
    per_round = []
    try:
        for r in range(rounds):
            rates = {}
            for run in runs[r % 2:] + runs[:r % 2]:   # the order rotates
                rates[run.backend] = tokens / run.window(steps)
            per_round.append(rates)
            print(f"round {r + 1}/{rounds}: " + ", ".join(f"{b} {rates[b]:,.0f} tok/s" for b in BACKENDS), flush=True)
    finally:
        for run in runs:
            run.close()
    ratios = [rates["xla"] / rates["eager"] for rates in per_round]
    return {"executors": executors, "parameters": params, "steps": steps, "batch": batch, "rounds": per_round,
            "tokens_per_s": {b: statistics.median(r[b] for r in per_round) for b in BACKENDS},
            "ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick_and_json(parser, "third_party", quick_help="2 rounds of 10 steps")
    parser.add_argument("--executors", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="steps per timed window")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    steps, rounds = (10, 2) if args.quick else (args.steps, args.rounds)
    result = measure(args.executors, steps, rounds, args.batch, args.warmup)
    print_table(["model", "N", "xla tok/s", "eager tok/s", "xla / eager (median, range)"],
                [[f"nanoGPT-style, {result['parameters']:,} parameters", result["executors"],
                  f"{result['tokens_per_s']['xla']:,.0f}", f"{result['tokens_per_s']['eager']:,.0f}",
                  f"{result['ratio_median']:.2f} ({result['ratio_range'][0]:.2f}-{result['ratio_range'][1]:.2f})"]])
    print(f"target xla / eager >= 1.0: {'met' if result['ratio_median'] >= 1.0 else 'missed'}")
    print("written to", write_results("third_party", result, args.json))


if __name__ == "__main__":
    main()
