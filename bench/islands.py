"""Two islands vs one island of the same total size: tokens/s of data-parallel training across islands, and what
the link between them costs.

The same training everywhere: `bench/train.py`'s Transformer (`examples/transformer.py`, reversal task, dropout
0, `bench/train_setup.py`'s ``make_config`` / ``make_model``: the same initial weights, AdamW), the same global batches
(``ReverseTask(cfg, 0).batch(i, B)``, batch i at step i), the same backend (the runtime's default, or
``--backend``), ``executor_threads=1``, every executor pinned (executor i of a context on core i mod the core
count), ``torch.set_num_threads(1)`` in the client. Configurations:

- one island of N: ``pw.Context(num_executors=N)``, ``ctx.mesh({"data": N})``, ``pw.DataParallel("data")``;
- I islands of D: ``pw.Context(islands=[D] * I, link=...)``, ``ctx.mesh({"island": I, "data": D})``,
  ``pw.DataParallel(("island", "data"))`` (reduce-scatter inside each island, the slices sent to the same-rank
  executors of the other islands as program transfers, averaged, all-gathered, applied); ``link=None``: the
  islands' executors talk directly; ``pw.Link()``: through the relay, unshaped; ``pw.Link(delay_s,
  bandwidth_bytes_per_s)``: shaped.

Groups, each compared with its own one-island reference in the same rounds:

(a) gated: 1 + 1 islands (direct, and relayed unshaped) vs one island of 2 — target >= 0.97 relayed unshaped
    (the Pathways paper's 97.2 %);
(b) 2 x 2 islands (relayed unshaped, and direct) vs one island of 4 (reported; two cores for four executors);
(c) 1 + 1 islands at several link shapes (``--shapes``), with the unshaped relay and the one island of 2 in the
    same rounds, so that the fall of the ratio with bandwidth and delay is read side by side.

Method. Every executor is a process importing JAX/torchax (about 1.1 GB resident), so a group's contexts are kept
open together when this machine's available memory allows (``--method open``, the default when it fits: a
context shared by consecutive groups stays open between them), else each window gets its own context (``--method
alternate``: for round r, open each context, warm up, run its window, close). Each context is warmed up
(``--warmup`` steps waited for; the first step — capture, loading, compiling — is reported); then ``--rounds``
rounds, each one window of ``--steps`` steps per configuration (dispatched back to back; the window ends when the
last loss and every island's updated state are ready), the order rotated by one each round, a short pause and a
``gc.collect()`` before each window. Tokens/s = steps x batch x context / window; a configuration's tokens/s is
the median of its windows, its ratio to one island the median (min-max) of the per-round ratios.

Per configuration also:
- bytes crossing the link per step: ``ctx.link.bytes_relayed`` over the timed windows / their steps (every byte
  the relay wrote, both directions); theory: each of the I x D executors sends its 1/D slice of its island's
  reduced gradient (G bytes: the flat gradient buckets, padded to D) to its counterpart in each of the I - 1 other
  islands, so I x D x (I - 1) x G / D = I (I - 1) G bytes per step (2 G for two islands, whatever D) — the same
  as the bandwidth-optimal all-reduce between I parties, 2 (I - 1) / I x G x I, when I = 2;
- the exchange wait per step, from the executors' trace (``ctx.trace``): on each executor, the start of its
  ``island_update`` minus the end of the last of its ``island_grads[k]`` segments of the same step (the backward
  is cut per gradient bucket, ``--bucket-mb``; mean over executors, per step), split into the wait for the other
  island's backward to end (skew) and the time after the last island's backward ended (the last transfers and
  their hand-off); the link transfers' send-to-receive times; and the share of that transfer time during which
  the receiving executor was still computing (its own backward: the exchange hidden behind compute; a bucket's
  slice leaves as soon as its segment ends, so only the last bucket's transfer cannot be hidden);
- what a lone `LinkRelay` of each shape delivers (``relay_rate``: one loopback connection, no executors, measured
  before the groups), so that the link shapes' cost can be modelled at the rate the relay achieves as well as at
  the nominal one;
- the last loss, and the largest |loss difference| to the group's one-island run at the steps both ran: the same
  weights on the same batches, so they must agree to ``LOSS_TOLERANCE`` (checked: the benchmark exits 1 if not,
  after writing its results).

The per-round ratios, not the absolute rates, are what to read: this machine's speed drifts.
Prints tables and writes bench/results/islands.json (or ``--json PATH``).

    .venv/bin/python -m bench.islands [--quick] [--json PATH] [--backend eager] [--rounds 5] [--steps 10]
                                      [--shapes 1000:0,100:0,10:0,1000:1,1000:5,100:5] [--no-2x2]
                                      [--groups gated,shapes,2x2]
                                      [--method auto|open|alternate] [--trace-dir DIR]
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
from bench.islands_link import relay_rate  # noqa: E402
from bench.islands_report import LOSS_TOLERANCE, TARGET, report, summarize  # noqa: E402
from bench.islands_run import measure  # noqa: E402
from bench.islands_setups import (available_memory, choose_method, describe_link, make_groups,  # noqa: E402
                                  open_executors, parse_shapes)

DEFAULT_SHAPES = "1000:0,100:0,10:0,1000:1,1000:5,100:5"   # MB/s : ms one-way
RATE_PROBE_BYTES = 16 * 2**20   # bytes sent through a lone relay to see what rate a shape achieves ...
RATE_PROBE_S = 0.5              # ... at most this long at the nominal rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick_and_json(parser, "islands",
                       quick_help="2 rounds of 4 steps, one link shape (100 MB/s, 1 ms), no 2 x 2 (under two minutes)")
    add_backend_argument(parser)
    add_model_arguments(parser, width=128, depth=4, batch=128, batch_help="global batch (rows); divisible by 4")
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="the gradient buckets exchanged between islands, MB (pw.DataParallel's bucket_mb)")
    parser.add_argument("--steps", type=int, default=None, help="steps per timed window (default 10, quick 4)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3, quick 2)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5, quick 2)")
    parser.add_argument("--shapes", default=None,
                        help=f"link shapes MB/s:ms, comma-separated (default {DEFAULT_SHAPES}; quick 100:1)")
    parser.add_argument("--no-2x2", dest="with_2x2", action="store_false", help="skip 2 x 2 vs one island of 4")
    parser.add_argument("--groups", default="gated,shapes,2x2",
                        help="which groups to run, comma-separated: gated (a), 2x2 (b), shapes (c)")
    parser.add_argument("--method", choices=("auto", "open", "alternate"), default="auto",
                        help="keep a group's contexts open together, or one context per window (auto: by memory)")
    add_trace_dir_argument(parser)
    args = parser.parse_args()
    quick = args.quick
    args.steps = args.steps or (4 if quick else 10)
    args.warmup = args.warmup or (2 if quick else 3)
    args.rounds = args.rounds or (2 if quick else 5)
    if quick:
        args.with_2x2 = False
    try:
        shapes = parse_shapes(args.shapes or ("100:1" if quick else DEFAULT_SHAPES))
    except ValueError as exc:
        parser.error(str(exc))
    if args.batch % 4:
        parser.error(f"--batch {args.batch}: must divide by 4 (2 islands x 2 executors, and one island of 4)")
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1:
        parser.error("--steps, --warmup and --rounds: at least 1")
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)

    torch.set_num_threads(1)
    started = time.perf_counter()
    load_before = os.getloadavg()
    kinds = {k.strip() for k in args.groups.split(",") if k.strip()}
    if not kinds or kinds - {"gated", "shapes", "2x2"}:
        parser.error(f"--groups: expected some of gated, shapes, 2x2, got {args.groups!r}")
    setups, groups = make_groups(shapes, args.with_2x2 and "2x2" in kinds)
    groups = [g for g in groups if g["kind"] in kinds]
    setups = {k: v for k, v in setups.items() if any(k in g["keys"] for g in groups)}
    method, why = choose_method(args.method, max(open_executors(groups, setups)), available_memory())
    print(f"{len(setups)} configurations in {len(groups)} groups; method: {method} ({why})", flush=True)
    by_link = {}
    for setup in setups.values():
        if setup.link is not None and setup.link not in by_link:
            nominal = setup.link.bandwidth_bytes_per_s
            size = int(min(RATE_PROBE_BYTES, (nominal or 1e12) * RATE_PROBE_S))
            by_link[setup.link] = relay_rate(setup.link, size)
            print(f"  a lone relay, {describe_link(setup.link)}: {by_link[setup.link] / 1e6:,.0f} MB/s "
                  f"({size:,} bytes, one connection)", flush=True)
    rates = {key: by_link[setup.link] for key, setup in setups.items() if setup.link is not None}
    with tempfile.TemporaryDirectory() as scratch:
        measured = measure(args, setups, groups, method, args.trace_dir or scratch)
    summary = summarize(measured, args, rates)
    report(summary, setups, args, method, why)
    elapsed = time.perf_counter() - started
    load_after = os.getloadavg()
    print(f"load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f} on {os.cpu_count()} cores "
          f"(other work on this machine shows here and in the spread of the per-round ratios)")
    failures = [f"{k} in {g['name']}: |loss difference| {c['loss_difference']:.2e} over {c['loss_steps_compared']} "
                f"steps" for g in summary["groups"] for k, c in g["configs"].items()
                if c["loss_difference"] is not None and c["loss_difference"] > LOSS_TOLERANCE]
    payload = {"args": vars(args), "method": method, "method_why": why,
               "load_average_before": load_before, "load_average_after": load_after,
               "target": TARGET, "loss_tolerance": LOSS_TOLERANCE, "loss_failures": failures, **summary,
               "elapsed_s": elapsed}
    path = write_results("islands", payload, args.json, default=str)
    print(f"\nwritten to {path} ({elapsed:.0f} s)")
    if failures:
        print("LOSSES DISAGREE (same weights, same batches): " + "; ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
