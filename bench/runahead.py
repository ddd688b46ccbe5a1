"""What bounding the client's run-ahead costs: the default bound against none, side by side.

One context of N executors stays up for the whole run, switched between two settings
window by window: the defaults (``max_inflight=256`` calls, ``max_inflight_steps=16``) and
effectively unbounded (10**9 of each: how the runtime ran before the bound existed). One
context, not two: two contexts differ by several percent with the same settings (an A/A
run measured 0.93), which would hide a 3 % effect. Each round times, under both settings,
back to back: the dispatch modes of `bench/dispatch.py`
(OpByOp, Chained, Fused, Chained pipelined; eager executors, a scalar all-reduce + add
per computation), a window of training steps of `bench/train.py`'s Transformer
(DataParallel, eager, dispatched back to back, the last loss awaited), and a window of
unawaited tiny calls (``x + 1``, results dropped: where the bound bites). Each kind's
two windows run back to back, bounded first in even rounds and second in odd ones. Rates
are medians over rounds; ratios (bounded / unbounded) are medians of per-round ratios. The
target: every awaited or pipelined mode within 3 %.

    .venv/bin/python -m bench.runahead [--sizes 2] [--rounds 5] [--steps 200] [--repeats 4] [--train-steps 30]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import statistics
import time
import types

import torch

import pathways_torch as pw
from bench.common import add_run_arguments, print_table, write_results
from bench.dispatch import MODES, PathwaysLoops
from bench.train_setup import loss_fn, make_batches, make_config, make_model, tokens_per_s
from tests.handles import controller_of

UNBOUNDED = {"max_inflight": 10**9, "max_inflight_steps": 10**9}


class Setting:
    """One context: the dispatch loops, a tiny function and a trainer on its executors, warmed up."""

    def __init__(self, size: int, args, stack: contextlib.ExitStack):
        self.ctx = ctx = stack.enter_context(pw.Context(num_executors=size, backend="eager"))
        self.defaults = ctx.config
        self.loops = PathwaysLoops(ctx, size)
        mesh = self.loops.x.mesh
        self.add_one = pw.function(lambda x: x + 1, name="add_one")
        self.x = ctx.put(torch.zeros(4), mesh, [pw.Replicate()])
        self.add_one(self.x).result(60)
        self.train_args = types.SimpleNamespace(warmup=3, steps=args.train_steps, repeats=2 * args.rounds, batch=64,
                                                width=64, depth=2)
        self.cfg = make_config(self.train_args)
        self.batches = make_batches(self.cfg, self.train_args)
        model, optimizer = make_model(self.cfg)
        self.trainer = ctx.wrap(model, optimizer=optimizer, loss_fn=loss_fn, mesh=mesh)
        for batch in self.batches[:self.train_args.warmup]:
            self.trainer.step(batch).result(120)
        self.next_batch = self.train_args.warmup

    def use(self, options: dict) -> None:
        """Switch the bound between windows (nothing is in flight then): the trainer reads
        ``ctx.config.max_inflight_steps`` at each step, the controller its ``max_inflight_calls`` at each call."""
        config = dataclasses.replace(self.defaults, **options)
        self.ctx.config = config
        controller_of(self.ctx).config = dataclasses.replace(controller_of(self.ctx).config,
                                                         max_inflight_calls=config.max_inflight)

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


KINDS = (*MODES, "train tokens", "unawaited calls")


def measure(size: int, args) -> dict:
    kinds = [k.strip() for k in args.kinds.split(",")]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise SystemExit(f"--kinds: expected names from {KINDS}, got {unknown}")
    bounded = {} if args.max_inflight_steps is None else {"max_inflight_steps": args.max_inflight_steps}
    settings = {"bounded": bounded, "unbounded": UNBOUNDED}
    with contextlib.ExitStack() as stack:
        setting = Setting(size, args, stack)

        def under(options, fn):
            def run():
                setting.use(options)
                gc.collect()     # each window starts from the same garbage: none
                return fn()
            return run

        rounds = []
        for index in range(args.rounds):
            # Each kind's two windows back to back, in the other order every other round: neither setting
            # always comes first after a switch of kind (the window after a switch runs slower).
            order = list(settings.items()) if index % 2 == 0 else list(settings.items())[::-1]
            windows = [(f"{kind} {name}", under(options, fn)) for kind, fn in setting.windows(args)
                       if kind in kinds for name, options in order]
            rates = {key: fn() for key, fn in windows}
            rounds.append(rates)
            print(f"N={size} round {index + 1}/{args.rounds}: "
                  + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(rates.items())), flush=True)
        waits = len(controller_of(setting.ctx).call_dispatch.run_ahead.waits)
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
    add_run_arguments(parser, sizes="2", steps=200, repeats=4, steps_help="OpByOp computations per window",
                      repeats_help="Chained / Fused calls per window")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--train-steps", type=int, default=30, help="training steps per window")
    parser.add_argument("--unawaited", type=int, default=5000, help="unawaited tiny calls per window")
    parser.add_argument("--kinds", default=",".join(KINDS), help="what to time, comma-separated")
    parser.add_argument("--max-inflight-steps", type=int, default=None,
                        help="the bounded context's max_inflight_steps (default: pw.Context's default)")
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
        print(f"N={r['executors']}: run-ahead waits recorded (bounded windows): {r['runahead_waits']}")
        for kind in [k for k in r["kinds"] if k != "unawaited calls"]:
            ratio = r["kinds"][kind]["ratio"]["median"]
            print(f"target N={r['executors']} {kind} within 3 %: {'met' if ratio >= 0.97 else 'NOT met'} ({ratio:.3f})")
    print("written to", write_results("runahead", {"results": results, "args": vars(args)}))


if __name__ == "__main__":
    main()
