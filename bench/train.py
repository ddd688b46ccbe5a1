"""Training throughput: the runtime's data-parallel Transformer step vs torchrun-style DDP vs one eager process.

The same training step everywhere: the example decoder-only Transformer
(`examples/transformer.py`, reversal task, dropout 0), the same initial weights
(``torch.manual_seed``), AdamW(lr=1e-3), ``loss_fn``, the same global batches
(``ReverseTask(cfg, seed).batch(i, B)``), the eager compute backend and one
compute thread per process (``torch.set_num_threads(1)``; executors run with
``executor_threads=1``). Metric: tokens per second = steps x global batch x context
(context = 2 x length) / wall time of a timed window of ``--steps`` steps.

Windows are interleaved. At each N the runtime (context + trainer), the N DDP
processes and the eager model (in this process) are all started and warmed up
(``--warmup`` steps each, waited for) and stay alive; then come ``--repeats`` rounds,
each a runtime window, a DDP window and an eager window, in that order, one after the
other. Only one system computes at a time: the executors wait in their poll loop,
the DDP ranks block on their command pipe, the eager model is this process's main
thread (a short pause before each window lets the previous one's trailing work
finish). Why: this machine's speed drifts (other tenants; up to 2x over minutes),
so measuring each configuration after the other made runtime/DDP swing from 0.75
to 1.18 between runs. A round's windows are seconds apart, so the ratios
runtime/DDP and runtime/eager are taken per round and their median is reported
(with the min-max spread of runtime/DDP); tokens/s of each system is the median
of its windows. The CPU time the idle systems use during the others' windows is
printed as a check that they are idle.

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
   of every batch per rank; rank 0's time of each window (`bench/ddp_train_baseline.py`,
   `DDPWorkers`: a window per command).
3. eager: one process (this one), the whole global batch, ordinary
   ``zero_grad / backward / step``; a fresh model at every N.
4. XLA: the runtime with the default backend (``backend="xla"``, the installed route) vs
   ``backend="eager"``, both alive at once, windows interleaved round by round (the order
   alternates), every executor of both pinned to one core (executor i on core i mod the core
   count: XLA's CPU runtime ignores ``executor_threads`` and would use every core); the
   ratio is the median of the per-round ratios. Compile is excluded by the warm-up and
   reported as the first step's time.
5. Memory at the largest N, for ``pw.DataParallel``, ``pw.ShardedDataParallel`` (per unit) and its older
   gather-all step (``per_unit=False``): each
   executor's peak resident set (``VmHWM`` of ``/proc/<pid>/status``, just after start
   and after the steps) and the bytes its object store holds after the steps
   (``ctx.stats()``); DDP's and FSDP2's ranks (``fully_shard`` per block, then the root) for reference, the peak
   each adds counted from before its model was built.

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
from bench.common import (add_model_arguments, add_run_arguments, add_trace_dir_argument,  # noqa: E402
                          print_table, process_cpu_s, write_results)
from bench.ddp_train_baseline import DDPWorkers, status_field  # noqa: E402
from bench.fsdp2_train_baseline import fsdp2_memory  # noqa: E402
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

class RuntimeRun:
    """One runtime configuration kept alive between its timed windows: `start`, `window` (x repeats), `finish`."""

    def __init__(self, size: int, backend: str, plan_name: str, args, cfg, batches, pin: bool = False):
        self.size, self.backend, self.plan_name, self.pin = size, backend, plan_name, pin
        self.args, self.cfg, self.batches = args, cfg, batches
        self.ctx = None

    def start(self) -> None:
        """Start the context and the trainer, and run the warm-up steps (waited for)."""
        args, size = self.args, self.size
        model, optimizer = make_model(self.cfg)
        plan = {"DataParallel": pw.DataParallel("data"), "ShardedDataParallel": pw.ShardedDataParallel("data"),
                "ShardedDataParallel (gather-all)": pw.ShardedDataParallel("data", per_unit=False)}[self.plan_name]
        self.ctx = ctx = pw.Context(num_executors=size, backend=self.backend, executor_threads=1,
                                    pin_executors=self.pin)
        self.route = ctx.backend
        self.pids = ctx.executor_pids
        self.hwm_start = [status_field(pid, "VmHWM") for pid in self.pids]
        mesh = ctx.mesh({"data": size})
        self.trainer = ctx.wrap(model, optimizer=optimizer, loss_fn=loss_fn, mesh=mesh, plan=plan)
        began = time.perf_counter()
        first = self.trainer.step(self.batches[0])
        first.result()
        self.first_step_s = time.perf_counter() - began
        del first
        loss = None
        for i in range(1, args.warmup):
            loss = self.trainer.step(self.batches[i])
        if loss is not None:
            loss.result()
        del loss
        self.index, self.windows, self.wall_spans = args.warmup, [], []
        self.client_cpu, self.executor_cpu = 0.0, [0.0] * size
        self._loss = None

    def window(self) -> float:
        """``--steps`` steps dispatched back to back; waits on the last loss only. Returns the wall seconds."""
        pids = self.pids
        client_cpu, executor_cpu = time.process_time(), [process_cpu_s(pid) for pid in pids]
        wall_began, began = time.time(), time.perf_counter()
        for _ in range(self.args.steps):
            self._loss = self.trainer.step(self.batches[self.index])
            self.index += 1
        self.last_loss = self._loss.result().item()
        window = time.perf_counter() - began
        self.wall_spans.append((wall_began, time.time()))
        self.windows.append(window)
        self.client_cpu += time.process_time() - client_cpu
        for i, (pid, before) in enumerate(zip(pids, executor_cpu)):
            used = _delta(process_cpu_s(pid), before)
            self.executor_cpu[i] = None if used is None or self.executor_cpu[i] is None else self.executor_cpu[i] + used
        return window

    def finish(self) -> dict:
        """Collect the executors' threads, store bytes, VmHWM and trace, and close the context."""
        args, ctx, pids, size = self.args, self.ctx, self.pids, self.size
        try:
            threads = [status_field(pid, "Threads") for pid in pids]
            self._loss = None
            stats = ctx.stats()["executors"]
            store_bytes = [stats[e]["store_bytes"] for e in ctx.executor_ids]
            hwm_end = [status_field(pid, "VmHWM") for pid in pids]
            trace_path = os.path.join(args.trace_dir or tempfile.gettempdir(),
                                      f"bench-train-{self.backend}-{self.plan_name}-n{size}.json")
            compute = _compute_profile(ctx.trace(trace_path), self.trainer._function.name, size, self.wall_spans)
            if not args.trace_dir:
                os.remove(trace_path)
        finally:
            self.close()
        windows = self.windows
        median_window = statistics.median(windows)
        return {"system": "runtime", "backend": self.route, "plan": self.plan_name, "executors": size,
                "pinned": self.pin,
                "tokens_per_s": tokens_per_s(args, self.cfg, median_window), "windows_s": windows,
                "ms_per_step": median_window / args.steps * 1000, "first_step_s": self.first_step_s,
                "last_loss": self.last_loss, "pids": pids, "vmhwm_start_kib": self.hwm_start, "vmhwm_kib": hwm_end,
                "store_bytes": store_bytes, **compute, "threads": threads,
                **_cpu_summary(self.client_cpu, self.executor_cpu, sum(windows), len(windows) * args.steps),
                "trace": trace_path if args.trace_dir else None}

    def close(self) -> None:
        if self.ctx is not None:
            self._loss = None
            self.ctx.close()


def measure_runtime(size: int, backend: str, plan_name: str, args, cfg, batches) -> dict:
    """The runtime alone: warm-up, then ``--repeats`` windows back to back (the XLA and memory runs)."""
    run = RuntimeRun(size, backend, plan_name, args, cfg, batches)
    try:
        run.start()
        for _ in range(args.repeats):
            run.window()
        return run.finish()
    finally:
        run.close()


def measure_backends(size: int, args, cfg, batches) -> tuple[dict, dict, dict]:
    """The default backend and eager, both alive, pinned, windows interleaved: (xla, eager, per-round ratios)."""
    runs = {"xla": RuntimeRun(size, args.xla_backend, "DataParallel", args, cfg, batches, pin=True),
            "eager": RuntimeRun(size, "eager", "DataParallel", args, cfg, batches, pin=True)}
    try:
        for run in runs.values():
            run.start()
        ratios = []
        for round_index in range(args.repeats):
            order = ["xla", "eager"] if round_index % 2 == 0 else ["eager", "xla"]
            walls = {}
            for name in order:
                time.sleep(0.2)   # the other run's trailing work ends first
                walls[name] = runs[name].window()
            ratios.append(walls["eager"] / walls["xla"])   # tokens/s ratio xla / eager
        results = {name: run.finish() for name, run in runs.items()}
    finally:
        for run in runs.values():
            run.close()
    summary = {"xla_vs_eager": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": ratios}
    return results["xla"], results["eager"], summary


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

def ddp_spec(args, cfg) -> dict:
    return {"config": {"vocab": cfg.vocab, "length": cfg.length, "width": cfg.width, "depth": cfg.depth,
                       "heads": cfg.heads, "dropout": cfg.dropout},
            "seed": SEED, "lr": LR, "batch": args.batch, "warmup": args.warmup, "steps": args.steps,
            "repeats": args.repeats}


def ddp_result(size: int, args, cfg, windows_by_round: list[list[dict]], final: list[dict]) -> dict:
    """The DDP entry of the results from every window's per-rank reports and the ranks' final reports."""
    by_rank = [[w[r]["window_s"] for w in windows_by_round] for r in range(size)]
    windows = by_rank[0]   # rank 0's time counts
    median_window = statistics.median(windows)
    cpu = _cpu_summary(None, [sum(w[r]["cpu_s"] for w in windows_by_round) for r in range(size)], sum(windows),
                       len(windows) * args.steps)
    return {"system": "ddp", "executors": size, "tokens_per_s": tokens_per_s(args, cfg, median_window), **cpu,
            "windows_s": windows, "ms_per_step": median_window / args.steps * 1000,
            "last_loss": final[0]["last_loss"], "pids": [r["pid"] for r in final],
            "vmhwm_kib": [r["vmhwm_kib"] for r in final], "vmhwm_start_kib": [r.get("vmhwm_start_kib") for r in final],
            "windows_s_by_rank": by_rank}


class EagerRun:
    """One eager process (this one): the whole global batch, ordinary ``zero_grad / backward / step``."""

    def __init__(self, args, cfg, batches):
        self.args, self.cfg, self.batches = args, cfg, batches

    def start(self) -> None:
        self.model, self.optimizer = make_model(self.cfg)
        for i in range(self.args.warmup):
            self._step(*self.batches[i])
        self.index, self.windows, self.cpu_s = self.args.warmup, [], 0.0

    def _step(self, inputs, targets):
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(self.model(inputs), targets)
        loss.backward()
        self.optimizer.step()
        return loss

    def window(self) -> float:
        cpu_began, began = time.process_time(), time.perf_counter()
        for _ in range(self.args.steps):
            loss = self._step(*self.batches[self.index])
            self.index += 1
        window = time.perf_counter() - began
        self.cpu_s += time.process_time() - cpu_began
        self.windows.append(window)
        self.last_loss = loss.item()
        return window

    def finish(self) -> dict:
        args, windows = self.args, self.windows
        median_window = statistics.median(windows)
        return {"system": "eager", "executors": 1, "tokens_per_s": tokens_per_s(args, self.cfg, median_window),
                "windows_s": windows, "ms_per_step": median_window / args.steps * 1000, "last_loss": self.last_loss,
                **_cpu_summary(None, [self.cpu_s], sum(windows), len(windows) * args.steps)}


# ------------------------------------------------------------ 1, 2, 3 side by side

SETTLE_S = 0.05   # a pause before each window, so trailing work of the previous one (releases, GC) is done


def _cpu_snapshot(executor_pids: list[int], ddp_pids: list[int]) -> dict:
    return {"client": time.process_time(), "executors": [process_cpu_s(pid) for pid in executor_pids],
            "ddp": [process_cpu_s(pid) for pid in ddp_pids]}


def _cpu_used(before: dict, after: dict, part: str) -> float:
    if part == "client":
        return after["client"] - before["client"]
    return sum(_delta(a, b) or 0.0 for a, b in zip(after[part], before[part]))


def measure_side_by_side(size: int, args, cfg, batches) -> tuple[dict, dict, dict, dict]:
    """Runtime, DDP and eager at ``size``, all alive and warmed up, in interleaved timed windows.

    Each round: a runtime window, a DDP window, an eager window (one system computes, the
    others wait idle). Returns the runtime, DDP and eager results and the per-round ratios.
    """
    runtime_run = RuntimeRun(size, "eager", "DataParallel", args, cfg, batches)
    try:
        runtime_run.start()
        with DDPWorkers(size, ddp_spec(args, cfg)) as workers:
            workers.start()
            eager_run = EagerRun(args, cfg, batches)
            eager_run.start()
            rounds, ddp_windows = [], []
            idle = {"executors": [0.0, 0.0], "ddp": [0.0, 0.0], "client": [0.0, 0.0]}   # CPU s, wall s

            def timed(window, idle_parts):
                time.sleep(SETTLE_S)
                before = _cpu_snapshot(runtime_run.pids, workers.pids)
                began = time.perf_counter()
                result = window()
                wall = time.perf_counter() - began
                after = _cpu_snapshot(runtime_run.pids, workers.pids)
                for part in idle_parts:
                    idle[part][0] += _cpu_used(before, after, part)
                    idle[part][1] += wall
                return result

            for _ in range(args.repeats):
                runtime_s = timed(runtime_run.window, ["ddp"])
                ranks = timed(workers.window, ["executors", "client"])
                ddp_windows.append(ranks)
                eager_s = timed(eager_run.window, ["executors", "ddp"])
                ddp_s = ranks[0]["window_s"]
                rounds.append({"runtime_s": runtime_s, "ddp_s": ddp_s, "eager_s": eager_s,
                               "runtime_vs_ddp": ddp_s / runtime_s, "runtime_vs_eager": eager_s / runtime_s,
                               "ddp_vs_eager": eager_s / ddp_s})
            final = workers.stop()
        rt = runtime_run.finish()
    finally:
        runtime_run.close()
    dd = ddp_result(size, args, cfg, ddp_windows, final)
    eg = eager_run.finish()
    ratios = {key: statistics.median(r[key] for r in rounds)
              for key in ("runtime_vs_ddp", "runtime_vs_eager", "ddp_vs_eager")}
    spread = [r["runtime_vs_ddp"] for r in rounds]
    ratios.update(runtime_vs_ddp_min=min(spread), runtime_vs_ddp_max=max(spread), rounds=rounds,
                  idle_cpu_ms_per_s={part: cpu / wall * 1000 if wall else None for part, (cpu, wall) in idle.items()})
    return rt, dd, eg, ratios


# ------------------------------------------------------------ report

def _ints(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def _fmt_list(values, fmt: str) -> str:
    return "/".join("-" if v is None else format(v, fmt) for v in values)


def _mib(kib) -> str:
    return "-" if kib is None else f"{kib / 1024:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, sizes="1,2,4", steps=30, repeats=5, sizes_help="executor / DDP process counts",
                      steps_help="steps per timed window",
                      repeats_help="rounds of timed windows (runtime, DDP, eager interleaved); the median counts")
    add_model_arguments(parser, width=64, depth=2, batch=64,
                        batch_help="global batch (rows); must divide by every size")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (waited for)")
    parser.add_argument("--xla-sizes", default="1,2", help="runtime sizes to run with backend='xla' too")
    parser.add_argument("--no-xla", action="store_true", help="skip the XLA comparison")
    parser.add_argument("--xla-backend", default="xla",
                        help="the XLA backend to compare with eager: xla (the installed default route), "
                             "xla:torchax or xla:torch_xla")
    parser.add_argument("--no-memory", action="store_true", help="skip the ShardedDataParallel memory run")
    add_trace_dir_argument(parser, "each runtime run's")
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

    runtime, ddp, eager, ratios, xla, xla_eager, xla_ratios = {}, {}, {}, {}, {}, {}, {}
    for size in sizes:
        print(f"N={size}: runtime (eager), DDP and eager 1-proc, {args.repeats} interleaved rounds ...", flush=True)
        runtime[size], ddp[size], eager[size], ratios[size] = measure_side_by_side(size, args, cfg, batches)
    for size in xla_sizes:
        print(f"N={size}: runtime, default backend vs eager, pinned, {args.repeats} interleaved rounds ...", flush=True)
        xla[size], xla_eager[size], xla_ratios[size] = measure_backends(size, args, cfg, batches)
    memory, fsdp2 = {}, None
    if sizes and not args.no_memory:
        largest = max(sizes)
        memory["DataParallel"] = runtime[largest]
        print(f"N={largest}: runtime (eager), ShardedDataParallel ...", flush=True)
        memory["ShardedDataParallel"] = measure_runtime(largest, "eager", "ShardedDataParallel", args, cfg, batches)
        print(f"N={largest}: torch FSDP2 (the sharded plan's reference) ...", flush=True)
        fsdp2 = fsdp2_memory(largest, ddp_spec(args, cfg))
        print(f"N={largest}: runtime (eager), ShardedDataParallel (gather-all) ...", flush=True)
        memory["ShardedDataParallel (gather-all)"] = measure_runtime(largest, "eager",
                                                                     "ShardedDataParallel (gather-all)", args, cfg,
                                                                     batches)

    cores = os.cpu_count() or 1
    print()
    print(f"Training throughput, tokens/s (median of {args.repeats} windows of {args.steps} steps, interleaved "
          f"runtime, DDP, eager per round; ratios: median of the per-round ratios; eager compute, 1 thread/process)")
    table = []
    for size in sizes:
        rt, dd, eg, ra = runtime[size], ddp[size], eager[size], ratios[size]
        rt["vs_ddp"], rt["vs_eager"], dd["vs_eager"] = ra["runtime_vs_ddp"], ra["runtime_vs_eager"], ra["ddp_vs_eager"]
        if size > cores:
            note = f"oversubscribed: {size} processes on {cores} cores (+ the runtime's client)"
        elif size + 1 > cores:
            note = f"the runtime's client shares the {cores} cores with its {size} executors"
        else:
            note = ""
        table.append([size, f"{rt['tokens_per_s']:,.0f}", f"{dd['tokens_per_s']:,.0f}", f"{eg['tokens_per_s']:,.0f}",
                      f"{rt['vs_ddp']:.2f}", f"{ra['runtime_vs_ddp_min']:.2f}-{ra['runtime_vs_ddp_max']:.2f}",
                      f"{rt['vs_eager']:.2f}", f"{dd['vs_eager']:.2f}",
                      f"{rt['ms_per_step']:.1f} / {dd['ms_per_step']:.1f}",
                      f"{rt['client_cpu_ms_per_step']:.1f} + {_fmt_list(rt['worker_cpu_ms_per_step'], '.0f')} / "
                      f"{_fmt_list(dd['worker_cpu_ms_per_step'], '.0f')}",
                      _fmt_list(rt["compute_ms_per_step"], ".1f"), _fmt_list(rt["busy_fraction"], ".0%"), note])
    print_table(["N", "runtime", "DDP", "eager 1-proc", "runtime/DDP", "rt/DDP min-max", "runtime/eager", "DDP/eager",
                 "ms/step rt / DDP", "CPU ms/step rt client + executors / DDP ranks", "rt exec compute ms/step",
                 "rt exec busy", "note"], table)
    print("target runtime/DDP >= 0.95: " + ", ".join(
        f"N={n} {'met' if runtime[n]['vs_ddp'] >= 0.95 else 'NOT met'}" for n in sizes))
    losses = [r["last_loss"] for r in (*eager.values(), *runtime.values(), *ddp.values(), *xla.values())]
    print("last-step loss: eager " + ", ".join(f"N={n} {eager[n]['last_loss']:.5f}" for n in sizes) + "; runtime " +
          ", ".join(f"N={n} {runtime[n]['last_loss']:.5f}" for n in sizes) + "; DDP " +
          ", ".join(f"N={n} {ddp[n]['last_loss']:.5f}" for n in sizes) +
          (("; xla " + ", ".join(f"N={n} {xla[n]['last_loss']:.5f}" for n in xla_sizes)) if xla else "") +
          f" (max spread {max(losses) - min(losses):.1e})")
    print("notes: 'CPU ms/step' = CPU time (user+system, every thread) per step of the runtime's client "
          "process (controller included) and of each executor, and of each DDP rank; 'rt exec compute ms/step' = "
          "median compute span of the step on each executor (ctx.trace, collectives included); 'rt exec busy' = "
          "share of the timed windows each executor spent in those spans; 'rt/DDP min-max' = the spread of "
          "the per-round runtime/DDP ratios. "
          f"This machine has {cores} cores: sizes whose processes outnumber them time-share the cores "
          "(the runtime also has its client+controller process), so N above the core count measures "
          "contention, not scaling.")
    print("idle CPU while another system's window ran (CPU ms per wall s, the system's processes summed; "
          "executors: in DDP and eager windows, DDP ranks: in runtime and eager windows, client: in DDP windows): " +
          "; ".join(f"N={n} executors {_fmt_list([ratios[n]['idle_cpu_ms_per_s']['executors']], '.0f')}, "
                    f"DDP ranks {_fmt_list([ratios[n]['idle_cpu_ms_per_s']['ddp']], '.0f')}, "
                    f"client {_fmt_list([ratios[n]['idle_cpu_ms_per_s']['client']], '.0f')}" for n in sizes))

    if xla:
        print()
        route = next(iter(xla.values()))["backend"]
        print(f"Executor backend: the runtime on the default backend ({route}) vs 'eager', executors pinned to one "
              f"core each, {args.repeats} interleaved rounds (compile excluded by the warm-up)")
        xtable = []
        for size in xla_sizes:
            x, base, ra = xla[size], xla_eager[size], xla_ratios[size]
            x["vs_eager_runtime"] = ra["xla_vs_eager"]
            xtable.append([size, f"{x['tokens_per_s']:,.0f}", f"{base['tokens_per_s']:,.0f}",
                           f"{ra['xla_vs_eager']:.2f}", f"{ra['min']:.2f}-{ra['max']:.2f}", f"{x['first_step_s']:.1f}",
                           f"{base['first_step_s']:.1f}",
                           _fmt_list(x["compute_ms_per_step"], ".1f"), _fmt_list(base["compute_ms_per_step"], ".1f"),
                           _fmt_list(x["worker_cpu_per_wall"], ".2f"), _fmt_list(base["worker_cpu_per_wall"], ".2f"),
                           f"{x['last_loss']:.5f} / {base['last_loss']:.5f}"])
        print_table(["N", "xla tokens/s", "eager tokens/s", "xla/eager", "min-max", "xla first step s",
                     "eager first step s", "xla compute ms/step", "eager compute ms/step", "xla exec CPU/wall",
                     "eager exec CPU/wall", "last loss xla / eager"], xtable)
        print("target xla/eager >= 1.0: " + ", ".join(
            f"N={n} {'met' if xla_ratios[n]['xla_vs_eager'] >= 1.0 else 'NOT met'}" for n in xla_sizes))
        print("notes: 'exec CPU/wall' = an executor's CPU seconds per wall second in the timed windows (pinned: at "
              "most 1); 'first step' includes loading and compiling the step (XLA: a persistent cache hit is "
              "faster; see bench/backends.py for the compile with an empty cache).")

    if memory:
        largest = max(sizes)
        print()
        print(f"Memory per executor at N={largest} (VmHWM = peak resident set; store = object store bytes after "
              f"the steps)")
        mtable = []
        param_bytes = num_params * 4
        for plan_name, r in memory.items():
            for i, pid in enumerate(r["pids"]):
                added_p = (r["vmhwm_kib"][i] - r["vmhwm_start_kib"][i]) * 1024 / param_bytes
                mtable.append([plan_name, f"executor-{i}", pid, _mib(r["vmhwm_start_kib"][i]), _mib(r["vmhwm_kib"][i]),
                               f"{added_p:.1f}", f"{r['store_bytes'][i]:,}", f"{r['store_bytes'][i] / param_bytes:.2f}",
                               f"{r['tokens_per_s']:,.0f}"])
        starts = ddp[largest].get("vmhwm_start_kib") or [None] * len(ddp[largest]["vmhwm_kib"])
        for rank, (kib, start) in enumerate(zip(ddp[largest]["vmhwm_kib"], starts)):
            added = f"{(kib - start) * 1024 / param_bytes:.1f}" if start else "-"
            mtable.append(["DDP (reference)", f"rank {rank}", "-", _mib(start) if start else "-", _mib(kib), added,
                           "-", "-", f"{ddp[largest]['tokens_per_s']:,.0f}"])
        for rank, (kib, start) in enumerate(zip(fsdp2["vmhwm_kib"], fsdp2["vmhwm_start_kib"])):
            mtable.append(["FSDP2 (reference)", f"rank {rank}", "-", _mib(start), _mib(kib),
                           f"{(kib - start) * 1024 / param_bytes:.1f}", "-", "-", f"{fsdp2['tokens_per_s']:,.0f}"])
        print_table(["plan", "executor", "pid", "VmHWM at start MiB", "VmHWM after MiB", "peak added (P)",
                     "store bytes", "store (P)", "tokens/s"], mtable)
        print(f"notes: parameters are {param_bytes:,} bytes (fp32); DataParallel stores params + AdamW exp_avg + "
              f"exp_avg_sq = {3 * param_bytes:,} bytes per executor, ShardedDataParallel 1/{largest} of that "
              f"(padded). VmHWM is dominated by the process's torch import; the executors' 'at start' column "
              f"is before the trainer existed. P = the parameters' bytes; at this model size the added peak "
              f"is mostly the runtime's own (a step's buffers, the allocator): bench/sharding.py measures P-multiples "
              f"on a 64 MiB model beside DDP and FSDP2.")

    elapsed = time.perf_counter() - started
    path = write_results("train", {
        "config": {"width": cfg.width, "depth": cfg.depth, "heads": cfg.heads, "length": cfg.length,
                   "vocab": cfg.vocab, "context": cfg.context, "batch": args.batch, "steps": args.steps,
                   "warmup": args.warmup, "repeats": args.repeats, "lr": LR, "seed": SEED,
                   "parameters": num_params, "tokens_per_step": args.batch * cfg.context},
        "eager": [eager[n] for n in sizes], "runtime": [runtime[n] for n in sizes], "ddp": [ddp[n] for n in sizes],
        "ratios": [{"executors": n, **ratios[n]} for n in sizes],
        "xla": [xla[n] for n in xla_sizes], "xla_eager_pinned": [xla_eager[n] for n in xla_sizes],
        "xla_ratios": [{"executors": n, **xla_ratios[n]} for n in xla_sizes], "memory": {k: {kk: v[kk] for kk in (
            "executors", "pids", "vmhwm_start_kib", "vmhwm_kib", "store_bytes", "tokens_per_s")}
            for k, v in memory.items()}, "fsdp2_memory": fsdp2,
        "elapsed_s": elapsed})
    print(f"\nwritten to {path} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
