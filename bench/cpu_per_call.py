"""CPU per dispatched computation, by thread: where an OpByOp call's (or a Chained node's) cores go.

Runs `bench.dispatch`'s computations (a scalar all-reduce + add) on N eager executors
and reads every thread's user + system CPU from ``/proc/PID/task/TID/stat`` before
and after a window of awaited calls, in the client process and in every executor's.
Our threads carry OS names (`pathways_torch.wire.threads`: ``pw-compute``,
``pw-controller`` …); libzmq's I/O thread is ``ZMQbg/IO/0``; a process's main thread
is ``main``. A thread inherits its creator's OS name: gloo's threads, made when the
compute thread forms a group, show as ``pw-compute (spawned)`` (any thread named like
an earlier one of its process). The clock ticks at 100 Hz, so a window should last
seconds. Each thread's wake-ups are counted too: the times it blocked in the window
(``voluntary_ctxt_switches`` in ``/proc/PID/task/TID/status``), per awaited call.
Prints a table of µs per computation and wake-ups per call, writes
bench/results/cpu_per_call.json.

Mode ``Hops`` counts a pipeline hop instead: a program of 128 nodes alternating between two single-executor
meshes (``x + 1`` on ``--hop-bytes`` of float32, 64 KB by default), so every node but the first waits for a copy
from the other executor. Its rows are per hop: the CPU of every thread and the wake-ups a copy costs on its way.
It runs ``--rounds`` interleaved rounds of three: the hop through the executors' shared-memory rings (the default),
the same hop over ZeroMQ (``PATHWAYS_SHM_RINGS=0``), and a Python pipe ping-pong of the same bytes one way
(`bench.pipe_pingpong`, the floor); it prints µs per hop and each hop's ratio to the pipe, per round.

    .venv/bin/python -m bench.cpu_per_call [--executors 4] [--calls 1500] [--mode OpByOp|Chained|Hops]
    .venv/bin/python -m bench.cpu_per_call --mode Hops [--hop-bytes 65536] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics

import torch

import pathways_torch as pw
from bench.common import print_table, process_cpu_s, timed_calls, write_results
from bench.dispatch import chained, step
from bench.gloo_loop import CHAIN
from tests.handles import cluster_of

def _thread_labels(pid: int):
    """(tid, label) of each thread of ``pid``, in creation order (see the module docstring for the labels)."""
    seen: set[str] = set()
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue   # the thread ended meanwhile
        yield int(tid), "main" if int(tid) == pid else f"{name} (spawned)" if name in seen else name
        seen.add(name)


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds so far of the threads of ``pid``, summed by label (see the module docstring)."""
    by_label: collections.Counter = collections.Counter()
    for tid, label in _thread_labels(pid):
        used = process_cpu_s(pid, tid)
        if used is not None:
            by_label[label] += used
    return dict(by_label)


def thread_wakeups(pid: int) -> dict[str, int]:
    """Times each thread of ``pid`` has blocked so far (its ``voluntary_ctxt_switches``), summed by label: a
    thread that blocks is woken once for each time it blocked, so the difference over a window counts wake-ups."""
    by_label: collections.Counter = collections.Counter()
    for tid, label in _thread_labels(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                switches = next(line for line in f if line.startswith("voluntary_ctxt_switches"))
        except (OSError, StopIteration):
            continue
        by_label[label] += int(switches.split()[1])
    return dict(by_label)


def _usage(pids: dict) -> dict:
    return {who: (thread_cpu_s(pid), thread_wakeups(pid)) for who, pid in pids.items()}


@pw.function(out=pw.Replicate())
def increment(x):
    return x + 1


def hops_program(ctx, nodes: int = CHAIN):
    """A program whose ``nodes`` nodes alternate between executors 0 and 1: ``nodes - 1`` copies a run; and the
    first node's mesh (tests/integration/test_shm_rings.py runs it too)."""
    meshes = [ctx.mesh({"data": 1}, executors=[0]), ctx.mesh({"data": 1}, executors=[1])]

    @pw.program
    def hops(x):
        for k in range(nodes):
            x = increment.on(meshes[k % 2])(x)
        return x

    return hops, meshes[0]


def measure(executors: int, calls: int, mode: str, backend: str = "eager", hop_bytes: int = 4) -> dict:
    if mode == "Hops":
        executors = 2
    with pw.Context(num_executors=executors, backend=backend) as ctx:
        if mode == "Hops":
            program, mesh = hops_program(ctx)
        else:
            program, mesh = chained, ctx.mesh({"data": executors})
        x = ctx.put(torch.zeros(hop_bytes // 4) if mode == "Hops" else torch.zeros(()), mesh, [pw.Replicate()])
        for _ in range(3):
            x = step(x) if mode != "Hops" else increment(x)
        for _ in range(2 if mode == "Hops" else 1):   # Hops: the first run's copies offer the rings
            program(x).exception(timeout_s=60)
        pids = {"client": os.getpid(), **{f"executor {i}": process.pid
                                          for i, process in enumerate(cluster_of(ctx).processes)}}
        per_call = {"OpByOp": 1, "Chained": CHAIN, "Hops": CHAIN - 1}[mode]
        run, count = (step, calls) if mode == "OpByOp" else (program, max(1, calls // per_call))
        before = _usage(pids)
        wall_s = timed_calls(run, x, count, awaited=True, timeout_s=600)
        after = _usage(pids)
    computations = count * per_call
    rows = []
    for who in pids:
        (cpu_after, wakes_after), (cpu_before, wakes_before) = after[who], before[who]
        for name in sorted(cpu_after, key=lambda n: -(cpu_after[n] - cpu_before.get(n, 0.0))):
            used = cpu_after[name] - cpu_before.get(name, 0.0)
            woken = wakes_after.get(name, 0) - wakes_before.get(name, 0)
            if used > 0 or woken > 0:
                rows.append({"process": who, "thread": name, "us_per_computation": used / computations * 1e6,
                             "wakeups_per_call": woken / count, "wakeups_per_computation": woken / computations})
    return {"executors": executors, "mode": mode, "backend": backend, "computations": computations, "calls": count,
            "per_second": computations / wall_s, "threads": rows, "hop_bytes": hop_bytes if mode == "Hops" else None}


def measure_hops(calls: int, hop_bytes: int, rounds: int) -> dict:
    """Interleaved rounds of the hop through rings, over ZeroMQ, and the pipe floor (module docstring)."""
    from executor.host_rings import RINGS_ENV

    from bench.pipe_pingpong import pipe_one_way_us

    def hop(rings: str) -> dict:
        os.environ[RINGS_ENV] = rings   # read by the executors this context starts
        try:
            return measure(2, calls, "Hops", hop_bytes=hop_bytes)
        finally:
            os.environ.pop(RINGS_ENV, None)

    kinds = {"rings": lambda: hop("1"), "zeromq": lambda: hop("0"), "pipe": lambda: pipe_one_way_us(hop_bytes)}
    per_round = []
    for index in range(rounds):
        order = list(kinds)[index % 3:] + list(kinds)[:index % 3]
        per_round.append({kind: kinds[kind]() for kind in order})
    return {"hop_bytes": hop_bytes, "rounds": per_round}


def _print_hops(result: dict) -> None:
    rows = []
    for index, r in enumerate(result["rounds"], start=1):
        pipe = r["pipe"]
        for kind in ("rings", "zeromq"):
            us = 1e6 / r[kind]["per_second"]
            cpu = sum(t["us_per_computation"] for t in r[kind]["threads"] if t["process"] != "client")
            wakes = sum(t["wakeups_per_computation"] for t in r[kind]["threads"])
            rows.append([str(index), kind, f"{us:.0f}", f"{pipe:.0f}", f"{us / pipe:.1f}", f"{cpu:.0f}",
                         f"{wakes:.2f}"])
    print(f"one hop of {result['hop_bytes']:,} bytes between two executors (a 128-node program), per round:")
    print_table(["round", "copies", "µs per hop", "pipe one way µs", "hop / pipe", "executors' CPU µs per hop",
                 "wake-ups per hop"], rows)
    for kind in ("rings", "zeromq"):
        ratios = sorted((1e6 / r[kind]["per_second"]) / r["pipe"] for r in result["rounds"])
        print(f"{kind}: hop / pipe median {statistics.median(ratios):.1f} ({ratios[0]:.1f}-{ratios[-1]:.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executors", type=int, default=4)
    parser.add_argument("--calls", type=int, default=1500, help="computations in the timed window")
    parser.add_argument("--mode", choices=("OpByOp", "Chained", "Hops"), default="OpByOp",
                        help="Hops: a copy between two executors per computation (--executors is 2)")
    parser.add_argument("--backend", default="eager", help="the executors' backend (eager: like the baselines)")
    parser.add_argument("--hop-bytes", type=int, default=65536, help="Hops: the bytes each copy carries")
    parser.add_argument("--rounds", type=int, default=3, help="Hops: interleaved rounds of rings, ZeroMQ, pipe")
    args = parser.parse_args()
    if args.mode == "Hops":
        result = measure_hops(args.calls, args.hop_bytes, args.rounds)
        _print_hops(result)
        print("written to", write_results("cpu_per_call_hops", result))
        return
    result = measure(args.executors, args.calls, args.mode, args.backend)
    print(f"{args.mode} on {args.backend}, N={result['executors']}: {result['computations']} computations, "
          f"{result['per_second']:,.0f}/s")
    print_table(["process", "thread", "CPU µs per computation", "wake-ups per call", "wake-ups per computation"],
                [[r["process"], r["thread"], f"{r['us_per_computation']:.0f}", f"{r['wakeups_per_call']:.2f}",
                  f"{r['wakeups_per_computation']:.2f}"] for r in result["threads"]])
    totals, wakeups, per_computation = (collections.defaultdict(float) for _ in range(3))
    for r in result["threads"]:
        totals[r["process"]] += r["us_per_computation"]
        wakeups[r["process"]] += r["wakeups_per_call"]
        per_computation[r["process"]] += r["wakeups_per_computation"]
    print("totals:", ", ".join(f"{who} {us:.0f} µs, {wakeups[who]:.1f} wake-ups" for who, us in totals.items()))
    print(f"per awaited call: {sum(wakeups.values()):.1f} thread wake-ups in {len(totals)} processes; per "
          f"{'hop' if args.mode == 'Hops' else 'computation'}: {sum(per_computation.values()):.2f}")
    print("written to", write_results("cpu_per_call", result))


if __name__ == "__main__":
    main()
