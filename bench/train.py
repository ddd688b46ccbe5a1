"""Training throughput: the runtime's data-parallel Transformer step vs torchrun-style DDP vs one eager process.

The same training step everywhere: the example decoder-only Transformer
(`examples/transformer.py`, reversal task, dropout 0), the same initial weights
(``torch.manual_seed``), AdamW(lr=1e-3), ``loss_fn``, the same global batches
(``ReverseTask(cfg, seed).batch(i, B)``), the eager compute backend and one
compute thread per process (``torch.set_num_threads(1)``; executors run with
``executor_threads=1``). Metric: tokens per second = steps x global batch x context
(context = 2 x length) / wall time; each configuration runs ``--warmup`` steps
(waited for), then ``--repeats`` windows of ``--steps`` steps; the median window counts.

1. runtime: ``pw.Context(num_executors=N, backend="eager", executor_threads=1)``, mesh
   ``{"data": N}``, ``ctx.wrap(..., plan=pw.DataParallel("data"))``. A window dispatches
   its steps back to back (``trainer.step`` returns the loss as a future at once) and
   waits only on the last loss. The executors' compute spans (``ctx.trace``) give
   their time per step and how busy they were during the windows; CPU time per step
   of the client process and of each executor (``/proc/<pid>/stat``) shows where the
   cores went (the same for every DDP rank and the eager process).
2. DDP: N spawned processes, each a gloo group from a FileStore in a private
   temporary directory, loopback only (`make_gloo_group`, as the executors and
   `bench/dispatch.py`'s baseline make theirs), `DistributedDataParallel`, B/N rows
   of every batch per rank; rank 0's time (`bench/ddp_train_baseline.py`).
3. eager: one process (this one), the whole global batch, ordinary
   ``zero_grad / backward / step``.
4. XLA: the runtime with ``backend="xla"`` vs ``backend="eager"`` (compile excluded by the warm-up).
5. Memory at the largest N, for ``pw.DataParallel`` and ``pw.ShardedDataParallel``: each
   executor's peak resident set (``VmHWM`` of ``/proc/<pid>/status``, just after start
   and after the steps) and the bytes its object store holds after the steps
   (``ctx.stats()``); DDP ranks' VmHWM for reference.

The last step's loss of every configuration is printed: same data, weights and
optimizer, so they agree to float rounding (a like-with-like check).
Prints tables and writes bench/results/train.json.

    .venv/bin/python bench/train.py [--sizes 1,2,4] [--width 64] [--depth 2] [--batch 64]
                                    [--steps 30] [--warmup 3] [--repeats 5] [--xla-sizes 1,2 | --no-xla]
                                    [--no-memory] [--trace-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (_ROOT, os.path.join(_ROOT, "examples")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

import pathways_torch as pw  # noqa: E402
from bench.common import print_table, write_results  # noqa: E402
from bench.ddp_train_baseline import process_cpu_s, run_ddp, status_field  # noqa: E402
from transformer import DecoderOnlyTransformer, ReverseTask, TransformerConfig, loss_fn  # noqa: E402

LR = 1e-3
SEED = 0


# ------------------------------------------------------------ set-up shared by every configuration

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


# ------------------------------------------------------------ 1, 4, 5: the runtime

def measure_runtime(size: int, backend: str, plan_name: str, args, cfg, batches) -> dict:
    model, optimizer = make_model(cfg)
    plan = pw.DataParallel("data") if plan_name == "DataParallel" else pw.ShardedDataParallel("data")
    with pw.Context(num_executors=size, backend=backend, executor_threads=1) as ctx:
        pids = ctx.executor_pids
        hwm_start = [status_field(pid, "VmHWM") for pid in pids]
        mesh = ctx.mesh({"data": size})
        trainer = ctx.wrap(model, optimizer=optimizer, loss_fn=loss_fn, mesh=mesh, plan=plan)
        began = time.perf_counter()
        first = trainer.step(batches[0])
        first.result()
        first_step_s = time.perf_counter() - began
        del first
        for i in range(1, args.warmup):
            loss = trainer.step(batches[i])
        if args.warmup > 1:
            loss.result()
        index, windows, wall_spans = args.warmup, [], []
        client_cpu, executor_cpu = time.process_time(), [process_cpu_s(pid) for pid in pids]
        for _ in range(args.repeats):
            wall_began, began = time.time(), time.perf_counter()
            for _ in range(args.steps):
                loss = trainer.step(batches[index])
                index += 1
            last_loss = loss.result().item()
            windows.append(time.perf_counter() - began)
            wall_spans.append((wall_began, time.time()))
        client_cpu = time.process_time() - client_cpu
        executor_cpu = [_delta(process_cpu_s(pid), before) for pid, before in zip(pids, executor_cpu)]
        threads = [status_field(pid, "Threads") for pid in pids]
        del loss
        stats = ctx.stats()["executors"]
        store_bytes = [stats[e]["store_bytes"] for e in ctx.executor_ids]
        hwm_end = [status_field(pid, "VmHWM") for pid in pids]
        trace_path = os.path.join(args.trace_dir or tempfile.gettempdir(),
                                  f"bench-train-{backend}-{plan_name}-n{size}.json")
        compute = _compute_profile(ctx.trace(trace_path), trainer._function.name, size, wall_spans)
        if not args.trace_dir:
            os.remove(trace_path)
    median_window = statistics.median(windows)
    return {"system": "runtime", "backend": backend, "plan": plan_name, "executors": size,
            "tokens_per_s": tokens_per_s(args, cfg, median_window), "windows_s": windows,
            "ms_per_step": median_window / args.steps * 1000, "first_step_s": first_step_s,
            "last_loss": last_loss, "pids": pids, "vmhwm_start_kib": hwm_start, "vmhwm_kib": hwm_end,
            "store_bytes": store_bytes, **compute, "threads": threads,
            **_cpu_summary(client_cpu, executor_cpu, sum(windows), args.repeats * args.steps),
            "trace": trace_path if args.trace_dir else None}


def _delta(after, before):
    return None if after is None or before is None else after - before


def _cpu_summary(client_cpu_s: float | None, worker_cpu_s: list, wall_s: float, steps: int) -> dict:
    """CPU time per step (ms) of the client and of each worker, and each worker's CPU time / wall time."""
    per_step = [None if c is None else c / steps * 1000 for c in worker_cpu_s]
    total = sum(c for c in per_step if c is not None) + (client_cpu_s / steps * 1000 if client_cpu_s else 0.0)
    return {"client_cpu_ms_per_step": None if client_cpu_s is None else client_cpu_s / steps * 1000,
            "worker_cpu_ms_per_step": per_step, "total_cpu_ms_per_step": total,
            "worker_cpu_per_wall": [None if c is None else c / wall_s for c in worker_cpu_s]}


def _compute_profile(trace: dict, name: str, size: int, wall_spans: list[tuple[float, float]]) -> dict:
    """Per executor: median compute ms of a step in the timed windows, and the share of the windows spent computing."""
    windows_us = [(a * 1e6, b * 1e6) for a, b in wall_spans]
    total_us = sum(b - a for a, b in windows_us)
    per_exec: dict[int, list] = {i: [] for i in range(size)}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") == "compute" and e.get("name") == name and e.get("pid") in per_exec:
            per_exec[e["pid"]].append((e["ts"], e["ts"] + e["dur"]))
    compute_ms, busy = [], []
    for i in range(size):
        inside = [(s, t) for s, t in per_exec[i] if any(a <= s < b for a, b in windows_us)]
        compute_ms.append(statistics.median([(t - s) / 1000 for s, t in inside]) if inside else None)
        overlap = sum(max(0.0, min(t, b) - max(s, a)) for s, t in per_exec[i] for a, b in windows_us)
        busy.append(overlap / total_us if total_us else None)
    return {"compute_ms_per_step": compute_ms, "busy_fraction": busy}


# ------------------------------------------------------------ 2: DDP, 3: one eager process

def measure_ddp(size: int, args, cfg) -> dict:
    spec = {"config": {"vocab": cfg.vocab, "length": cfg.length, "width": cfg.width, "depth": cfg.depth,
                       "heads": cfg.heads, "dropout": cfg.dropout},
            "seed": SEED, "lr": LR, "batch": args.batch, "warmup": args.warmup, "steps": args.steps,
            "repeats": args.repeats}
    ranks = run_ddp(size, spec)
    windows = ranks[0]["windows_s"]
    median_window = statistics.median(windows)
    cpu = _cpu_summary(None, [r["cpu_s"] for r in ranks], sum(windows), args.repeats * args.steps)
    return {"system": "ddp", "executors": size, "tokens_per_s": tokens_per_s(args, cfg, median_window), **cpu,
            "windows_s": windows, "ms_per_step": median_window / args.steps * 1000,
            "last_loss": ranks[0]["last_loss"], "vmhwm_kib": [r["vmhwm_kib"] for r in ranks],
            "windows_s_by_rank": [r["windows_s"] for r in ranks]}


def measure_eager(args, cfg, batches) -> dict:
    model, optimizer = make_model(cfg)

    def one_step(inputs, targets):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        return loss

    for i in range(args.warmup):
        one_step(*batches[i])
    index, windows = args.warmup, []
    cpu_began = time.process_time()
    for _ in range(args.repeats):
        began = time.perf_counter()
        for _ in range(args.steps):
            loss = one_step(*batches[index])
            index += 1
        windows.append(time.perf_counter() - began)
    median_window = statistics.median(windows)
    return {"system": "eager", "executors": 1, "tokens_per_s": tokens_per_s(args, cfg, median_window),
            "windows_s": windows, "ms_per_step": median_window / args.steps * 1000, "last_loss": loss.item(),
            **_cpu_summary(None, [time.process_time() - cpu_began], sum(windows), args.repeats * args.steps)}


# ------------------------------------------------------------ report

def _ints(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def _fmt_list(values, fmt: str) -> str:
    return "/".join("-" if v is None else format(v, fmt) for v in values)


def _mib(kib) -> str:
    return "-" if kib is None else f"{kib / 1024:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4", help="executor / DDP process counts")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="global batch (rows); must divide by every size")
    parser.add_argument("--steps", type=int, default=30, help="steps per timed window")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (waited for)")
    parser.add_argument("--repeats", type=int, default=5, help="timed windows; the median counts")
    parser.add_argument("--xla-sizes", default="1,2", help="runtime sizes to run with backend='xla' too")
    parser.add_argument("--no-xla", action="store_true", help="skip the XLA comparison")
    parser.add_argument("--no-memory", action="store_true", help="skip the ShardedDataParallel memory run")
    parser.add_argument("--trace-dir", default=None, help="keep each runtime run's Chrome trace here")
    args = parser.parse_args()
    sizes = _ints(args.sizes)
    xla_sizes = [] if args.no_xla else _ints(args.xla_sizes)
    bad = [n for n in sorted(set(sizes + xla_sizes)) if args.batch % n]
    if bad:
        parser.error(f"--batch {args.batch} does not divide by executor count(s) {bad}")
    if args.warmup < 1:
        parser.error("--warmup: at least 1 (the first step loads the function; XLA compiles it)")
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)

    torch.set_num_threads(1)
    started = time.perf_counter()
    cfg = make_config(args)
    batches = make_batches(cfg, args)
    num_params = sum(p.numel() for p in make_model(cfg)[0].parameters())
    print(f"model: {num_params:,} parameters (width {cfg.width}, depth {cfg.depth}, heads {cfg.heads}), context "
          f"{cfg.context}, global batch {args.batch} = {args.batch * cfg.context:,} tokens/step; "
          f"{args.warmup} warm-up + {args.repeats} x {args.steps} timed steps per configuration", flush=True)

    print("eager, one process ...", flush=True)
    eager = measure_eager(args, cfg, batches)
    runtime, ddp, xla = {}, {}, {}
    for size in sizes:
        print(f"N={size}: runtime (eager) ...", flush=True)
        runtime[size] = measure_runtime(size, "eager", "DataParallel", args, cfg, batches)
        print(f"N={size}: DDP ...", flush=True)
        ddp[size] = measure_ddp(size, args, cfg)
    for size in xla_sizes:
        print(f"N={size}: runtime (xla) ...", flush=True)
        xla[size] = measure_runtime(size, "xla", "DataParallel", args, cfg, batches)
    memory = {}
    if sizes and not args.no_memory:
        largest = max(sizes)
        memory["DataParallel"] = runtime[largest]
        print(f"N={largest}: runtime (eager), ShardedDataParallel ...", flush=True)
        memory["ShardedDataParallel"] = measure_runtime(largest, "eager", "ShardedDataParallel", args, cfg, batches)

    cores = os.cpu_count() or 1
    print()
    print(f"Training throughput, tokens/s (median of {args.repeats} windows of {args.steps} steps; "
          f"eager compute, 1 thread/process)")
    table = []
    for size in sizes:
        rt, dd = runtime[size], ddp[size]
        rt["vs_ddp"] = rt["tokens_per_s"] / dd["tokens_per_s"]
        rt["vs_eager"] = rt["tokens_per_s"] / eager["tokens_per_s"]
        dd["vs_eager"] = dd["tokens_per_s"] / eager["tokens_per_s"]
        if size > cores:
            note = f"oversubscribed: {size} processes on {cores} cores (+ the runtime's client)"
        elif size + 1 > cores:
            note = f"the runtime's client shares the {cores} cores with its {size} executors"
        else:
            note = ""
        table.append([size, f"{rt['tokens_per_s']:,.0f}", f"{dd['tokens_per_s']:,.0f}", f"{eager['tokens_per_s']:,.0f}",
                      f"{rt['vs_ddp']:.2f}", f"{rt['vs_eager']:.2f}", f"{dd['vs_eager']:.2f}",
                      f"{rt['ms_per_step']:.1f} / {dd['ms_per_step']:.1f}",
                      f"{rt['client_cpu_ms_per_step']:.1f} + {_fmt_list(rt['worker_cpu_ms_per_step'], '.0f')} / "
                      f"{_fmt_list(dd['worker_cpu_ms_per_step'], '.0f')}",
                      _fmt_list(rt["compute_ms_per_step"], ".1f"), _fmt_list(rt["busy_fraction"], ".0%"), note])
    print_table(["N", "runtime", "DDP", "eager 1-proc", "runtime/DDP", "runtime/eager", "DDP/eager",
                 "ms/step rt / DDP", "CPU ms/step rt client + executors / DDP ranks", "rt exec compute ms/step",
                 "rt exec busy", "note"], table)
    print(f"target runtime/DDP >= 0.95: " + ", ".join(
        f"N={n} {'met' if runtime[n]['vs_ddp'] >= 0.95 else 'NOT met'}" for n in sizes))
    losses = [eager["last_loss"]] + [r["last_loss"] for r in (*runtime.values(), *ddp.values(), *xla.values())]
    print(f"last-step loss: eager {eager['last_loss']:.5f}; runtime " +
          ", ".join(f"N={n} {runtime[n]['last_loss']:.5f}" for n in sizes) + "; DDP " +
          ", ".join(f"N={n} {ddp[n]['last_loss']:.5f}" for n in sizes) +
          (("; xla " + ", ".join(f"N={n} {xla[n]['last_loss']:.5f}" for n in xla_sizes)) if xla else "") +
          f" (max spread {max(losses) - min(losses):.1e})")
    print("notes: 'CPU ms/step' = CPU time (user+system, every thread) per step of the runtime's client "
          "process (controller included) and of each executor, and of each DDP rank; 'rt exec compute ms/step' = "
          "median compute span of the step on each executor (ctx.trace, collectives included); 'rt exec busy' = "
          "share of the timed windows each executor spent in those spans. "
          f"This machine has {cores} cores: sizes whose processes outnumber them time-share the cores "
          "(the runtime also has its client+controller process), so N above the core count measures "
          "contention, not scaling.")

    if xla:
        print()
        print("Executor backend: the runtime with backend='xla' vs 'eager' (compile excluded by the warm-up)")
        xtable = []
        for size in xla_sizes:
            x = xla[size]
            base = runtime.get(size)
            x["vs_eager_runtime"] = x["tokens_per_s"] / base["tokens_per_s"] if base else None
            xtable.append([size, f"{x['tokens_per_s']:,.0f}", f"{base['tokens_per_s']:,.0f}" if base else "not run",
                           f"{x['vs_eager_runtime']:.2f}" if base else "-", f"{x['first_step_s']:.1f}",
                           f"{base['first_step_s']:.1f}" if base else "-",
                           _fmt_list(x["compute_ms_per_step"], ".1f"),
                           _fmt_list(base["compute_ms_per_step"], ".1f") if base else "-",
                           _fmt_list(x["worker_cpu_per_wall"], ".2f"),
                           _fmt_list(base["worker_cpu_per_wall"], ".2f") if base else "-",
                           _fmt_list(x["threads"], "d")])
        print_table(["N", "xla tokens/s", "eager tokens/s", "xla/eager", "xla first step s", "eager first step s",
                     "xla compute ms/step", "eager compute ms/step", "xla exec CPU/wall", "eager exec CPU/wall",
                     "xla exec threads"], xtable)
        print("notes: 'exec CPU/wall' = an executor's CPU seconds per wall second in the timed windows (above 1: "
              "it computes on more than one core); 'first step' includes loading (and for XLA compiling) the step.")

    if memory:
        largest = max(sizes)
        print()
        print(f"Memory per executor at N={largest} (VmHWM = peak resident set; store = object store bytes after "
              f"the steps)")
        mtable = []
        for plan_name, r in memory.items():
            for i, pid in enumerate(r["pids"]):
                mtable.append([plan_name, f"executor-{i}", pid, _mib(r["vmhwm_start_kib"][i]), _mib(r["vmhwm_kib"][i]),
                               f"{r['store_bytes'][i]:,}", f"{r['tokens_per_s']:,.0f}"])
        for rank, kib in enumerate(ddp[largest]["vmhwm_kib"]):
            mtable.append(["DDP (reference)", f"rank {rank}", "-", "-", _mib(kib), "-",
                           f"{ddp[largest]['tokens_per_s']:,.0f}"])
        print_table(["plan", "executor", "pid", "VmHWM at start MiB", "VmHWM after MiB", "store bytes",
                     "tokens/s"], mtable)
        param_bytes = num_params * 4
        print(f"notes: parameters are {param_bytes:,} bytes (fp32); DataParallel stores params + AdamW exp_avg + "
              f"exp_avg_sq = {3 * param_bytes:,} bytes per executor, ShardedDataParallel 1/{largest} of that "
              f"(padded). VmHWM is dominated by the process's torch import; the executors' 'at start' column "
              f"is before the trainer existed.")

    elapsed = time.perf_counter() - started
    path = write_results("train", {
        "config": {"width": cfg.width, "depth": cfg.depth, "heads": cfg.heads, "length": cfg.length,
                   "vocab": cfg.vocab, "context": cfg.context, "batch": args.batch, "steps": args.steps,
                   "warmup": args.warmup, "repeats": args.repeats, "lr": LR, "seed": SEED,
                   "parameters": num_params, "tokens_per_step": args.batch * cfg.context},
        "eager": eager, "runtime": [runtime[n] for n in sizes], "ddp": [ddp[n] for n in sizes],
        "xla": [xla[n] for n in xla_sizes], "memory": {k: {kk: v[kk] for kk in (
            "executors", "pids", "vmhwm_start_kib", "vmhwm_kib", "store_bytes", "tokens_per_s")}
            for k, v in memory.items()},
        "elapsed_s": elapsed})
    print(f"\nwritten to {path} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
