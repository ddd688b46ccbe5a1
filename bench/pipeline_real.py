"""bench/pipeline.py, part 1: the Transformer trained by DataParallel and by each pipeline schedule on the same two
real executors, windows interleaved; tokens/s, the executors' busy share, and each stage's peak activation bytes."""

from __future__ import annotations

import gc
import os
import tempfile
import time

import pathways_torch as pw
from bench.common import median, print_table, rotated
from bench.pipeline_analysis import activation_peaks, virtual_stages
from bench.train_setup import ReverseTask, loss_fn, make_config, make_model
from pathways_torch.observe.span_math import busy_in_windows, complete_events

PLANS = ("DataParallel", "gpipe", "1f1b", "interleaved")
SEED = 0
SETTLE_S = 0.05        # a pause before each window: the previous window's trailing frees are done


def _fmt_bytes(value) -> str:
    return "n/a (not reported)" if value is None else f"{value:,}"


def make_plan(name: str, microbatches: int):
    """(plan, mesh axes) of one of `PLANS` on 2 executors."""
    if name == "DataParallel":
        return pw.DataParallel("data"), {"data": 2}
    return pw.Pipeline(microbatches=microbatches, schedule=name, virtual_stages=virtual_stages(name)), {"pipe": 2}


class PlanRun:
    """One trainer kept alive between its timed windows."""

    def __init__(self, ctx, name: str, args, cfg, batches):
        self.name, self.args, self.cfg, self.batches = name, args, cfg, batches
        model, optimizer = make_model(cfg)
        plan, axes = make_plan(name, args.microbatches)
        self.trainer = ctx.wrap(model, optimizer=optimizer, loss_fn=loss_fn, mesh=ctx.mesh(axes), plan=plan)
        self.index, self.windows, self.tokens_per_s, self.wall_spans = 0, [], [], []
        began = time.perf_counter()
        self.step()
        self.first_step_s = time.perf_counter() - began
        for _ in range(1, args.warmup):
            self.step()

    def stage_executors(self) -> list[list[str]]:
        """The executors of each pipe rank (a pipeline's stage meshes)."""
        return [list(m.executor_ids) for m in self.trainer.runner.stage_meshes]

    def step(self) -> float:
        """One step, waited for; returns its loss."""
        loss = self.trainer.step(self.batches[self.index])
        self.index += 1
        return loss.result(600).item()

    def window(self) -> float:
        """``--steps`` steps dispatched back to back, the last loss waited for; returns tokens per second."""
        time.sleep(SETTLE_S)
        wall_began, began = time.time(), time.perf_counter()
        for _ in range(self.args.steps):
            loss = self.trainer.step(self.batches[self.index])
            self.index += 1
        self.last_loss = loss.result(600).item()
        wall = time.perf_counter() - began
        self.wall_spans.append((wall_began, time.time()))
        del loss
        rate = self.args.steps * self.args.batch * self.cfg.context / wall
        self.windows.append(wall)
        self.tokens_per_s.append(rate)
        return rate


def measure_real(args) -> dict:
    cfg = make_config(args)
    task = ReverseTask(cfg, SEED)
    count = args.warmup + args.rounds * args.steps + args.memory_steps
    batches = [task.batch(i, args.batch) for i in range(count)]
    options = {} if args.backend is None else {"backend": args.backend}
    began = time.perf_counter()
    with pw.Context(num_executors=2, executor_threads=1, pin_executors=True, **options) as ctx:
        start_s = time.perf_counter() - began
        print(f"real executors: context up in {start_s:.1f} s, backend {ctx.backend}", flush=True)
        runs = {}
        for name in PLANS:
            runs[name] = PlanRun(ctx, name, args, cfg, batches)
            print(f"  {name}: first step {runs[name].first_step_s:.1f} s, {args.warmup} warm-up steps done",
                  flush=True)
        rounds = []
        for index in range(args.rounds):
            rates = {}
            for name in rotated(list(PLANS), index):
                gc.collect()
                rates[name] = runs[name].window()
            rounds.append(rates)
            print(f"  round {index + 1}/{args.rounds}: "
                  + ", ".join(f"{n} {rates[n]:,.0f}" for n in PLANS) + " tokens/s", flush=True)
        memory = {}
        for name in PLANS[1:]:
            run, tries = runs[name], []
            for _ in range(args.memory_steps):
                time.sleep(SETTLE_S)
                rest = ctx.stats()["executors"]        # also starts the high-water period
                run.step()
                peak = ctx.stats()["executors"]
                ids = run.stage_executors()
                tries.append({"peaks": activation_peaks(rest, peak, ids),
                              "rest_store_bytes": {e: rest[e]["store_bytes"] for s in ids for e in s},
                              "store_bytes_high_water": {e: peak[e]["store_bytes_high_water"] for s in ids for e in s}})
            reported = [t["peaks"] for t in tries if t["peaks"] is not None]
            memory[name] = {"stage_executors": run.stage_executors(), "tries": tries,
                            "peak_activation_bytes": ([max(p[s] for p in reported) for s in range(len(reported[0]))]
                                                      if reported else None)}
        backend = ctx.backend
        with tempfile.TemporaryDirectory() as scratch:
            trace = ctx.trace(os.path.join(args.trace_dir or scratch, "bench-pipeline-real.json"))
        spans = [(e["pid"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in complete_events(trace["traceEvents"])]
        executor_ids = list(ctx.executor_ids)
        profiles = {}
        for name in PLANS:
            profile = busy_in_windows(spans, runs[name].wall_spans)
            steps = len(runs[name].wall_spans) * args.steps
            profiles[name] = {executor_ids[pid]: {"busy_fraction": p.busy_fraction,
                                                  "computations_per_step": len(p.durations_started_inside) / steps}
                              for pid, p in profile.items() if pid < len(executor_ids)}
    plans = {}
    for name in PLANS:
        run = runs[name]
        ratios = [r[name] / r["DataParallel"] for r in rounds]
        plans[name] = {"tokens_per_s": median(run.tokens_per_s), "windows_s": run.windows,
                       "ms_per_step": median(run.windows) / args.steps * 1000, "first_step_s": run.first_step_s,
                       "last_loss": run.last_loss, "executors": profiles[name],
                       "vs_data_parallel": {"median": median(ratios), "min": min(ratios), "max": max(ratios)}}
    num_params = sum(p.numel() for p in make_model(cfg)[0].parameters())
    return {"backend": backend, "context_start_s": start_s, "parameters": num_params,
            "config": {"width": cfg.width, "depth": cfg.depth, "heads": cfg.heads, "length": cfg.length,
                       "vocab": cfg.vocab, "context": cfg.context, "batch": args.batch,
                       "microbatches": args.microbatches, "steps": args.steps, "warmup": args.warmup,
                       "rounds": args.rounds, "tokens_per_step": args.batch * cfg.context},
            "plans": plans, "rounds": rounds, "memory": memory}


def report_real(real: dict, args) -> None:
    c = real["config"]
    print()
    print(f"Training throughput on 2 executors ({real['backend']}, one thread per process, executors pinned), "
          f"tokens/s: median of {c['rounds']} windows of {c['steps']} steps per plan, rounds interleaved; "
          f"vs DataParallel: median (min-max) of the per-round ratios")
    print(f"model: {real['parameters']:,} parameters (width {c['width']}, depth {c['depth']}, heads {c['heads']}), "
          f"context {c['context']}, batch {c['batch']} = {c['tokens_per_step']:,} tokens/step, "
          f"{c['microbatches']} microbatches of {c['batch'] // c['microbatches']} rows in the pipelines")
    rows = []
    for name in PLANS:
        p, mesh = real["plans"][name], '{"data": 2}' if name == "DataParallel" else '{"pipe": 2}'
        ratio = p["vs_data_parallel"]
        plan = ("pw.DataParallel" if name == "DataParallel" else
                f"pw.Pipeline({name}, M={c['microbatches']}, V={virtual_stages(name)})")
        executors = sorted(p["executors"])
        rows.append([plan, mesh, f"{p['tokens_per_s']:,.0f}",
                     f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})", f"{p['ms_per_step']:.1f}",
                     " / ".join(f"{p['executors'][e]['busy_fraction']:.0%}" for e in executors),
                     " / ".join(f"{p['executors'][e]['computations_per_step']:.0f}" for e in executors),
                     f"{p['first_step_s']:.1f}", f"{p['last_loss']:.5f}"])
    print_table(["plan", "mesh", "tokens/s", "vs DataParallel", "ms/step", "executor-0 / -1 busy",
                 "computations/step per executor", "first step s", "last loss"], rows)
    losses = [p["last_loss"] for p in real["plans"].values()]
    print(f"last losses: same weights, batches and step count, max spread {max(losses) - min(losses):.1e}")
    print(f"notes: 'busy' = share of the plan's timed windows the executor spent in compute spans (ctx.trace); "
          f"this machine has {os.cpu_count()} cores for the 2 executors and the client; 'first step' includes "
          f"capture, loading and compiling (the pipelines' chunk functions may hit the compile cache of an earlier "
          f"plan's).")
    print()
    print("Peak activation bytes per stage (store high-water during one step - store bytes at rest; max over "
          f"{args.memory_steps} steps)")
    mrows = []
    one = real["memory"].get("1f1b", {}).get("peak_activation_bytes")
    for name, m in real["memory"].items():
        peaks = m["peak_activation_bytes"]
        stages = peaks if peaks is not None else [None] * len(m["stage_executors"])
        vs = ("-" if peaks is None or one is None else
              " / ".join(f"{a / b:.2f}" if b else "-" for a, b in zip(peaks, one)))
        mrows.append([name, *[f"{_fmt_bytes(v)} ({'/'.join(ids)})" for v, ids in zip(stages, m["stage_executors"])],
                      vs])
    print_table(["schedule", "stage 0 (executor)", "stage 1 (executor)", "vs 1f1b per stage"], mrows)
    if one is None:
        print("store_bytes_high_water reads 0 on every executor: the executors do not report it yet")
