"""bench/train.py, runs 2 and 3 beside the runtime: torchrun-style DDP and one eager process, each round a runtime,
a DDP and an eager window, one system computing at a time."""

from __future__ import annotations

import statistics
import time

from bench.common import process_cpu_s
from bench.ddp_train_baseline import DDPWorkers
from bench.train_runtime import RuntimeRun, cpu_summary, delta
from bench.train_setup import LR, SEED, loss_fn, make_model, tokens_per_s

SETTLE_S = 0.05   # a pause before each window, so trailing work of the previous one (releases, GC) is done


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
    cpu = cpu_summary(None, [sum(w[r]["cpu_s"] for w in windows_by_round) for r in range(size)], sum(windows),
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
                **cpu_summary(None, [self.cpu_s], sum(windows), len(windows) * args.steps)}


def _cpu_snapshot(executor_pids: list[int], ddp_pids: list[int]) -> dict:
    return {"client": time.process_time(), "executors": [process_cpu_s(pid) for pid in executor_pids],
            "ddp": [process_cpu_s(pid) for pid in ddp_pids]}


def _cpu_used(before: dict, after: dict, part: str) -> float:
    if part == "client":
        return after["client"] - before["client"]
    return sum(delta(a, b) or 0.0 for a, b in zip(after[part], before[part]))


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
