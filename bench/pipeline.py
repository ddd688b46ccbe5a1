"""Pipeline vs SPMD (the paper's Table 2): the same Transformer on the same executors, tokens/s; and the
pipeline bubble on simulated devices against theory.

1. Real executors. One ``pw.Context(num_executors=2)`` (the default backend, or ``--backend``;
   ``executor_threads=1``, each executor pinned to one core, ``torch.set_num_threads(1)`` in the
   client) holds four trainers of `bench/train.py`'s Transformer (`examples/transformer.py`,
   reversal task, dropout 0, the same initial weights and batches, AdamW): ``pw.DataParallel("data")``
   on ``{"data": 2}`` and ``pw.Pipeline(microbatches=M, schedule=S)`` on ``{"pipe": 2}`` for S in
   gpipe, 1f1b and interleaved (``virtual_stages=2``). Every trainer is warmed up (``--warmup``
   steps, waited for; the first step's time, capture and compile included, is reported), then come
   ``--rounds`` rounds; each round times one window of ``--steps`` steps per plan (dispatched back to
   back, the last loss waited for), the plans' order rotated by one each round. Tokens/s of a plan is
   the median of its windows; its ratio to DataParallel the median of the per-round ratios. Then,
   per pipeline plan, the peak activation bytes of each stage: ``ctx.stats()`` (which starts a new
   high-water period) at rest, one step waited for, ``ctx.stats()`` again; peak =
   ``store_bytes_high_water`` of the stage's executor minus its ``store_bytes`` at rest (so the other
   trainers' state cancels out; values handed from node to node inside a segment never reach the
   store and are not counted).
2. Simulated executors (``backend="sim"``: a run occupies its device for the function's
   ``sim_time_s`` and returns placeholders). For S stages, M microbatches and each schedule, a
   ``@pw.program`` is built straight from the schedule: in `simulate(schedule).order` a forward
   (``sim_time_s`` = F / V) or backward (2F / V) function is called on the stage mesh of its chunk's
   rank, fed the previous chunk's activation (F) or the next chunk's gradient (B), so the program's
   transfers between stage meshes follow the schedule (`pipeline.build.build_step`'s wiring, one
   tensor per value). It runs ``--sim-runs`` times (the first registers it); from the executors'
   trace of the last run: bubble = 1 - (compute spans summed over ranks) / (S x makespan), makespan
   from the first start to the last end on any rank, against `schedules.theoretical_bubble` =
   (S-1)/(V*M + S-1) and `simulate(...).bubble_fraction` (F and B as above). Also checked: each rank
   started its actions in the schedule's order; and the median wait for a transfer (an action's
   start minus the later of its producer's end on the other rank and its own rank's previous end,
   where the producer ended last), which is what stretches the measured makespan.

The per-round ratios, not the absolute rates, are what to read: this machine's speed drifts.
Prints tables and writes bench/results/pipeline.json (or ``--json PATH``).

    .venv/bin/python -m bench.pipeline [--quick] [--json PATH] [--backend eager] [--rounds 5] [--steps 10]
                                       [--sim-stages 4,8,16] [--forward-ms 10,50] [--no-real | --no-sim]
"""

from __future__ import annotations

import argparse
import gc
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
from bench.common import (add_backend_argument, add_model_arguments, add_quick_and_json,  # noqa: E402
                          add_trace_dir_argument, print_table, write_results)
from bench.train import make_config, make_model  # noqa: E402
from pathways_torch.pipeline.schedules import Action, make_schedule, simulate, theoretical_bubble  # noqa: E402
from transformer import ReverseTask, loss_fn  # noqa: E402

PLANS = ("DataParallel", "gpipe", "1f1b", "interleaved")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
SEED = 0
SETTLE_S = 0.05        # a pause before each window: the previous window's trailing frees are done
TARGET = 0.10          # measured bubble within 10 % (relative) of theory
SIZES = {"small": (64, 64), "large": (128, 512)}   # (width, global batch) of the real executors' model


# ------------------------------------------------------------ helpers (pure, unit-tested)

def virtual_stages(schedule: str) -> int:
    """Chunks per rank: 2 for the interleaved schedule, 1 for GPipe and 1F1B."""
    return 2 if schedule == "interleaved" else 1


def rotated(items: list, shift: int) -> list:
    """``items`` rotated left by ``shift``: round i of a round-robin starts with item i mod n."""
    shift %= len(items)
    return list(items[shift:]) + list(items[:shift])


def bubble(spans: list[tuple[int, float, float]], num_ranks: int) -> dict:
    """From compute spans ``(rank, start, end)``: busy time (summed over ranks), makespan (first start to
    last end on any rank) and bubble = 1 - busy / (num_ranks * makespan)."""
    if not spans:
        raise ValueError("bubble: no compute spans")
    begin, end = min(s for _, s, _ in spans), max(e for _, _, e in spans)
    busy = sum(e - s for _, s, e in spans)
    makespan = end - begin
    return {"busy": busy, "makespan": makespan,
            "bubble": 1.0 - busy / (num_ranks * makespan) if makespan > 0 else 0.0}


def kept_order(timed: dict[Action, tuple[int, float, float]], schedule) -> bool:
    """Whether every rank started its compute actions in the schedule's order (``timed``: action → (rank,
    start, end)), each on the rank its chunk lives on."""
    for r, actions in enumerate(schedule.ranks):
        expected = [a for a in actions if a.is_compute]
        ran = sorted(((start, a) for a, (rank, start, _) in timed.items() if rank == r), key=lambda t: t[0])
        if [a for _, a in ran] != expected:
            return False
    return all(rank == schedule.rank_of(a.chunk) for a, (rank, _, _) in timed.items())


def producer(action: Action, num_chunks: int) -> Action | None:
    """The compute action on the neighbouring chunk whose output ``action`` reads: the previous chunk's
    forward for a forward, the next chunk's backward for a backward; None at the ends of the pipe."""
    if action.kind == "F":
        return Action(action.chunk - 1, "F", action.microbatch) if action.chunk > 0 else None
    return Action(action.chunk + 1, "B", action.microbatch) if action.chunk + 1 < num_chunks else None


def transfer_waits(timed: dict[Action, tuple[int, float, float]], num_chunks: int) -> list[float]:
    """For each action whose input came from another rank and arrived after its own rank was free:
    start - producer's end (the transfer and the hand-off to the compute thread)."""
    by_rank: dict[int, list] = {}
    for a, (rank, start, end) in timed.items():
        by_rank.setdefault(rank, []).append((start, end, a))
    previous_end = {}
    for spans in by_rank.values():
        spans.sort(key=lambda t: t[0])
        for (_, end, _), (_, _, a) in zip(spans, spans[1:]):
            previous_end[a] = end
    waits = []
    for a, (rank, start, _) in timed.items():
        source = producer(a, num_chunks)
        if source is None or source not in timed or timed[source][0] == rank:
            continue
        produced = timed[source][2]
        if produced >= previous_end.get(a, float("-inf")):
            waits.append(start - produced)
    return waits


def replay(order: list[Action], num_chunks: int, num_ranks: int, forward_s: float, backward_s: float,
           latency_s: float) -> dict:
    """Time compute actions run in ``order`` (a global order consistent with every dependency, each rank's
    actions in its own order) when a value from another rank arrives ``latency_s`` after its producer
    ends: what the schedule should take with this runtime's transfer wait. Returns `bubble`'s dict."""
    free = [0.0] * num_ranks
    ends: dict[Action, float] = {}
    spans = []
    for a in order:
        rank = a.chunk % num_ranks
        ready = free[rank]
        source = producer(a, num_chunks)
        if source is not None:
            ready = max(ready, ends[source] + (latency_s if source.chunk % num_ranks != rank else 0.0))
        end = ready + (forward_s if a.kind == "F" else backward_s)
        ends[a], free[rank] = end, end
        spans.append((rank, ready, end))
    return bubble(spans, num_ranks)


def activation_peaks(rest: dict, peak: dict, stage_executors: list[list[str]]) -> list[int] | None:
    """Per stage: the largest (``store_bytes_high_water`` in ``peak`` - ``store_bytes`` in ``rest``) over
    its executors (``rest``/``peak``: ``ctx.stats()["executors"]`` before and after one step). None when
    no executor reports a high-water mark (all zero: the executor does not fill it in)."""
    if not any(peak[e]["store_bytes_high_water"] for ids in stage_executors for e in ids):
        return None
    return [max(peak[e]["store_bytes_high_water"] - rest[e]["store_bytes"] for e in ids) for ids in stage_executors]


def busy_in_windows(spans: list[tuple[int, float, float]], windows: list[tuple[float, float]]) -> dict:
    """Per rank (or executor) of ``spans`` ``(rank, start, end)``: the share of the ``windows`` (``(start,
    end)``, disjoint) it spent inside spans, and how many spans started inside them."""
    total = sum(b - a for a, b in windows)
    out: dict[int, dict] = {}
    for rank, start, end in spans:
        entry = out.setdefault(rank, {"busy": 0.0, "count": 0})
        for a, b in windows:
            entry["busy"] += max(0.0, min(end, b) - max(start, a))
            entry["count"] += a <= start < b
    return {rank: {"busy_fraction": e["busy"] / total if total else 0.0, "count": e["count"]}
            for rank, e in sorted(out.items())}


def relative_error(measured: float, expected: float) -> float:
    return abs(measured - expected) / expected if expected else abs(measured)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _fmt_bytes(value) -> str:
    return "n/a (not reported)" if value is None else f"{value:,}"


# ------------------------------------------------------------ 1: real executors

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
        return [list(m.executor_ids) for m in self.trainer._stage_meshes]

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
        spans = [(e["pid"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in trace["traceEvents"]
                 if e.get("ph") == "X" and e.get("cat") == "compute"]
        executor_ids = list(ctx.executor_ids)
        profiles = {}
        for name in PLANS:
            profile = busy_in_windows(spans, runs[name].wall_spans)
            steps = len(runs[name].wall_spans) * args.steps
            profiles[name] = {executor_ids[pid]: {"busy_fraction": p["busy_fraction"],
                                                  "computations_per_step": p["count"] / steps}
                              for pid, p in profile.items() if pid < len(executor_ids)}
    plans = {}
    for name in PLANS:
        run = runs[name]
        ratios = [r[name] / r["DataParallel"] for r in rounds]
        plans[name] = {"tokens_per_s": _median(run.tokens_per_s), "windows_s": run.windows,
                       "ms_per_step": _median(run.windows) / args.steps * 1000, "first_step_s": run.first_step_s,
                       "last_loss": run.last_loss, "executors": profiles[name],
                       "vs_data_parallel": {"median": _median(ratios), "min": min(ratios), "max": max(ratios)}}
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


# ------------------------------------------------------------ 2: simulated executors

def sim_program(schedule, simulation, meshes, forward_s: float, tag: str):
    """A program that calls a forward / backward sim function per compute action, in the simulation's
    order, on the mesh of the action's rank; returns (program, compute actions in node order)."""
    forward = pw.function(lambda x: x + 1, name=f"F[{tag}]", sim_time_s=forward_s)
    backward = pw.function(lambda y, g: y + g, name=f"B[{tag}]", sim_time_s=2 * forward_s)
    forwards = [forward.on(m) for m in meshes]
    backwards = [backward.on(m) for m in meshes]
    order = [a for _, a in simulation.order if a.is_compute]
    num_chunks, num_microbatches, rank_of = schedule.num_chunks, schedule.num_microbatches, schedule.rank_of

    def pipeline(x):
        activations, grads = {}, {}
        for a in order:
            c, m = a.chunk, a.microbatch
            if a.kind == "F":
                activations[(c, m)] = forwards[rank_of(c)](activations[(c - 1, m)] if c else x)
                continue
            saved = activations.pop((c, m))
            grad_out = grads.pop((c + 1, m)) if c + 1 < num_chunks else saved   # the loss's own "gradient"
            grads[(c, m)] = backwards[rank_of(c)](saved, grad_out)
        return tuple(grads[(0, m)] for m in range(num_microbatches))

    return pw.program(pipeline, name=f"pipeline[{tag}]"), order, (forward.name, backward.name)


def timed_actions(trace: dict, names: tuple[str, str], window_ns: tuple[int, int], order: list) -> dict:
    """action → (rank, start s, end s) of one run, from the trace's compute spans of ``names`` inside
    ``window_ns``; node i of the run (seq - the run's first seq) is ``order[i]``."""
    lo, hi = window_ns[0] / 1000.0, window_ns[1] / 1000.0
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "compute"
             and e.get("name") in names and lo <= e["ts"] <= hi]
    if len(spans) != len(order):
        raise RuntimeError(f"expected {len(order)} compute spans in the run's window, found {len(spans)}")
    base = min(e["args"]["seq"] for e in spans)
    rank = _ranks_by_pid(trace)
    return {order[e["args"]["seq"] - base]: (rank[e["pid"]], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
            for e in spans}


def _ranks_by_pid(trace: dict) -> dict[int, int]:
    """Trace row → pipe rank: rank r runs on ``executor-r`` (the rows are named after their executor)."""
    import re

    ranks = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            found = re.search(r"executor-(\d+)", e["args"]["name"])
            if found:
                ranks[e["pid"]] = int(found.group(1))
    return ranks


def measure_sim(size: int, args, trace_dir: str, islands: int = 1) -> dict:
    """``islands`` > 1: the S stages on that many islands (consecutive stages on one island, the paper's
    layout), their transfers through a link relay delayed by ``--sim-link-delay-ms``."""
    began = time.perf_counter()
    configs = [(name, m, f) for f in args.forward_s for m in sorted({size, 4 * size}) for name in SCHEDULES]
    layout = {}
    if islands > 1:
        layout = dict(islands=[size // islands] * islands,
                      link=pw.Link(delay_s=args.sim_link_delay_ms / 1e3) if args.sim_link_delay_ms else None)
    with pw.Context(num_executors=size, backend="sim", start_timeout_s=300, **layout) as ctx:
        start_s = time.perf_counter() - began
        print(f"sim S={size} on {islands} island(s): {size} executors up in {start_s:.1f} s", flush=True)
        # By name: executor-r is in island r // (S / islands), so each island holds consecutive stages.
        meshes = [ctx.mesh({"data": 1}, executors=[f"executor-{r}"]) for r in range(size)]
        x = ctx.put(torch.zeros(1, 8), meshes[0], [pw.Replicate()])
        runs = []
        for name, microbatches, forward in configs:
            v = virtual_stages(name)
            schedule = make_schedule(name, size, microbatches, v)
            chunk_f = forward / v
            simulation = simulate(schedule, chunk_f, 2 * chunk_f)
            tag = f"{name}-S{size}-M{microbatches}-F{forward * 1e3:g}ms"
            program, order, names = sim_program(simulation.schedule, simulation, meshes, chunk_f, tag)
            windows, walls = [], []
            for _ in range(args.sim_runs):
                t0, w0 = time.time_ns(), time.perf_counter()
                outputs = program(x)
                for o in outputs:
                    o.exception(timeout_s=600)
                walls.append(time.perf_counter() - w0)
                windows.append((t0, time.time_ns()))
                del outputs
            runs.append({"schedule": name, "stages": size, "islands": islands, "microbatches": microbatches,
                         "virtual_stages": v,
                         "forward_ms": forward * 1e3, "chunk_forward_ms": chunk_f * 1e3,
                         "chunk_backward_ms": 2 * chunk_f * 1e3, "run_wall_s": walls,
                         "theory": theoretical_bubble(size, microbatches, v),
                         "simulated": simulation.bubble_fraction, "simulated_makespan_s": simulation.makespan,
                         "_order": order, "_names": names, "_windows": windows[1:] or windows,
                         "_schedule": simulation.schedule})
            print(f"  {tag}: {args.sim_runs} runs, wall {', '.join(f'{w:.2f}' for w in walls)} s", flush=True)
        path = os.path.join(trace_dir, f"bench-pipeline-sim-S{size}-I{islands}.json")
        trace = ctx.trace(path)
    for r in runs:
        order, names, windows = r.pop("_order"), r.pop("_names"), r.pop("_windows")
        every = [bubble(list(timed_actions(trace, names, w, order).values()), size)["bubble"] for w in windows[:-1]]
        timed = timed_actions(trace, names, windows[-1], order)
        schedule = r.pop("_schedule")
        measured = bubble([(rank, s, e) for rank, s, e in timed.values()], size)
        waits = transfer_waits(timed, schedule.num_chunks)
        latency = _median(waits) if waits else 0.0
        expected = replay(order, schedule.num_chunks, size,
                          r["chunk_forward_ms"] / 1e3, r["chunk_backward_ms"] / 1e3, latency)
        r.update(replayed=expected["bubble"], replayed_makespan_s=expected["makespan"],
                 measured=measured["bubble"], measured_runs=every + [measured["bubble"]],
                 makespan_s=measured["makespan"], busy_s=measured["busy"],
                 relative_error=relative_error(measured["bubble"], r["theory"]),
                 kept_order=kept_order(timed, schedule),
                 transfer_wait_ms={"median": _median(waits) * 1e3, "max": max(waits, default=float("nan")) * 1e3,
                                   "count": len(waits)})
    return {"stages": size, "islands": islands, "context_start_s": start_s, "runs": runs,
            "trace": path if args.trace_dir else None}


def report_sim(sims: list[dict]) -> None:
    print()
    print("Pipeline bubble on simulated executors (the last run, then the range over the runs after the first; "
          "F = forward time of a whole stage, a chunk takes F/V forward and 2F/V backward; bubble = "
          "1 - busy / (S x makespan) from the executors' trace)")
    rows, met = [], {}
    for sim in sims:
        for r in sim["runs"]:
            ok = r["relative_error"] <= TARGET
            counts = met.setdefault(r["forward_ms"], [0, 0])
            counts[0], counts[1] = counts[0] + ok, counts[1] + 1
            rows.append([r["stages"], r.get("islands", 1), r["microbatches"], r["schedule"], r["virtual_stages"],
                         f"{r['forward_ms']:g}",
                         f"{r['makespan_s']:.3f} / {r['simulated_makespan_s']:.3f}",
                         f"{r['measured']:.4f} ({min(r['measured_runs']):.4f}-{max(r['measured_runs']):.4f})",
                         f"{r['theory']:.4f}", f"{r['simulated']:.4f}", f"{r['relative_error']:.1%}",
                         "yes" if ok else "NO", "yes" if r["kept_order"] else "NO",
                         f"{r['transfer_wait_ms']['median']:.2f} / {r['transfer_wait_ms']['max']:.1f}",
                         f"{r['replayed']:.4f}"])
    print_table(["S", "islands", "M", "schedule", "V", "F ms", "makespan s meas / sim", "bubble measured (runs 2-n)", "theory",
                 "simulate()", "rel. error", "within 10%", "order kept", "transfer wait ms med / max",
                 "bubble with that wait"], rows)
    print("notes: theory = (S-1)/(V*M + S-1); simulate() = the schedule simulator's bubble with the same F/B and "
          "free communication; 'transfer wait' = an action's start after its producer's end on another rank, where "
          "that producer ended after the action's own rank was free; 'bubble with that wait' = the schedule replayed "
          "with every transfer taking the median wait: the part of the gap to theory the transfers explain.")
    starts = ", ".join(f"S={s['stages']}/I={s.get('islands', 1)} {s['context_start_s']:.1f} s" for s in sims)
    print("target measured bubble within 10 % of theory: " + ", ".join(
        f"F={f:g} ms {ok}/{n} met" for f, (ok, n) in met.items()) + f"; sim executors started in {starts}")


# ------------------------------------------------------------ main

def _ints(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick_and_json(parser, "pipeline",
                       quick_help="fewer rounds and steps, sim S=4 at F=10 ms only (about a minute)")
    add_backend_argument(parser, help="the real executors' backend (default: the runtime's)")
    parser.add_argument("--sizes", default=None,
                        help="real-executor model sizes, comma-separated: small (width 64, batch 64: 8-row "
                             "microbatches, overhead-bound), large (width 128, batch 512: 64-row microbatches); "
                             "default both, quick small; --width/--batch give one size of your own")
    add_model_arguments(parser, width=None, depth=4, depth_help="blocks; even, so that 2 stages balance (>= 4)",
                        batch_help="global batch (rows)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None, help="steps per timed window (default 10, quick 5)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5, quick 2)")
    parser.add_argument("--memory-steps", type=int, default=2, help="steps measured for peak activation bytes")
    parser.add_argument("--sim-stages", default=None, help="sim pipeline sizes S (default 4,8,16; quick 4)")
    parser.add_argument("--forward-ms", default=None,
                        help="sim forward time F of a stage, ms, comma-separated (default 10,50; quick 10)")
    parser.add_argument("--sim-runs", type=int, default=None, help="runs per sim program (default 3, quick 2)")
    parser.add_argument("--sim-islands", type=int, default=0,
                        help="also run each sim size with its stages on this many islands (e.g. 4: the paper's "
                             "4-island layout); 0: one island only")
    parser.add_argument("--sim-link-delay-ms", type=float, default=0.0,
                        help="with --sim-islands: one-way delay of the relay between islands")
    parser.add_argument("--no-real", action="store_true", help="skip the real executors")
    parser.add_argument("--no-sim", action="store_true", help="skip the simulated executors")
    add_trace_dir_argument(parser, "the sim executors'")
    args = parser.parse_args()
    quick = args.quick
    args.steps = args.steps or (5 if quick else 10)
    args.rounds = args.rounds or (2 if quick else 5)
    args.sim_runs = args.sim_runs or (2 if quick else 3)
    args.sim_stages = _ints(args.sim_stages or ("4" if quick else "4,8,16"))
    args.forward_s = [float(f) / 1000 for f in (args.forward_ms or ("10" if quick else "10,50")).split(",")]
    if args.width or args.batch:
        sizes = [(args.width or 64, args.batch or 64)]
    else:
        names = (args.sizes or ("small" if quick else "small,large")).split(",")
        unknown = [n for n in names if n not in SIZES]
        if unknown:
            parser.error(f"--sizes: expected names from {sorted(SIZES)}, got {unknown}")
        sizes = [SIZES[n] for n in names]
    if args.depth % 2 or args.depth < 4:
        parser.error(f"--depth {args.depth}: expected an even depth >= 4 (2 stages, 2 chunks each when interleaved)")
    for _, batch in sizes:
        if batch % (2 * args.microbatches):
            parser.error(f"--batch {batch}: must divide by 2 executors and by {args.microbatches} microbatches")
    if args.warmup < 1 or args.sim_runs < 1 or args.rounds < 1 or args.steps < 1:
        parser.error("--warmup, --sim-runs, --rounds and --steps: at least 1")
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)

    torch.set_num_threads(1)
    started = time.perf_counter()
    reals = []
    for width, batch in ([] if args.no_real else sizes):
        args.width, args.batch = width, batch
        reals.append(measure_real(args))
    sims = []
    if not args.no_sim:
        with tempfile.TemporaryDirectory() as scratch:
            for size in args.sim_stages:
                sims.append(measure_sim(size, args, args.trace_dir or scratch))
                if args.sim_islands > 1 and size % args.sim_islands == 0:
                    sims.append(measure_sim(size, args, args.trace_dir or scratch, islands=args.sim_islands))
    for real, (width, batch) in zip(reals, sizes):
        args.width, args.batch = width, batch
        report_real(real, args)
    if sims:
        report_sim(sims)
    elapsed = time.perf_counter() - started
    path = write_results("pipeline", {"args": {k: v for k, v in vars(args).items()}, "real": reals, "sim": sims,
                                      "elapsed_s": elapsed}, args.json)
    print(f"\nwritten to {path} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
