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
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (_ROOT, os.path.join(_ROOT, "examples")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

from bench.common import add_model_arguments, add_run_arguments, add_trace_dir_argument, write_results  # noqa: E402
from bench.fsdp2_train_baseline import fsdp2_memory  # noqa: E402
from bench.train_report import Measured, report_backends, report_memory, report_throughput  # noqa: E402
from bench.train_runtime import measure_backends, measure_runtime  # noqa: E402
from bench.train_setup import LR, SEED, make_batches, make_config, make_model  # noqa: E402
from bench.train_side_by_side import ddp_spec, measure_side_by_side  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def measure(args, cfg, batches, sizes: list[int], xla_sizes: list[int]) -> Measured:
    """Runtime, DDP and eager side by side at each N; the default backend against eager at each XLA size; the
    sharded plans' memory (and FSDP2's) at the largest N."""
    m = Measured(sizes=sizes, xla_sizes=xla_sizes)
    runtime, ddp, eager, ratios = m.runtime, m.ddp, m.eager, m.ratios
    xla, xla_eager, xla_ratios, memory = m.xla, m.xla_eager, m.xla_ratios, m.memory
    for size in sizes:
        print(f"N={size}: runtime (eager), DDP and eager 1-proc, {args.repeats} interleaved rounds ...", flush=True)
        runtime[size], ddp[size], eager[size], ratios[size] = measure_side_by_side(size, args, cfg, batches)
    for size in xla_sizes:
        print(f"N={size}: runtime, default backend vs eager, pinned, {args.repeats} interleaved rounds ...", flush=True)
        xla[size], xla_eager[size], xla_ratios[size] = measure_backends(size, args, cfg, batches)
    if sizes and not args.no_memory:
        largest = max(sizes)
        memory["DataParallel"] = runtime[largest]
        print(f"N={largest}: runtime (eager), ShardedDataParallel ...", flush=True)
        memory["ShardedDataParallel"] = measure_runtime(largest, "eager", "ShardedDataParallel", args, cfg, batches)
        print(f"N={largest}: torch FSDP2 (the sharded plan's reference) ...", flush=True)
        m.fsdp2 = fsdp2_memory(largest, ddp_spec(args, cfg))
        print(f"N={largest}: runtime (eager), ShardedDataParallel (gather-all) ...", flush=True)
        memory["ShardedDataParallel (gather-all)"] = measure_runtime(largest, "eager",
                                                                     "ShardedDataParallel (gather-all)", args, cfg,
                                                                     batches)
    return m


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
    m = measure(args, cfg, batches, sizes, xla_sizes)
    report_throughput(args, m)
    report_backends(args, m)
    report_memory(m, num_params)

    elapsed = time.perf_counter() - started
    path = write_results("train", {
        "config": {"width": cfg.width, "depth": cfg.depth, "heads": cfg.heads, "length": cfg.length,
                   "vocab": cfg.vocab, "context": cfg.context, "batch": args.batch, "steps": args.steps,
                   "warmup": args.warmup, "repeats": args.repeats, "lr": LR, "seed": SEED,
                   "parameters": num_params, "tokens_per_step": args.batch * cfg.context},
        "eager": [m.eager[n] for n in sizes], "runtime": [m.runtime[n] for n in sizes],
        "ddp": [m.ddp[n] for n in sizes], "ratios": [{"executors": n, **m.ratios[n]} for n in sizes],
        "xla": [m.xla[n] for n in xla_sizes], "xla_eager_pinned": [m.xla_eager[n] for n in xla_sizes],
        "xla_ratios": [{"executors": n, **m.xla_ratios[n]} for n in xla_sizes], "memory": {k: {kk: v[kk] for kk in (
            "executors", "pids", "vmhwm_start_kib", "vmhwm_kib", "store_bytes", "tokens_per_s")}
            for k, v in m.memory.items()}, "fsdp2_memory": m.fsdp2,
        "elapsed_s": elapsed})
    print(f"\nwritten to {path} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
