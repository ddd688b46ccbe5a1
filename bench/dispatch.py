"""The paper's Figure 5: dispatch throughput of trivial gang-scheduled computations.

One computation = a scalar all-reduce (max) followed by a scalar add on all N
executors, its output feeding the next input. Modes:
- OpByOp: one client call per computation, awaited before the next;
- Chained: one client call runs a program of 128 such nodes (128 sequence numbers);
- Fused: one function holding 128 computations (one sequence number).
Baseline in the same run: multi-controller (N processes running the loop
themselves with the same gloo all-reduce). Everything eager, one thread per process.
Ray and Monarch rows are measured when importable (not installed by default).
Metric: computations per second. Prints a table, writes bench/results/dispatch.json.

    .venv/bin/python -m bench.dispatch [--sizes 1,2,4,8] [--steps 200]
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch

import pathways_torch as pw
from bench.common import print_table, write_results
from bench.multicontroller import run_multicontroller

CHAIN = 128


@pw.function(out=pw.Replicate())
def step(x):
    return pw.all_reduce(x, axis="data", op="max") + 1


@pw.function(out=pw.Replicate())
def fused(x):
    for _ in range(CHAIN):
        x = pw.all_reduce(x, axis="data", op="max") + 1
    return x


@pw.program
def chained(x):
    for _ in range(CHAIN):
        x = step(x)
    return x


def _rate(run, x, repeats: int) -> float:
    """Computations per second of ``repeats`` awaited calls of ``run``, each holding CHAIN computations."""
    began = time.perf_counter()
    for _ in range(repeats):
        x = run(x)
        x.exception(timeout_s=300)
    return repeats * CHAIN / (time.perf_counter() - began)


def measure_pathways(size: int, steps: int, repeats: int) -> dict:
    with pw.Context(num_executors=size, backend="eager") as ctx:
        mesh = ctx.mesh({"data": size})
        x = ctx.put(torch.zeros(()), mesh, [pw.Replicate()])
        for _ in range(3):                       # warm-up: trace, load, form the group
            x = step(x)
        chained(x).exception(timeout_s=60)
        fused(x).exception(timeout_s=60)
        x.exception(timeout_s=60)

        began = time.perf_counter()
        y = x
        for _ in range(steps):
            y = step(y)
            y.exception(timeout_s=60)            # awaited: one computation per client call
        op_by_op = steps / (time.perf_counter() - began)

        chain_rate = _rate(chained, x, repeats)
        fused_rate = _rate(fused, x, repeats)
    return {"OpByOp": op_by_op, "Chained": chain_rate, "Fused": fused_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    rows, table = [], []
    for size in [int(s) for s in args.sizes.split(",")]:
        print(f"N={size}: pathways ...", flush=True)
        rates = measure_pathways(size, args.steps, args.repeats)
        print(f"N={size}: multi-controller ...", flush=True)
        rates["multi-controller"] = run_multicontroller(size, args.repeats * CHAIN * 2)
        for name in ("ray", "monarch"):
            rates[name] = None if importlib.util.find_spec(name) is None else float("nan")
        base = rates["multi-controller"]
        rows.append({"executors": size, **rates})
        table.append([size, f"{base:,.0f}"] + [f"{rates[m]:,.0f} ({rates[m] / base:.2f}x)"
                                               for m in ("OpByOp", "Chained", "Fused")]
                     + ["not installed" if rates[n] is None else "n/a" for n in ("ray", "monarch")])
    print_table(["N", "multi-controller /s", "OpByOp /s (vs MC)", "Chained /s (vs MC)", "Fused /s (vs MC)",
                 "Ray", "Monarch"], table)
    print("written to", write_results("dispatch", {"rows": rows, "chain": CHAIN}))


if __name__ == "__main__":
    main()
