"""bench/train.py, runs 1, 4 and 5: the runtime's data-parallel trainer kept alive between timed windows, the
executors' CPU, memory and compute spans; alone, or against eager on the default backend."""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import pathways_torch as pw
from bench.common import process_cpu_s
from bench.ddp_train_baseline import status_field
from bench.train_setup import loss_fn, make_model, tokens_per_s
from pathways_torch.observe.span_math import busy_in_windows, complete_events


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
            used = delta(process_cpu_s(pid), before)
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
            compute = _compute_profile(ctx.trace(trace_path), self.trainer.runner.function.name, size, self.wall_spans)
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
                **cpu_summary(self.client_cpu, self.executor_cpu, sum(windows), len(windows) * args.steps),
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


def delta(after, before):
    return None if after is None or before is None else after - before


def cpu_summary(client_cpu_s: float | None, worker_cpu_s: list, wall_s: float, steps: int) -> dict:
    """CPU time per step (ms) of the client and of each worker, and each worker's CPU time / wall time."""
    per_step = [None if c is None else c / steps * 1000 for c in worker_cpu_s]
    total = sum(c for c in per_step if c is not None) + (client_cpu_s / steps * 1000 if client_cpu_s else 0.0)
    return {"client_cpu_ms_per_step": None if client_cpu_s is None else client_cpu_s / steps * 1000,
            "worker_cpu_ms_per_step": per_step, "total_cpu_ms_per_step": total,
            "worker_cpu_per_wall": [None if c is None else c / wall_s for c in worker_cpu_s]}


def _compute_profile(trace: dict, name: str, size: int, wall_spans: list[tuple[float, float]]) -> dict:
    """Per executor: median compute ms of a step in the timed windows, and the share of the windows spent computing."""
    windows_us = [(a * 1e6, b * 1e6) for a, b in wall_spans]
    spans = [(e["pid"], e["ts"], e["ts"] + e["dur"]) for e in complete_events(trace["traceEvents"])
             if e.get("name") == name and e.get("pid") in range(size)]
    profile = busy_in_windows(spans, windows_us)
    compute_ms, busy = [], []
    for i in range(size):
        durations_us = profile[i].durations_started_inside if i in profile else ()
        compute_ms.append(statistics.median([d / 1000 for d in durations_us]) if durations_us else None)
        # No windows: no share to give (an executor with no span in them was busy 0 of their time).
        busy.append(None if not windows_us else profile[i].busy_fraction if i in profile else 0.0)
    return {"compute_ms_per_step": compute_ms, "busy_fraction": busy}
