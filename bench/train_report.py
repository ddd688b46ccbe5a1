"""bench/train.py's tables: throughput side by side, the default backend against eager, memory per executor."""

from __future__ import annotations

import dataclasses
import os

from bench.common import print_table


@dataclasses.dataclass
class Measured:
    """What bench/train.py measured, each by executor count N (the tables add the ratios they print to the
    entries, and the results JSON keeps them)."""

    sizes: list[int]
    xla_sizes: list[int]
    runtime: dict = dataclasses.field(default_factory=dict)
    ddp: dict = dataclasses.field(default_factory=dict)
    eager: dict = dataclasses.field(default_factory=dict)
    ratios: dict = dataclasses.field(default_factory=dict)
    xla: dict = dataclasses.field(default_factory=dict)
    xla_eager: dict = dataclasses.field(default_factory=dict)
    xla_ratios: dict = dataclasses.field(default_factory=dict)
    memory: dict = dataclasses.field(default_factory=dict)     # plan name -> the runtime's entry at the largest N
    fsdp2: dict | None = None


def _fmt_list(values, fmt: str) -> str:
    return "/".join("-" if v is None else format(v, fmt) for v in values)


def _mib(kib) -> str:
    return "-" if kib is None else f"{kib / 1024:.0f}"


def report_throughput(args, m: Measured) -> None:
    """Runtime, DDP and eager per N, their per-round ratios, losses, and the idle systems' CPU."""
    sizes, runtime, ddp, eager, ratios = m.sizes, m.runtime, m.ddp, m.eager, m.ratios
    xla, xla_sizes = m.xla, m.xla_sizes
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


def report_backends(args, m: Measured) -> None:
    """The runtime on the default backend against eager, executors pinned."""
    xla, xla_sizes, xla_eager, xla_ratios = m.xla, m.xla_sizes, m.xla_eager, m.xla_ratios
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


def report_memory(m: Measured, num_params: int) -> None:
    """Peak resident set and store bytes per executor at the largest N, DDP's and FSDP2's ranks for reference."""
    sizes, memory, ddp, fsdp2 = m.sizes, m.memory, m.ddp, m.fsdp2
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
