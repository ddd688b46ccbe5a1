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
   transfers between stage meshes follow the schedule (`pipeline.build.PipelineBuild`'s wiring, one
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
import os
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (_ROOT, os.path.join(_ROOT, "examples")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

from bench.common import add_backend_argument, add_model_arguments, add_quick_and_json  # noqa: E402
from bench.common import add_trace_dir_argument, write_results  # noqa: E402
from bench.pipeline_real import measure_real, report_real  # noqa: E402
from bench.pipeline_sim import measure_sim, report_sim  # noqa: E402

SIZES = {"small": (64, 64), "large": (128, 512)}   # (width, global batch) of the real executors' model


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
