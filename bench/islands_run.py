"""bench/islands.py's harness: one configuration's context and trainer kept across its timed windows, and the
groups' rounds run over them."""

from __future__ import annotations

import gc
import os
import statistics
import time

import pathways_torch as pw
from bench.common import rotated
from bench.islands_report import spread
from bench.islands_setups import Setup
from bench.islands_trace import classify, exchange_steps, in_windows, link_transfer_overlap, link_transfer_times
from bench.train_setup import ReverseTask, loss_fn, make_config, make_model
from pathways_torch.observe.span_math import complete_events

SEED = 0
SETTLE_S = 0.05            # a pause before each window: the previous window's trailing frees are done


class Run:
    """One configuration's context and trainer; keeps every window it ran and what its traces said."""

    def __init__(self, setup: Setup, args, cfg, batches):
        self.setup, self.args, self.cfg, self.batches = setup, args, cfg, batches
        self.ctx = self.trainer = None
        self.losses: dict[int, float] = {}
        self.first_step_s: list[float] = []
        self.start_s: list[float] = []
        self.windows: list[dict] = []            # {"group", "round", "wall_s", "tokens_per_s", "bytes"}
        # By group: per timed step (exchange_steps), link transfer times, in-island collective s per executor-step.
        self.exchange: dict[str, list[dict]] = {}
        self.transfers_s: dict[str, list[float]] = {}
        self.overlap_s: dict[str, list[float]] = {}              # by group: [hidden s, transfer s]
        self.segments_per_step = 1
        self.collective_s: dict[str, list[float]] = {}
        self.compute_s: dict[str, dict[str, float]] = {}        # by group: kind -> s per executor-step
        self.backend = self.gradient_bytes = self.num_buckets = self.shaping = None
        self.rss_mb: list[int] = []
        self._wall_spans: list[tuple[str, float, float]] = []     # (group, start, end) of this context's windows

    @property
    def is_open(self) -> bool:
        return self.ctx is not None

    def open(self) -> None:
        """Start the context and the trainer; run the warm-up steps (each waited for)."""
        setup, args = self.setup, self.args
        options = {} if args.backend is None else {"backend": args.backend}
        began = time.perf_counter()
        self.ctx = pw.Context(executor_threads=1, pin_executors=True, start_timeout_s=300,
                              **setup.context_options(), **options)
        self.start_s.append(time.perf_counter() - began)
        self.backend = self.ctx.backend
        model, optimizer = make_model(self.cfg)
        self.trainer = self.ctx.wrap(model, optimizer=optimizer, loss_fn=loss_fn, mesh=self.ctx.mesh(setup.mesh_axes()),
                                     plan=setup.plan(args.bucket_mb))
        layout, shards = self.trainer.layout, self.trainer.num_shards
        self.gradient_bytes = sum(b.padded_numel(shards) * b.dtype.itemsize for b in layout.buckets)
        self.num_buckets = len(layout.buckets)
        self.shaping = None if self.ctx.link is None else self.ctx.link.describe()
        self.index, self._wall_spans = 0, []
        began = time.perf_counter()
        self._step()
        self.first_step_s.append(time.perf_counter() - began)
        for _ in range(1, args.warmup):
            self._step()

    def _step(self) -> None:
        loss = self.trainer.step(self.batches[self.index])
        self.losses[self.index] = loss.result(600).item()
        self._settle()
        self.index += 1

    def _settle(self) -> None:
        """Wait until every island has applied its update (the loss is island 0's: another may still run)."""
        state = getattr(self.trainer.runner, "island_states", None)
        arrays = [a for island in state for a in island] if state is not None else list(self.trainer.runner.flats)
        for array in arrays:
            error = array.exception(timeout_s=600)
            if error is not None:
                raise error

    def relayed(self) -> int | None:
        return None if self.ctx.link is None else self.ctx.link.bytes_relayed

    def window(self, group: str, round_index: int) -> float:
        """``--steps`` steps back to back; ends when the last loss and every island's state are ready."""
        steps = self.args.steps
        gc.collect()
        time.sleep(SETTLE_S)
        before = self.relayed()
        wall_began, began = time.time(), time.perf_counter()
        for _ in range(steps):
            loss = self.trainer.step(self.batches[self.index])
            self.index += 1
        value = loss.result(600).item()
        self._settle()
        wall = time.perf_counter() - began
        self._wall_spans.append((group, wall_began, time.time()))
        after = self.relayed()
        self.losses[self.index - 1] = value
        del loss
        rate = steps * self.args.batch * self.cfg.context / wall
        self.windows.append({"group": group, "round": round_index, "wall_s": wall, "tokens_per_s": rate,
                             "link_bytes_per_step": None if before is None else (after - before) / steps})
        return rate

    def close(self, trace_dir: str) -> None:
        """Read the trace of this context's timed steps, then stop it."""
        try:
            self.rss_mb = [_rss_mb(pid) for pid in self.ctx.executor_pids]
            name = f"bench-islands-{self.setup.key}-{len(self.start_s)}.json".replace("+", "p")
            trace = self.ctx.trace(os.path.join(trace_dir, name))
            self._read_trace(trace)
        finally:
            self.ctx.close()
            self.ctx = self.trainer = None
            gc.collect()

    def _read_trace(self, trace: dict) -> None:
        events = trace["traceEvents"]
        spans = complete_events(events, "compute", "collective")
        for group in dict.fromkeys(g for g, _, _ in self._wall_spans):
            windows = [(a, b) for g, a, b in self._wall_spans if g == group]
            mine = [e for e in spans if in_windows(e["ts"] / 1e6, windows)]
            if self.setup.islands is not None:
                compute = [(e["pid"], classify(e["name"]), e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
                           for e in mine if e["cat"] == "compute"]
                per = len(self.trainer.runner.bucket_cut.segments)
                self.exchange.setdefault(group, []).extend(exchange_steps(compute, self.setup.island_of, per))
                self.transfers_s.setdefault(group, []).extend(link_transfer_times(events, windows))
                hidden, total = link_transfer_overlap(events, windows)
                sums = self.overlap_s.setdefault(group, [0.0, 0.0])
                sums[0] += hidden
                sums[1] += total
            per = len(windows) * self.args.steps * self.setup.num_executors
            collective = sum(e["dur"] / 1e6 for e in mine if e["cat"] == "collective")
            self.collective_s.setdefault(group, []).append(collective / per)
            totals = self.compute_s.setdefault(group, {})
            for e in mine:
                if e["cat"] == "compute":
                    kind = classify(e["name"])
                    totals[kind] = totals.get(kind, 0.0) + e["dur"] / 1e6 / per

    def summary(self, group: str) -> dict:
        """This run's windows in ``group``: tokens/s, ms/step, bytes/step (medians)."""
        mine = [w for w in self.windows if w["group"] == group]
        link_bytes = [w["link_bytes_per_step"] for w in mine if w["link_bytes_per_step"] is not None]
        return {"tokens_per_s": spread([w["tokens_per_s"] for w in mine]),
                "ms_per_step": statistics.median([w["wall_s"] for w in mine]) / self.args.steps * 1e3,
                "link_bytes_per_step": statistics.median(link_bytes) if link_bytes else None,
                "windows": len(mine)}


def _rss_mb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


# ------------------------------------------------------------ the measurement

def measure(args, setups: dict, groups: list, method: str, trace_dir: str) -> dict:
    cfg = make_config(args)
    task = ReverseTask(cfg, SEED)
    uses = {key: sum(key in g["keys"] for g in groups) for key in setups}
    windows_per_run = args.warmup + args.rounds * args.steps * max(uses.values())
    batches = [task.batch(i, args.batch) for i in range(windows_per_run)]
    runs = {key: Run(setup, args, cfg, batches) for key, setup in setups.items()}
    last = {}
    for index, group in enumerate(groups):
        for key in group["keys"]:
            last[key] = index
    results = []
    try:
        for index, group in enumerate(groups):
            began = time.perf_counter()
            keys, rounds = group["keys"], []
            if method == "open":
                for key in keys:
                    if not runs[key].is_open:
                        runs[key].open()
                        print(f"  {group['name']}: {key} up in {runs[key].start_s[-1]:.1f} s, first step "
                              f"{runs[key].first_step_s[-1]:.1f} s, {args.warmup} warm-up steps done", flush=True)
            for r in range(args.rounds):
                rates = {}
                for key in rotated(keys, r):
                    run = runs[key]
                    if method == "alternate":
                        run.open()
                    rates[key] = run.window(group["name"], r)
                    if method == "alternate":
                        run.close(trace_dir)
                rounds.append(rates)
                ref = rates[group["reference"]]
                print(f"  {group['name']} round {r + 1}/{args.rounds}: "
                      + ", ".join(f"{k} {rates[k]:,.0f} ({rates[k] / ref:.3f})" for k in keys) + " tokens/s",
                      flush=True)
            if method == "open":
                for key in keys:
                    if last[key] == index:
                        runs[key].close(trace_dir)
            results.append({**group, "rounds": rounds, "wall_s": time.perf_counter() - began})
    finally:
        for run in runs.values():
            if run.is_open:
                try:
                    run.ctx.close()
                except Exception:     # noqa: BLE001 - the first error is the one to see
                    pass
    return {"runs": runs, "groups": results, "cfg": cfg}
