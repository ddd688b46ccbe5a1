"""What bounding the client's run-ahead costs: the default bound against none, side by side.

Two contexts of N executors each stay up for the whole run: one with the defaults
(``max_inflight=256`` calls, ``max_inflight_steps=2``), one effectively unbounded
(10**9 of each: how the runtime ran before the bound existed). Each round times, on
both, back to back and in a rotating order: the dispatch modes of `bench/dispatch.py`
(OpByOp, Chained, Fused, Chained pipelined; eager executors, a scalar all-reduce + add
per computation) and a window of training steps of `bench/train.py`'s Transformer
(DataParallel, eager, dispatched back to back, the last loss awaited), and a window of
unawaited tiny calls (``x + 1``, results dropped: where the bound bites). Rates are
medians over rounds; ratios (bounded / unbounded) are medians of per-round ratios. The
target: every awaited or pipelined mode within 3 %.

    .venv/bin/python -m bench.runahead [--sizes 2] [--rounds 5] [--steps 200] [--repeats 4] [--train-steps 30]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import types

import torch

import pathways_torch as pw
from bench.common import print_table, write_results
from bench.dispatch import MODES, PathwaysLoops
from bench.train import loss_fn, make_batches, make_config, make_model, tokens_per_s

UNBOUNDED = {"max_inflight": 10**9, "max_inflight_steps": 10**9}
SETTINGS = {"bounded": {}, "unbounded": UNBOUNDED}


class Setting:
    """One context: the dispatch loops, a tiny function and a trainer on its executors, warmed up."""

    def __init__(self, size: int, options: dict, args, stack: contextlib.ExitStack):
        self.ctx = ctx = stack.enter_context(pw.Context(num_executors=size, backend="eager", **options))
        self.loops = PathwaysLoops(ctx, size)
        mesh = self.loops.x.mesh
        self.add_one = pw.function(lambda x: x + 1, name="add_one")
        self.x = ctx.put(torch.zeros(4), mesh, [pw.Replicate()])
        self.add_one(self.x).result(60)
        self.train_args = types.SimpleNamespace(warmup=3, steps=args.train_steps, repeats=args.rounds, batch=64,
                                                width=64, depth=2)
        self.cfg = make_config(self.train_args)
        self.batches = make_batches(self.cfg, self.train_args)
        model, optimizer = make_model(self.cfg)
        self.trainer = ctx.wrap(model, optimizer=optimizer, loss_fn=loss_fn, mesh=mesh)
        for batch in self.batches[:self.train_args.warmup]:
            self.trainer.step(batch).result(120)
        self.next_batch = self.train_args.warmup

    def train_window(self) -> float:
        """Tokens per second over ``--train-steps`` steps dispatched back to back, the last loss awaited."""
        began = time.perf_counter()
        for _ in range(self.train_args.steps):
            loss = self.trainer.step(self.batches[self.next_batch])
            self.next_batch += 1
        loss.result(300)
        return tokens_per_s(self.train_args, self.cfg, time.perf_counter() - began)

    def unawaited(self, count: int) -> float:
        """Tiny calls per second, none awaited (the last one's completion ends the window)."""
        began = time.perf_counter()
        for _ in range(count - 1):
            self.add_one(self.x)
        self.add_one(self.x).exception(timeout_s=300)
        return count / (time.perf_counter() - began)

    def windows(self, args) -> list[tuple[str, callable]]:
        return ([(mode, lambda m=mode: self.loops.window(m, args.steps if m == "OpByOp" else args.repeats))
                 for mode in MODES]
                + [("train tokens", self.train_window),
                   ("unawaited calls", lambda: self.unawaited(args.unawaited))])


def measure(size: int, args) -> dict:
    with contextlib.ExitStack() as stack:
        settings = {name: Setting(size, options, args, stack) for name, options in SETTINGS.items()}
        rounds = []
        for index in range(args.rounds):
            windows = [(f"{kind} {name}", fn) for name, s in settings.items() for kind, fn in s.windows(args)]
            shift = (index * 3) % len(windows)
            rates = {key: fn() for key, fn in windows[shift:] + windows[:shift]}
            rounds.append(rates)
            print(f"N={size} round {index + 1}/{args.rounds}: "
                  + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(rates.items())), flush=True)
        waits = {name: len(s.ctx.controller.runahead_waits) for name, s in settings.items()}
    kinds = [*MODES, "train tokens", "unawaited calls"]
    result = {"executors": size, "rounds": rounds, "runahead_waits": waits, "kinds": {}}
    for kind in kinds:
        ratios = [r[f"{kind} bounded"] / r[f"{kind} unbounded"] for r in rounds]
        result["kinds"][kind] = {
            "bounded": statistics.median(r[f"{kind} bounded"] for r in rounds),
            "unbounded": statistics.median(r[f"{kind} unbounded"] for r in rounds),
            "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2", help="comma-separated executor counts")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200, help="OpByOp computations per window")
    parser.add_argument("--repeats", type=int, default=4, help="Chained / Fused calls per window")
    parser.add_argument("--train-steps", type=int, default=30, help="training steps per window")
    parser.add_argument("--unawaited", type=int, default=5000, help="unawaited tiny calls per window")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [measure(int(size), args) for size in args.sizes.split(",")]
    rows = []
    for r in results:
        for kind, v in r["kinds"].items():
            unit = "tokens/s" if kind == "train tokens" else "/s"
            ratio = v["ratio"]
            rows.append([r["executors"], kind, f"{v['bounded']:,.0f} {unit}", f"{v['unbounded']:,.0f} {unit}",
                         f"{ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})"])
    print()
    print_table(["N", "what", "bounded (defaults)", "unbounded", "bounded / unbounded"], rows)
    for r in results:
        print(f"N={r['executors']}: run-ahead waits recorded {r['runahead_waits']}")
        for kind in [*MODES, "train tokens"]:
            ratio = r["kinds"][kind]["ratio"]["median"]
            print(f"target N={r['executors']} {kind} within 3 %: {'met' if ratio >= 0.97 else 'NOT met'} ({ratio:.3f})")
    print("written to", write_results("runahead", {"results": results, "args": vars(args)}))


if __name__ == "__main__":
    main()
