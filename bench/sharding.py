"""Memory of a training step, in multiples of the parameters' bytes (P), beside torch's own (issue 29).

The model: 8 blocks of 2 x Linear(W, W) (W = 1024: P = 64 MiB), AdamW, N = 4 ranks, one thread each. For each
system, per process: the peak resident set the training adds, parameters included (VmHWM after the steps less
VmHWM before the model is placed: before ``ctx.wrap`` for ours, before building the model for torch's), in P.
Both sides have run one all-reduce of one float first, so a runtime's own start (gloo's connections; the XLA
client, its compiler) is not counted on either side, as the parameters and what a step keeps are;
rows per second over the steps after the first (a row is one token of this MLP); and for ours the parameter
bytes each executor holds (its local flats), the object store's high-water, in P, and the share of executor 0's
step time spent inside collectives (from the trace).

- ``pathways DataParallel``, ``pathways ShardedDataParallel`` (per unit: each block gathered before its forward
  and again before its backward), its older gather-all step (``per_unit=False``) and per unit with the parameters
  kept for the backward (``reshard_after_forward=False``), on eager executors and on the default backend;
- ``pathways TensorParallel``: the blocks split column-then-row (``pw.tensor_parallel_plan``'s proposal) over
  ``{model: 4}`` (1 x 4), and over ``{data: 2, model: 2}`` with DataParallel beside (2 x 2), on the same 4 executors;
- ``torch DDP`` and ``torch FSDP2`` (``fully_shard`` per block, then the root): ``torchrun``-style processes on
  gloo, meeting through a FileStore in a private folder (no TCPStore, nothing off loopback).

Executor 0's resident set is sampled every 2 ms through our last step of each run: printed as text and
drawn (bench/results/sharding_timeline.png, ``--png``), it shows where in the step the peak is.

Systems run one after another, not interleaved: rows/s are for orientation, not for ratios. The issue's targets
(DP <= 5 P, sharded <= 2 P at N = 4) are printed beside the measured values.

    python bench/sharding.py [--width 1024] [--steps 4] [--systems dp-eager,sdp-eager,sdp-all-eager,...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.common import machine, print_table, run_ranks, write_results  # noqa: E402
from bench.ddp_train_baseline import status_field  # noqa: E402

SIZE = 4
ROWS = 64          # global batch rows (ROWS / SIZE per rank)
TARGETS = {"DataParallel": 5.0, "ShardedDataParallel": 2.0, "DDP": None, "FSDP2": None}
MESHES = {"TensorParallel 1x4": {"model": SIZE}, "TensorParallel+DP 2x2": {"data": 2, "model": SIZE // 2}}


def make_model(width: int):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
                           for _ in range(8)])


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def batches(width: int, steps: int) -> list:
    import torch

    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS, width, generator=generator), torch.randn(ROWS, width, generator=generator))
            for _ in range(steps)]


def measure_pathways(plan_name: str, backend: str, width: int, steps: int, mmap_threshold_mb: float = 2.0) -> dict:
    """Our trainer on ``SIZE`` local executors: per-executor peak added and store high-water, in P."""
    import torch

    import pathways_torch as pw

    model = make_model(width)
    p_bytes = param_bytes(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(width, steps)
    with pw.Context(num_executors=SIZE, backend=backend, executor_threads=1,
                    executor_mmap_threshold_mb=mmap_threshold_mb) as ctx:
        pids = ctx.executor_pids
        mesh = ctx.mesh(MESHES.get(plan_name, {"data": SIZE}))
        _warm_up(ctx, mesh)
        ctx.stats()   # the store high-water is "since the previous stats()"
        before = [status_field(pid, "VmHWM") for pid in pids]
        plan = _plan(plan_name, model)
        trainer = ctx.wrap(model, optimizer=optimizer, loss_fn=torch.nn.functional.mse_loss,
                           mesh=mesh, plan=plan)
        trainer.step(data[0]).result()
        began = time.perf_counter()
        loss = None
        for batch in data[1:-1]:
            loss = trainer.step(batch)
        if loss is not None:
            loss.result()
        # The last step alone, executor 0's resident set sampled every 2 ms: where in a step the peak is.
        with _Sampler(pids[0]) as timeline:
            loss = trainer.step(data[-1])
            last_loss = loss.result().item()
        elapsed = time.perf_counter() - began
        after = [status_field(pid, "VmHWM") for pid in pids]
        share = collective_share(ctx, trainer.runner.function.name, steps - 1)
        stats = ctx.stats()["executors"]
        high_water = [stats[e]["store_bytes_high_water"] for e in ctx.executor_ids]
        held = held_parameter_bytes(trainer)
        route = ctx.backend
    glibc = " [glibc default]" if not mmap_threshold_mb else ""
    return {"system": f"pathways {plan_name}{glibc}", "plan": plan_name.split(" ")[0], "backend": route,
            "peak_added_p": [(a - b) * 1024 / p_bytes for a, b in zip(after, before)],
            "store_high_water_p": [h / p_bytes for h in high_water],
            "rows_per_s": ROWS * (steps - 1) / elapsed if steps > 1 else None, "last_loss": last_loss,
            "param_bytes": p_bytes, "collective_share": share, "held_p": held / p_bytes,
            "timeline_p": [(ms, (rss - before[0]) * 1024 / p_bytes) for ms, rss in timeline.samples]}


def held_parameter_bytes(trainer) -> int:
    """The bytes of trained parameters one executor holds: its blocks of the step's flat buckets."""
    import math

    from pathways_torch.placement import local_shape

    return sum(math.prod(local_shape(a.shape, a.sharding.placements, a.sharding.mesh)) * a.dtype.itemsize
               for a in trainer.runner.flats)


def collective_share(ctx, step_name: str, last: int) -> float | None:
    """The share of executor 0's compute time in its ``last`` steps spent inside collectives (the trace's
    collective spans nested in each step's computation)."""
    with tempfile.TemporaryDirectory() as folder:
        events = ctx.trace(os.path.join(folder, "trace.json"))["traceEvents"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and e.get("pid") == 0 and e.get("name") == step_name)[-last:]
    collectives = [(e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and e.get("pid") == 0 and e.get("cat") == "collective"]
    total = sum(b - a for a, b in steps)
    inside = sum(d - c for c, d in collectives if any(a <= c and d <= b for a, b in steps))
    return inside / total if total else None


class _Sampler:
    """Samples one process's VmRSS (KiB) every 2 ms on a thread while the ``with`` block runs."""

    def __init__(self, pid: int):
        import threading

        self.pid, self.samples, self._stop = pid, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        time.sleep(0.05)
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        began = time.perf_counter()
        while not self._stop.is_set():
            rss = status_field(self.pid, "VmRSS")
            if rss is not None:
                self.samples.append(((time.perf_counter() - began) * 1000, rss))
            time.sleep(0.002)


def plot_timelines(results: list, path: str) -> str | None:
    """Executor 0's resident set through one step, one line per system of ours, in P above its level before
    the model was placed; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4))
    for r in results:
        if r.get("timeline_p"):
            axes.plot([ms for ms, _ in r["timeline_p"]], [p for _, p in r["timeline_p"]],
                      label=f"{r['plan']} ({r['backend']})")
    axes.set_xlabel("ms into the step")
    axes.set_ylabel("executor 0 resident set above its start (P)")
    axes.set_title("One training step's memory on one executor (N = 4, AdamW)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _warm_up(ctx, mesh) -> None:
    """One all-reduce of one float on the mesh: the backend and the process group exist before the baseline."""
    import torch

    import pathways_torch as pw

    @pw.function(out=pw.Replicate())
    def total(x):
        for axis in mesh.axes:           # every axis's group connected
            x = pw.all_reduce(x, axis)
        return x

    total(ctx.put(torch.ones(SIZE), mesh, pw.Shard(0))).result(timeout_s=600)


def _torch_rank(rank: int, mode: str, width: int, steps: int, store_path: str, results) -> None:
    import torch
    import torch.distributed as dist

    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)   # gloo's "connected to" lines
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, SIZE), rank=rank, world_size=SIZE)
    dist.all_reduce(torch.ones(1))   # as the executors' warm-up (`_warm_up`)
    before = status_field(os.getpid(), "VmHWM")
    model = make_model(width)
    p_bytes = param_bytes(model)
    if mode == "DDP":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (SIZE,))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = ROWS // SIZE
    began, last = None, None
    for index, (inputs, targets) in enumerate(batches(width, steps)):
        if index == 1:
            began = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(inputs[rank * rows:(rank + 1) * rows]),
                                            targets[rank * rows:(rank + 1) * rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        last = loss.detach()
    dist.all_reduce(last)
    elapsed = time.perf_counter() - began if began is not None else None
    results.put((rank, (status_field(os.getpid(), "VmHWM") - before) * 1024 / p_bytes, elapsed,
                 last.item() / SIZE, p_bytes))
    dist.barrier()
    os._exit(0)   # skip gloo's teardown (it can block once a peer has gone)


def measure_torch(mode: str, width: int, steps: int) -> dict:
    """``mode`` (DDP or FSDP2) in ``SIZE`` processes on gloo: per-rank peak added, in P."""
    rows = run_ranks(_torch_rank, SIZE, (mode, width, steps), "pathways-bench-sharding-")
    elapsed = rows[0][2]
    return {"system": f"torch {mode}", "plan": mode, "backend": "eager (gloo)",
            "peak_added_p": [r[1] for r in rows], "store_high_water_p": None,
            "rows_per_s": ROWS * (steps - 1) / elapsed if elapsed else None, "last_loss": rows[0][3],
            "param_bytes": rows[0][4]}


def _plan(name: str, model):
    """The plan a row measures: DataParallel, the per-unit sharded step, the gather-all one, per unit with
    each unit's parameters kept for its backward, or tensor parallelism (1 x 4, and 2 x 2 beside DataParallel)."""
    import pathways_torch as pw

    model_size = MESHES.get(name, {}).get("model", 1)
    return {"DataParallel": lambda: pw.DataParallel("data"),
            "TensorParallel 1x4": lambda: pw.TensorParallel(pw.tensor_parallel_plan(model, model_size)),
            "TensorParallel+DP 2x2": lambda: pw.TensorParallel(pw.tensor_parallel_plan(model, model_size),
                                                               data=pw.DataParallel("data")),
            "ShardedDataParallel": lambda: pw.ShardedDataParallel("data"),
            "ShardedDataParallel (gather-all)": lambda: pw.ShardedDataParallel("data", per_unit=False),
            "ShardedDataParallel (prefetch)": lambda: pw.ShardedDataParallel("data", prefetch=True),
            "ShardedDataParallel (keep for backward)":
                lambda: pw.ShardedDataParallel("data", reshard_after_forward=False)}[name]()


SYSTEMS = {
    "dp-eager": lambda a: measure_pathways("DataParallel", "eager", a.width, a.steps),
    "sdp-eager": lambda a: measure_pathways("ShardedDataParallel", "eager", a.width, a.steps),
    "sdp-all-eager": lambda a: measure_pathways("ShardedDataParallel (gather-all)", "eager", a.width, a.steps),
    "sdp-prefetch-eager": lambda a: measure_pathways("ShardedDataParallel (prefetch)", "eager", a.width, a.steps),
    "sdp-keep-eager": lambda a: measure_pathways("ShardedDataParallel (keep for backward)", "eager", a.width,
                                                 a.steps),
    # glibc's dynamic mmap threshold (executor_mmap_threshold_mb=0): what the executors' default saves, and costs.
    "dp-eager-glibc": lambda a: measure_pathways("DataParallel", "eager", a.width, a.steps, 0),
    "sdp-eager-glibc": lambda a: measure_pathways("ShardedDataParallel", "eager", a.width, a.steps, 0),
    "dp-xla": lambda a: measure_pathways("DataParallel", None, a.width, a.steps),
    "sdp-xla": lambda a: measure_pathways("ShardedDataParallel", None, a.width, a.steps),
    "sdp-all-xla": lambda a: measure_pathways("ShardedDataParallel (gather-all)", None, a.width, a.steps),
    "tp-eager": lambda a: measure_pathways("TensorParallel 1x4", "eager", a.width, a.steps),
    "tp-dp-eager": lambda a: measure_pathways("TensorParallel+DP 2x2", "eager", a.width, a.steps),
    "tp-xla": lambda a: measure_pathways("TensorParallel 1x4", None, a.width, a.steps),
    "tp-dp-xla": lambda a: measure_pathways("TensorParallel+DP 2x2", None, a.width, a.steps),
    "ddp": lambda a: measure_torch("DDP", a.width, a.steps),
    "fsdp2": lambda a: measure_torch("FSDP2", a.width, a.steps),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024, help="the Linear layers' width (1024: P = 64 MiB)")
    parser.add_argument("--steps", type=int, default=4, help="training steps per system (the first is untimed)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--json", default=None, help="where to write the results (default bench/results/sharding.json)")
    parser.add_argument("--png", default=None, help="where to draw executor 0's memory through one step "
                                                    "(default bench/results/sharding_timeline.png)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps: expected at least 2 (the first is untimed, the last is sampled), got {args.steps}")
    unknown = [s for s in args.systems.split(",") if s not in SYSTEMS]
    if unknown:
        parser.error(f"--systems: unknown {unknown}; expected some of {list(SYSTEMS)}")
    results = []
    for name in args.systems.split(","):
        print(f"== {name}", flush=True)
        results.append(SYSTEMS[name](args))
    p_mib = results[0]["param_bytes"] / 2**20
    print(f"\nPeak memory a training step adds per process, parameters included, in P = {p_mib:.1f} MiB "
          f"(N = {SIZE}, AdamW, {args.steps} steps; VmHWM after less VmHWM before the model is placed)")
    rows = []
    for r in results:
        peak = r["peak_added_p"]
        target = TARGETS.get(r["plan"])
        store = r["store_high_water_p"]
        rows.append([r["system"], r["backend"], f"{r['held_p']:.2f}" if r.get("held_p") is not None else "-",
                     f"{min(peak):.2f}-{max(peak):.2f}",
                     f"<= {target:.0f} P: {'met' if max(peak) <= target else 'missed'}" if target else "",
                     f"{max(store):.2f}" if store else "-",
                     f"{r['rows_per_s']:.0f}" if r["rows_per_s"] else "-",
                     f"{r['collective_share']:.0%}" if r.get("collective_share") is not None else "-",
                     f"{r['last_loss']:.6f}"])
    print_table(["system", "backend", "parameters held (P)", "peak added (P), per process", "target", "store high-water (P)",
                 "rows/s", "collective share", "last loss"], rows)
    for r in results:
        if r.get("timeline_p"):
            points = r["timeline_p"][::max(1, len(r["timeline_p"]) // 12)]
            print(f"{r['system']} ({r['backend']}), executor 0 through its last step (ms: P above start): "
                  + ", ".join(f"{ms:.0f}: {p:.2f}" for ms, p in points))
    png = plot_timelines(results, args.png or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                           "sharding_timeline.png"))
    if png:
        print(f"timeline: {png}")
    path = write_results("sharding", {"machine": machine(), "size": SIZE, "width": args.width, "steps": args.steps,
                                      "results": results}, args.json)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
