"""CPU per dispatched computation, by thread: where an OpByOp call's (or a Chained node's) cores go.

Runs `bench.dispatch`'s computations (a scalar all-reduce + add) on N eager executors
and reads every thread's user + system CPU from ``/proc/PID/task/TID/stat`` before
and after a window of awaited calls, for the client process and for executor 0 (the
others run the same code). Our threads carry OS names (`pathways_torch.wire.threads`:
``pw-compute``, ``pw-controller`` …); libzmq's I/O thread is ``ZMQbg/IO/0``; a process's
main thread is ``main``. A thread inherits its creator's OS name: gloo's threads, made
when the compute thread forms a group, show as ``pw-compute (spawned)`` (any thread
named like an earlier one of its process). The clock ticks at 100 Hz, so a window
should last seconds. Prints a table of µs per computation, writes
bench/results/cpu_per_call.json.

    .venv/bin/python -m bench.cpu_per_call [--executors 4] [--calls 1500] [--mode OpByOp|Chained]
"""

from __future__ import annotations

import argparse
import collections
import os

import torch

import pathways_torch as pw
from bench.common import print_table, process_cpu_s, timed_calls, write_results
from bench.dispatch import chained, step
from bench.gloo_loop import CHAIN

def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds so far of the threads of ``pid``, summed by label (see the module docstring)."""
    by_label: collections.Counter = collections.Counter()
    seen: set[str] = set()
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):   # creation order
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue   # the thread ended meanwhile
        used = process_cpu_s(pid, int(tid))
        if used is None:
            continue
        label = "main" if int(tid) == pid else f"{name} (spawned)" if name in seen else name
        seen.add(name)
        by_label[label] += used
    return dict(by_label)


def measure(executors: int, calls: int, mode: str) -> dict:
    with pw.Context(num_executors=executors, backend="eager") as ctx:
        mesh = ctx.mesh({"data": executors})
        x = ctx.put(torch.zeros(()), mesh, [pw.Replicate()])
        for _ in range(3):
            x = step(x)
        chained(x).exception(timeout_s=60)
        pids = {"client": os.getpid(), "executor 0": ctx._cluster.processes[0].pid}
        run, count, per_call = (step, calls, 1) if mode == "OpByOp" else (chained, max(1, calls // CHAIN), CHAIN)
        before = {who: thread_cpu_s(pid) for who, pid in pids.items()}
        wall_s = timed_calls(run, x, count, awaited=True, timeout_s=600)
        after = {who: thread_cpu_s(pid) for who, pid in pids.items()}
    computations = count * per_call
    rows = []
    for who in pids:
        for name in sorted(after[who], key=lambda n: -(after[who][n] - before[who].get(n, 0.0))):
            used = after[who][name] - before[who].get(name, 0.0)
            if used > 0:
                rows.append({"process": who, "thread": name, "us_per_computation": used / computations * 1e6})
    return {"executors": executors, "mode": mode, "computations": computations,
            "per_second": computations / wall_s, "threads": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executors", type=int, default=4)
    parser.add_argument("--calls", type=int, default=1500, help="computations in the timed window")
    parser.add_argument("--mode", choices=("OpByOp", "Chained"), default="OpByOp")
    args = parser.parse_args()
    result = measure(args.executors, args.calls, args.mode)
    print(f"{args.mode}, N={args.executors}: {result['computations']} computations, "
          f"{result['per_second']:,.0f}/s")
    print_table(["process", "thread", "CPU µs per computation"],
                [[r["process"], r["thread"], f"{r['us_per_computation']:.0f}"] for r in result["threads"]])
    totals = collections.defaultdict(float)
    for r in result["threads"]:
        totals[r["process"]] += r["us_per_computation"]
    print("totals:", ", ".join(f"{who} {us:.0f} µs" for who, us in totals.items()),
          f"(each of the {args.executors} executors runs the same code)")
    print("written to", write_results("cpu_per_call", result))


if __name__ == "__main__":
    main()
