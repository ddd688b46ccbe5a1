"""The paper's Figure 5: dispatch throughput of trivial gang-scheduled computations.

One computation = a scalar all-reduce (max) followed by a scalar add on all N
executors, its output feeding the next input. Modes:
- OpByOp: one client call per computation, awaited before the next;
- Chained: one client call runs a program of 128 such nodes (128 sequence numbers);
- Fused: one function holding 128 computations (one sequence number).
Baseline in the same run: multi-controller (N processes running the loop
themselves with the same gloo all-reduce). Everything eager, one thread per process.
Ray: measured in the same run when ``PATHWAYS_RAY_PYTHONPATH`` names a directory where
Ray is importable (``pip install --target DIR ray msgpack click jsonschema aiosignal
frozenlist``); it runs `bench/ray_baseline.py` in a subprocess. Monarch: not measured.
Metric: computations per second. Prints a table, writes bench/results/dispatch.json.

    .venv/bin/python -m bench.dispatch [--sizes 1,2,4,8] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

import pathways_torch as pw
from bench.common import add_run_arguments, print_table, write_results
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


def measure_ray(sizes: str, steps: int, repeats: int) -> dict[int, dict]:
    """Run the Ray baseline in a subprocess (Ray lives outside the project's environment)."""
    path = os.environ.get("PATHWAYS_RAY_PYTHONPATH")
    if not path:
        return {}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, root]))
    subprocess.run([sys.executable, "-m", "bench.ray_baseline", "--sizes", sizes, "--steps", str(steps),
                    "--repeats", str(repeats)], cwd=root, env=env, check=True, capture_output=True, timeout=1200)
    with open(os.path.join(root, "bench", "results", "ray_baseline.json")) as f:
        return {row["executors"]: row for row in json.load(f)["rows"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, sizes="1,2,4,8", steps=200, repeats=4)
    args = parser.parse_args()
    rows, table = [], []
    print("ray ...", flush=True)
    ray_rows = measure_ray(args.sizes, args.steps, args.repeats)
    for size in [int(s) for s in args.sizes.split(",")]:
        print(f"N={size}: pathways ...", flush=True)
        rates = measure_pathways(size, args.steps, args.repeats)
        print(f"N={size}: multi-controller ...", flush=True)
        rates["multi-controller"] = run_multicontroller(size, args.repeats * CHAIN * 2)
        ray_row = ray_rows.get(size)
        rates["ray OpByOp"] = ray_row["OpByOp"] if ray_row else None
        rates["ray Fused"] = ray_row["Fused"] if ray_row else None
        base = rates["multi-controller"]
        rows.append({"executors": size, **rates})
        ray_cells = ([f"{rates['ray OpByOp']:,.0f}", f"{rates['ray Fused']:,.0f}",
                      f"{rates['OpByOp'] / rates['ray OpByOp']:.2f}x"] if ray_row else ["not run"] * 3)
        table.append([size, f"{base:,.0f}"] + [f"{rates[m]:,.0f} ({rates[m] / base:.2f}x)"
                                               for m in ("OpByOp", "Chained", "Fused")] + ray_cells)
    print_table(["N", "multi-controller /s", "OpByOp /s (vs MC)", "Chained /s (vs MC)", "Fused /s (vs MC)",
                 "Ray OpByOp /s", "Ray Fused /s", "OpByOp / Ray OpByOp"], table)
    print("written to", write_results("dispatch", {"rows": rows, "chain": CHAIN}))


if __name__ == "__main__":
    main()
