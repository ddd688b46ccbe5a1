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
frozenlist``); it runs `bench/ray_baseline.py` in a subprocess. Monarch: likewise when
``PATHWAYS_MONARCH_PYTHONPATH`` names a directory where Monarch is importable
(``pip install --target DIR torchmonarch==0.7.0``, keeping the project's torch); it runs
`bench/monarch_baseline.py`. The last column compares our OpByOp with the faster of the
two baselines' OpByOp. Metric: computations per second. Prints a table, writes
bench/results/dispatch.json.

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


def _run_baseline(module: str, env_var: str, sizes: str, steps: int, repeats: int) -> dict[int, dict]:
    """Run ``bench.<module>`` in a subprocess with ``$env_var`` prepended to PYTHONPATH; its rows by N.

    A subprocess because each baseline framework lives outside the project's environment;
    no rows (the columns say "not run") when the variable is unset.
    """
    path = os.environ.get(env_var)
    if not path:
        return {}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, root]))
    subprocess.run([sys.executable, "-m", f"bench.{module}", "--sizes", sizes, "--steps", str(steps),
                    "--repeats", str(repeats)], cwd=root, env=env, check=True, capture_output=True, timeout=1200)
    with open(os.path.join(root, "bench", "results", f"{module}.json")) as f:
        return {row["executors"]: row for row in json.load(f)["rows"]}


def measure_ray(sizes: str, steps: int, repeats: int) -> dict[int, dict]:
    return _run_baseline("ray_baseline", "PATHWAYS_RAY_PYTHONPATH", sizes, steps, repeats)


def measure_monarch(sizes: str, steps: int, repeats: int) -> dict[int, dict]:
    return _run_baseline("monarch_baseline", "PATHWAYS_MONARCH_PYTHONPATH", sizes, steps, repeats)


def _baseline_cells(rates: dict, name: str) -> list[str]:
    op_by_op, fused = rates[f"{name} OpByOp"], rates[f"{name} Fused"]
    return [f"{op_by_op:,.0f}", f"{fused:,.0f}"] if op_by_op is not None else ["not run"] * 2


def _vs_best_baseline(rates: dict) -> str:
    """Our OpByOp over the faster baseline's OpByOp: the strongest comparison among those that ran."""
    baselines = [rates[f"{name} OpByOp"] for name in ("ray", "monarch") if rates[f"{name} OpByOp"] is not None]
    return f"{rates['OpByOp'] / max(baselines):.2f}x" if baselines else "not run"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, sizes="1,2,4,8", steps=200, repeats=4)
    args = parser.parse_args()
    rows, table = [], []
    # The baselines first, while nothing of ours is running to compete for the cores.
    print("ray ...", flush=True)
    baseline_rows = {"ray": measure_ray(args.sizes, args.steps, args.repeats)}
    print("monarch ...", flush=True)
    baseline_rows["monarch"] = measure_monarch(args.sizes, args.steps, args.repeats)
    for size in [int(s) for s in args.sizes.split(",")]:
        print(f"N={size}: pathways ...", flush=True)
        rates = measure_pathways(size, args.steps, args.repeats)
        print(f"N={size}: multi-controller ...", flush=True)
        rates["multi-controller"] = run_multicontroller(size, args.repeats * CHAIN * 2)
        for name, by_size in baseline_rows.items():
            row = by_size.get(size)
            rates[f"{name} OpByOp"] = row["OpByOp"] if row else None
            rates[f"{name} Fused"] = row["Fused"] if row else None
        base = rates["multi-controller"]
        rows.append({"executors": size, **rates})
        table.append([size, f"{base:,.0f}"]
                     + [f"{rates[m]:,.0f} ({rates[m] / base:.2f}x)" for m in ("OpByOp", "Chained", "Fused")]
                     + _baseline_cells(rates, "ray") + _baseline_cells(rates, "monarch") + [_vs_best_baseline(rates)])
    print_table(["N", "multi-controller /s", "OpByOp /s (vs MC)", "Chained /s (vs MC)", "Fused /s (vs MC)",
                 "Ray OpByOp /s", "Ray Fused /s", "Monarch OpByOp /s", "Monarch Fused /s",
                 "OpByOp / best baseline OpByOp"], table)
    print("written to", write_results("dispatch", {"rows": rows, "chain": CHAIN}))


if __name__ == "__main__":
    main()
