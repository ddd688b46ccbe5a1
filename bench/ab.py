"""An A/B of a benchmark against an older commit, interleaved in one run: is any column worse than before?

A change that only moves code (issue 48) must not slow what it moved. This runs ``bench.dispatch`` or
``bench.train`` (with the flags given after ``--``) alternately on this tree (new) and on a worktree of
``--old`` (old, default 18a88e1), ``--rounds`` times each, the order swapped every round (a run right after
another runs on a warmer machine). Each run is a fresh process tree with ``PYTHONPATH`` set to its own tree, so
its executors import that tree's code too; the old tree's native extension is built first.

Each column is a number the benchmark reports where higher is better (dispatch: computations per second, per
executor count and mode; train: tokens per second of the runtime, per executor count). A column is **worse**
when the new side's median is below the lowest old run: beyond the old side's own spread.

    .venv/bin/python -m bench.ab --bench dispatch --rounds 3 -- --sizes 2,4 --steps 100 --repeats 2 --rounds 2
    .venv/bin/python -m bench.ab --bench train --rounds 3 -- --sizes 1,2 --no-xla --no-memory

Prints a table, writes bench/results/ab_<bench>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from bench.common import print_table, write_results

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worktree(rev: str) -> str:
    """A worktree of ``rev`` (made once, kept under the temp folder), its native extension built."""
    path = os.path.join(tempfile.gettempdir(), f"pathways_ab_{rev[:12]}")
    if not os.path.isdir(os.path.join(path, "pathways_torch")):
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "--force", path, rev], check=True)
    subprocess.run([sys.executable, "-c", "from executor.build_extensions import main; main()"], cwd=path,
                   env=_env(path), check=True)
    return path


def _env(tree: str) -> dict:
    return {**os.environ, "PYTHONPATH": tree}


def run_once(tree: str, bench: str, flags: list[str]) -> dict:
    """One run of ``bench`` in ``tree``; its JSON results."""
    out = tempfile.mktemp(prefix=f"ab_{bench}_", suffix=".json")
    results = os.path.join(tree, "bench", "results", f"{bench}.json")
    subprocess.run([sys.executable, "-m", f"bench.{bench}", *flags], cwd=tree, env=_env(tree), check=True)
    shutil.copy(results, out)
    with open(out) as f:
        return json.load(f)


def columns(bench: str, results: dict) -> dict[str, float]:
    """The higher-is-better numbers of one run, by column name."""
    if bench == "dispatch":
        return {f"N={r['executors']} {mode} /s": rate for r in results["results"] for mode, rate in r["rates"].items()}
    return {f"N={r['executors']} {r['plan']} tokens/s": r["tokens_per_s"] for r in results["runtime"]}


def compare(old_runs: list[dict], new_runs: list[dict]) -> list[dict]:
    """Per column: the old runs' median and range, the new runs' median, their ratio, and whether new is worse
    than the old side's spread."""
    rows = []
    for name in old_runs[0]:
        old = [run[name] for run in old_runs if name in run]
        new = [run[name] for run in new_runs if name in run]
        if not old or not new:
            continue
        old_median, new_median = statistics.median(old), statistics.median(new)
        rows.append({"column": name, "old_median": old_median, "old_min": min(old), "old_max": max(old),
                     "new_median": new_median, "new_min": min(new), "new_max": max(new),
                     "new_over_old": new_median / old_median, "worse": new_median < min(old)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", choices=("dispatch", "train"), required=True)
    parser.add_argument("--old", default="18a88e1", help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side, alternating")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="after --: the benchmark's own flags")
    args = parser.parse_args()
    flags = [f for f in args.flags if f != "--"]
    old_tree = worktree(args.old)
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for index in range(args.rounds):
        order = (("old", old_tree), ("new", REPO)) if index % 2 == 0 else (("new", REPO), ("old", old_tree))
        for side, tree in order:
            print(f"round {index + 1}/{args.rounds}: {side} ({tree})", flush=True)
            runs[side].append(columns(args.bench, run_once(tree, args.bench, flags)))
    rows = compare(runs["old"], runs["new"])
    print_table(["column", f"old ({args.old}) median (range)", "new median (range)", "new / old", "worse?"],
                [[r["column"], f"{r['old_median']:,.0f} ({r['old_min']:,.0f}-{r['old_max']:,.0f})",
                  f"{r['new_median']:,.0f} ({r['new_min']:,.0f}-{r['new_max']:,.0f})", f"{r['new_over_old']:.2f}",
                  "WORSE" if r["worse"] else "no"] for r in rows])
    print("written to", write_results(f"ab_{args.bench}", {"old": args.old, "flags": flags, "rounds": args.rounds,
                                                          "runs": runs, "columns": rows}))


if __name__ == "__main__":
    main()
