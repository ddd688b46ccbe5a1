"""bench/pipeline.py, part 2: programs built straight from each schedule, run on simulated executors; the bubble
measured from the executors' trace against theory, the simulator, and a replay with the measured transfer wait."""

from __future__ import annotations

import os
import re
import time

import torch

import pathways_torch as pw
from bench.common import median, print_table
from bench.pipeline_analysis import kept_order, relative_error, replay, transfer_waits, virtual_stages
from pathways_torch.observe.span_math import complete_events, occupancy
from pathways_torch.pipeline.schedules import make_schedule, simulate, theoretical_bubble

SCHEDULES = ("gpipe", "1f1b", "interleaved")
TARGET = 0.10          # measured bubble within 10 % (relative) of theory


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
    spans = [e for e in complete_events(trace["traceEvents"]) if e.get("name") in names and lo <= e["ts"] <= hi]
    if len(spans) != len(order):
        raise RuntimeError(f"expected {len(order)} compute spans in the run's window, found {len(spans)}")
    base = min(e["args"]["seq"] for e in spans)
    rank = _ranks_by_pid(trace)
    return {order[e["args"]["seq"] - base]: (rank[e["pid"]], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
            for e in spans}


def _ranks_by_pid(trace: dict) -> dict[int, int]:
    """Trace row → pipe rank: rank r runs on ``executor-r`` (the rows are named after their executor)."""
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
        every = [occupancy(list(timed_actions(trace, names, w, order).values()), size).bubble for w in windows[:-1]]
        timed = timed_actions(trace, names, windows[-1], order)
        schedule = r.pop("_schedule")
        measured = occupancy([(rank, s, e) for rank, s, e in timed.values()], size)
        waits = transfer_waits(timed, schedule.num_chunks)
        latency = median(waits) if waits else 0.0
        expected = replay(order, schedule.num_chunks, size,
                          r["chunk_forward_ms"] / 1e3, r["chunk_backward_ms"] / 1e3, latency)
        r.update(replayed=expected.bubble, replayed_makespan_s=expected.makespan,
                 measured=measured.bubble, measured_runs=every + [measured.bubble],
                 makespan_s=measured.makespan, busy_s=measured.busy,
                 relative_error=relative_error(measured.bubble, r["theory"]),
                 kept_order=kept_order(timed, schedule),
                 transfer_wait_ms={"median": median(waits) * 1e3, "max": max(waits, default=float("nan")) * 1e3,
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
