"""Many clients of one standalone controller: aggregate throughput, proportional shares, a device timeline
(the Pathways paper's Figures 8 and 9).

One `pathways-controller` serves 8 simulated executors (``--backend sim``: no torch there). The clients are
separate processes (``python -m bench.multitenancy --as-client NAME``), started once (torch is imported once)
and driven by the benchmark over their stdin and stdout, one JSON line per command: connect to a controller,
register a program, run a phase, write a trace, disconnect. A "program of X ms" is one call of a
``pw.function(sim_time_s=X/1000, name="work_<client>")`` on a mesh of all 8 executors: each call occupies every
executor for X ms, so device utilisation = aggregate calls/s x X / 1000. In a phase every participating client
issues calls back to back from a common wall-clock start, with at most ``--outstanding`` of its calls unfinished
(the oldest is waited for, in order, when the bound is reached); a call counts once the client sees its output
settle. Nothing is counted during the first ``--warmup-s``; then the window of ``--window-s`` counts the calls
whose completion the client saw inside it (issuing stops at the window's end; the rest drain uncounted).

(a) computations/s summed over 1, 2, 4, 8 and 16 clients (``--clients``) at programs of 0.04, 0.33, 1 and 2.4 ms
    (``--programs-ms``); with each configuration the CPU (user + system, in cores) that the controller, its 8
    executors and the clients used over the window, from /proc;
(b) 4 clients (c0..c3) backlogged for ``--share-s`` on a fresh controller (restarted per setting, so each trace
    holds that setting alone) at weights 1:1:1:1 and 1:2:4:8, for each of ``--share-ms``; then c0 gathers the
    executors' trace (``ctx.trace``: the executors' own timestamps). Each client's device time is the sum over
    executors of its ``work_<client>`` computations, clipped to the window where all four were running (the
    intersection of their computations' spans and of the measured window); its share = its time / the four's;
(c) a PNG in the style of Figure 9 from the 1:2:4:8 trace of the last ``--share-ms``: one row per executor, one
    colour per client, 100 ms from the middle of that window (bench/results/ and docs/images/multitenancy.png).

Targets: every share within 3 points of its weight's share; device utilisation >= 90 % with 4 or more clients
of 0.33 ms programs; 16 clients' aggregate throughput >= one client's (at each program size).
Prints tables and verdicts, writes bench/results/multitenancy.json (or ``--json PATH``).

    .venv/bin/python -m bench.multitenancy [--clients 1,2,4,8,16] [--programs-ms 0.04,0.33,1,2.4]
        [--share-ms 0.33,2.4] [--warmup-s 1] [--window-s 3] [--share-s 10] [--outstanding 64] [--trace-dir DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from bench.common import RESULTS_DIR, add_trace_dir_argument, print_table, process_cpu_s, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXECUTORS = 8
READY = "pathways-controller: serving clients at "
MARK = "MT "                       # a client's protocol lines on its stdout start with this
SHARE_WEIGHTS = {"1:1:1:1": (1, 1, 1, 1), "1:2:4:8": (1, 2, 4, 8)}
SHARE_TOLERANCE_POINTS = 3.0
UTILISATION_TARGET = 0.90
TIMELINE_MS = 100.0
START_MARGIN_S = 0.4               # a phase starts this long after its command is sent: every client is waiting


# ------------------------------------------------------------ analysis (pure)

def weight_shares(weights: dict[str, float]) -> dict[str, float]:
    total = sum(weights.values())
    return {name: w / total for name, w in weights.items()}


def client_of(event_name: str) -> str | None:
    """``"work_c3"`` → ``"c3"``; None for anything else."""
    return event_name[len("work_"):] if event_name.startswith("work_") else None


def compute_events(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "compute"
            and client_of(e.get("name", "")) is not None]


def activity_spans(events: list[dict]) -> dict[str, tuple[float, float]]:
    """Each client's first computation start and last computation end (µs)."""
    spans: dict[str, tuple[float, float]] = {}
    for e in events:
        name = client_of(e["name"])
        lo, hi = spans.get(name, (float("inf"), float("-inf")))
        spans[name] = (min(lo, e["ts"]), max(hi, e["ts"] + e["dur"]))
    return spans


def intersect(spans) -> tuple[float, float] | None:
    """The interval common to all ``spans`` ((lo, hi) pairs); None if they do not all overlap."""
    spans = list(spans)
    if not spans:
        return None
    lo, hi = max(s[0] for s in spans), min(s[1] for s in spans)
    return (lo, hi) if lo < hi else None


def device_time(events: list[dict], window: tuple[float, float]) -> dict[str, float]:
    """Each client's computation time (µs, summed over executors) inside ``window``, events clipped to it."""
    lo, hi = window
    totals: dict[str, float] = collections.defaultdict(float)
    for e in events:
        overlap = min(hi, e["ts"] + e["dur"]) - max(lo, e["ts"])
        if overlap > 0:
            totals[client_of(e["name"])] += overlap
    return dict(totals)


def measured_shares(times: dict[str, float], clients) -> dict[str, float]:
    total = sum(times.get(c, 0.0) for c in clients)
    return {c: (times.get(c, 0.0) / total if total else 0.0) for c in clients}


def share_rows(weights: dict[str, float], measured: dict[str, float]) -> list[dict]:
    expected = weight_shares(weights)
    return [{"client": c, "weight": weights[c], "weight_share": expected[c], "measured_share": measured.get(c, 0.0),
             "diff_points": 100.0 * (measured.get(c, 0.0) - expected[c])} for c in weights]


def utilisation(calls_per_s: float, program_ms: float) -> float:
    """Busy fraction of the executors: every call occupies all of them for ``program_ms``."""
    return calls_per_s * program_ms / 1000.0


def in_window(times, lo: float, hi: float) -> int:
    return sum(1 for t in times if lo <= t < hi)


def timeline(events: list[dict], window: tuple[float, float]) -> dict[int, list[tuple[float, float, str]]]:
    """Per executor row (pid): (start ms from the window's start, duration ms, client), clipped to ``window``."""
    lo, hi = window
    rows: dict[int, list] = collections.defaultdict(list)
    for e in sorted(events, key=lambda e: e["ts"]):
        start, end = max(lo, e["ts"]), min(hi, e["ts"] + e["dur"])
        if end > start:
            rows[e["pid"]].append(((start - lo) / 1000.0, (end - start) / 1000.0, client_of(e["name"])))
    return dict(rows)


def verdict(target: str, met: bool, detail: str) -> str:
    return f"target {target}: {'met' if met else 'MISSED'} ({detail})"


def verdicts(throughput: list[dict], shares: list[dict], clients: list[int]) -> list[str]:
    out = []
    for s in shares:
        worst = max(s["rows"], key=lambda r: abs(r["diff_points"]))
        out.append(verdict(f"shares within {SHARE_TOLERANCE_POINTS:g} points at {s['weights']}, {s['program_ms']:g} ms",
                           abs(worst["diff_points"]) <= SHARE_TOLERANCE_POINTS,
                           f"worst {worst['client']}: {worst['diff_points']:+.1f} points"))
    for r in throughput:
        if r["program_ms"] == 0.33 and r["clients"] >= 4:
            out.append(verdict(f"utilisation >= {UTILISATION_TARGET:.0%}, {r['clients']} clients of 0.33 ms",
                               r["utilisation"] >= UTILISATION_TARGET, f"{r['utilisation']:.1%}"))
    if 1 in clients and 16 in clients:
        for ms in sorted({r["program_ms"] for r in throughput}):
            one, many = (next(r for r in throughput if r["program_ms"] == ms and r["clients"] == n) for n in (1, 16))
            out.append(verdict(f"16 clients >= 1 client at {ms:g} ms", many["per_s"] >= one["per_s"],
                               f"{many['per_s']:,.0f}/s vs {one['per_s']:,.0f}/s, x{many['per_s'] / one['per_s']:.2f}"))
    return out


# ------------------------------------------------------------ a client process

def client_main(name: str) -> None:
    """Serve commands from stdin, one JSON line each; answer each with one ``MT {json}`` line on stdout."""
    import torch

    import pathways_torch as pw

    torch.set_num_threads(1)
    ctx = x = None
    functions = {}

    def answer(**reply):
        print(MARK + json.dumps(reply), flush=True)

    answer(op="ready", pid=os.getpid())
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "connect":
            ctx = pw.Context(controller=cmd["address"], keys=cmd["keys"])
            mesh = ctx.mesh({"data": EXECUTORS})
            x, functions = ctx.put(torch.zeros(EXECUTORS), mesh, [pw.Shard(0)]), {}
            answer(op=op, executors=len(ctx.executor_ids))
        elif op == "prepare":        # register the program and run it once, before any phase counts
            ms = cmd["program_ms"]
            functions[ms] = pw.function(lambda v: v + 1, name=f"work_{name}", sim_time_s=ms / 1000.0)
            functions[ms](x).result(timeout_s=120)
            answer(op=op)
        elif op == "phase":
            answer(op=op, **run_phase(functions[cmd["program_ms"]], x, cmd))
        elif op == "trace":
            answer(op=op, events=len(ctx.trace(cmd["path"])["traceEvents"]))
        elif op == "disconnect":
            ctx.close()
            ctx = x = None
            answer(op=op)
        elif op == "exit":
            break
    if ctx is not None:
        ctx.close()


def run_phase(fn, x, cmd: dict) -> dict:
    start = cmd["start"]
    lo, hi = start + cmd["warmup_s"], start + cmd["warmup_s"] + cmd["window_s"]
    late = time.time() - start
    if late < 0:
        time.sleep(-late)
    pending, completions, failed, issued = collections.deque(), [], 0, 0
    limit = cmd["outstanding"]

    def settle():
        nonlocal failed
        failed += pending.popleft().exception(timeout_s=120) is not None
        completions.append(time.time())

    while time.time() < hi:
        pending.append(fn(x))
        issued += 1
        while pending and (len(pending) >= limit or pending[0].done()):
            settle()
    ended = time.time()
    while pending:
        settle()
    return {"issued": issued, "failed": failed, "in_window": in_window(completions, lo, hi),
            "completed": len(completions), "late_s": max(0.0, late), "drain_s": time.time() - ended}


# ------------------------------------------------------------ the benchmark's side

class Client:
    """One client process, its replies read by a thread into a queue."""

    def __init__(self, name: str, log_dir: str):
        self.name = name
        self.log = open(os.path.join(log_dir, f"{name}.log"), "w")
        self.process = subprocess.Popen([sys.executable, "-m", "bench.multitenancy", "--as-client", name], cwd=ROOT,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.startswith(MARK):
                self.replies.put(json.loads(line[len(MARK):]))
        self.replies.put(None)

    def send(self, **cmd) -> None:
        self.process.stdin.write(json.dumps(cmd) + "\n")
        self.process.stdin.flush()

    def reply(self, timeout_s: float = 300.0) -> dict:
        try:
            got = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            got = None
        if got is None:
            self.log.flush()
            with open(self.log.name) as f:
                raise RuntimeError(f"client {self.name} gave no answer; its log ends:\n{f.read()[-3000:]}")
        return got

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.send(op="exit")
                self.process.stdin.close()
                self.process.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self.log.close()


def ask(clients: list[Client], **cmd) -> list[dict]:
    """Send ``cmd`` to every client at once, then collect their answers."""
    for c in clients:
        c.send(**cmd)
    return [c.reply() for c in clients]


class Controller:
    """``pathways-controller`` serving 8 sim executors at a free loopback port, with ``weights``."""

    def __init__(self, keys_dir: str, weights: dict[str, float]):
        command = [sys.executable, "-m", "pathways_torch.launch.controller_main", "--keys-dir", keys_dir,
                   "--bind", "tcp://127.0.0.1:0", "--num-executors", str(EXECUTORS), "--backend", "sim",
                   "--heartbeat-timeout-s", "10", "--weights", ",".join(f"{c}={w:g}" for c, w in weights.items())]
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output, self.address, ready = [], "", threading.Event()

        def read() -> None:     # keep draining: a full pipe would stop the controller
            for line in self.process.stdout:
                self.output.append(line)
                if line.startswith(READY):
                    self.address = line[len(READY):].split()[0]
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(120) or not self.address:
            self.stop()
            raise RuntimeError("pathways-controller did not start:\n" + "".join(self.output[-40:]))

    def executor_pids(self) -> list[int]:
        pid = self.process.pid
        found = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(p) for p in f.read().split()]
        return found

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def cpu_cores(groups: dict[str, list[int]], seconds: float, before: dict) -> dict[str, float]:
    """CPU cores each group of processes used since ``before`` (their CPU seconds then)."""
    return {g: sum((process_cpu_s(p) or 0.0) - before[g][p] for p in pids) / seconds for g, pids in groups.items()}


def phase(clients: list[Client], ms: float, args, cpu_groups: dict[str, list[int]] | None = None) -> dict:
    """Every client in ``clients`` runs ``ms`` programs from one start; their answers and the CPU in the window."""
    start = time.time() + START_MARGIN_S
    for c in clients:
        c.send(op="phase", program_ms=ms, start=start, warmup_s=args.warmup_s, window_s=args.window_s,
               outstanding=args.outstanding)
    cpu = None
    if cpu_groups:
        time.sleep(max(0.0, start + args.warmup_s - time.time()))
        before = {g: {p: process_cpu_s(p) or 0.0 for p in pids} for g, pids in cpu_groups.items()}
        began = time.time()
        time.sleep(max(0.0, start + args.warmup_s + args.window_s - time.time()))
        cpu = cpu_cores(cpu_groups, time.time() - began, before)
    replies = {c.name: c.reply() for c in clients}
    return {"start": start, "replies": replies, "cpu_cores": cpu}


def run_throughput(clients: list[Client], keys_dir: str, args) -> list[dict]:
    counts, programs = [int(n) for n in args.clients.split(",")], [float(m) for m in args.programs_ms.split(",")]
    used = clients[:max(counts)]
    controller = Controller(keys_dir, {})
    rows = []
    try:
        for c in used:
            c.send(op="connect", address=controller.address, keys=f"{keys_dir}/clients/{c.name}")
        for c in used:
            c.reply()
        groups = {"controller": [controller.process.pid], "executors": controller.executor_pids()}
        for ms in programs:
            ask(used, op="prepare", program_ms=ms)
            for n in counts:
                taking = used[:n]
                got = phase(taking, ms, args, {**groups, "clients": [c.process.pid for c in taking]})
                per_client = [r["in_window"] / args.window_s for r in got["replies"].values()]
                per_s = sum(per_client)
                rows.append({"clients": n, "program_ms": ms, "per_s": per_s, "utilisation": utilisation(per_s, ms),
                             "per_client_min": min(per_client), "per_client_max": max(per_client),
                             "failed": sum(r["failed"] for r in got["replies"].values()),
                             "max_late_s": max(r["late_s"] for r in got["replies"].values()),
                             "cpu_cores": got["cpu_cores"], "replies": got["replies"]})
                print(f"(a) {n:2d} clients x {ms:g} ms: {per_s:,.0f} computations/s, utilisation "
                      f"{rows[-1]['utilisation']:.1%}, CPU cores " + ", ".join(
                          f"{g} {v:.2f}" for g, v in got["cpu_cores"].items()), flush=True)
        ask(used, op="disconnect")
    finally:
        controller.stop()
    return rows


def run_shares(clients: list[Client], keys_dir: str, trace_dir: str, args) -> tuple[list[dict], dict]:
    results, kept = [], {}
    four = clients[:4]
    for ms in [float(m) for m in args.share_ms.split(",")]:
        for label, ws in SHARE_WEIGHTS.items():
            weights = {c.name: float(w) for c, w in zip(four, ws)}
            controller = Controller(keys_dir, weights)
            try:
                for c in four:
                    c.send(op="connect", address=controller.address, keys=f"{keys_dir}/clients/{c.name}")
                for c in four:
                    c.reply()
                ask(four, op="prepare", program_ms=ms)
                shares_args = argparse.Namespace(**{**vars(args), "window_s": args.share_s})
                got = phase(four, ms, shares_args)
                path = os.path.join(trace_dir, f"multitenancy_{label.replace(':', '-')}_{ms:g}ms.json")
                four[0].send(op="trace", path=path)
                four[0].reply()
                ask(four, op="disconnect")
            finally:
                controller.stop()
            with open(path) as f:
                trace = json.load(f)
            events = compute_events(trace)
            lo = (got["start"] + args.warmup_s) * 1e6
            window = intersect([*activity_spans(events).values(), (lo, lo + args.share_s * 1e6)])
            if window is None:
                raise RuntimeError(f"{label} at {ms:g} ms: the four clients never ran at the same time")
            times = device_time(events, window)
            rows = share_rows(weights, measured_shares(times, weights))
            span_s = (window[1] - window[0]) / 1e6
            busy = sum(times.get(c, 0.0) for c in weights) / 1e6 / (EXECUTORS * span_s)
            results.append({"weights": label, "program_ms": ms, "window_s": span_s, "utilisation": busy,
                            "rows": rows, "device_time_ms": {c: t / 1000 for c, t in times.items()}, "trace": path,
                            "issued": {n: r["issued"] for n, r in got["replies"].items()}})
            kept[(label, ms)] = (events, window, trace)
            print(f"(b) {label} at {ms:g} ms: measured shares " + ", ".join(
                f"{r['client']} {r['measured_share']:.1%}" for r in rows) + f" over {span_s:.1f} s", flush=True)
    return results, kept


def plot_timeline(events: list[dict], window: tuple[float, float], trace: dict, weights: dict[str, float],
                  paths: list[str], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mid = (window[0] + window[1]) / 2
    rows = timeline(events, (mid - TIMELINE_MS * 500, mid + TIMELINE_MS * 500))
    labels = {e["pid"]: e["args"]["name"].split()[0] for e in trace["traceEvents"]
              if e.get("ph") == "M" and e.get("name") == "process_name"}
    colours = {c: plt.cm.tab10(i) for i, c in enumerate(weights)}
    fig, ax = plt.subplots(figsize=(10, 0.45 * EXECUTORS + 1.4))
    pids = sorted(rows)
    for y, pid in enumerate(pids):
        for client in weights:
            bars = [(s, d) for s, d, c in rows[pid] if c == client]
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colours[client], edgecolor="none")
    ax.set_yticks(range(len(pids)), [labels.get(p, str(p)) for p in pids])
    ax.invert_yaxis()
    ax.set_xlim(0, TIMELINE_MS)
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    handles = [matplotlib.patches.Patch(color=colours[c], label=f"{c} (weight {w:g})") for c, w in weights.items()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=len(weights), frameon=False)
    fig.tight_layout()
    for path in paths:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fig.savefig(path, dpi=120)
    plt.close(fig)


def report(throughput: list[dict], shares: list[dict], counts: list[int]) -> list[str]:
    one = {r["program_ms"]: r["per_s"] for r in throughput if r["clients"] == 1}
    print("\n(a) aggregate throughput, 8 sim executors, every call on all 8 (calls completed in the window)")
    print_table(["clients", "program ms", "computations/s", "per client min-max", "utilisation", "vs 1 client",
                 "CPU cores: controller", "executors", "clients"],
                [[r["clients"], f"{r['program_ms']:g}", f"{r['per_s']:,.0f}",
                  f"{r['per_client_min']:,.0f}-{r['per_client_max']:,.0f}", f"{r['utilisation']:.1%}",
                  f"x{r['per_s'] / one[r['program_ms']]:.2f}" if one.get(r["program_ms"]) else "-",
                  *(f"{r['cpu_cores'][g]:.2f}" for g in ("controller", "executors", "clients"))] for r in throughput])
    print("\n(b) shares of device time, 4 clients backlogged (executors' timestamps, window where all 4 ran)")
    print_table(["program ms", "weights", "window s", "utilisation", "client", "weight share", "measured share",
                 "diff (points)", "device time ms"],
                [[f"{s['program_ms']:g}", s["weights"], f"{s['window_s']:.2f}", f"{s['utilisation']:.1%}", r["client"],
                  f"{100 * r['weight_share']:.1f} %", f"{100 * r['measured_share']:.1f} %", f"{r['diff_points']:+.1f}",
                  f"{s['device_time_ms'].get(r['client'], 0.0):,.0f}"] for s in shares for r in s["rows"]])
    lines = verdicts(throughput, shares, counts)
    print()
    for line in lines:
        print(line)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--as-client", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--clients", default="1,2,4,8,16", help="client counts for (a)")
    parser.add_argument("--programs-ms", default="0.04,0.33,1,2.4", help="program sizes (ms of device time) for (a)")
    parser.add_argument("--share-ms", default="0.33,2.4", help="program sizes for (b); (c) draws the last")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="seconds of each phase not counted")
    parser.add_argument("--window-s", type=float, default=3.0, help="(a): the measured window of each phase")
    parser.add_argument("--share-s", type=float, default=10.0, help="(b): the measured window of each setting")
    parser.add_argument("--outstanding", type=int, default=64, help="unfinished calls per client, at most")
    parser.add_argument("--json", default=None, help="where to write the results (default bench/results/multitenancy.json)")
    add_trace_dir_argument(parser, "(b)'s")
    args = parser.parse_args()
    if args.as_client:
        client_main(args.as_client)
        return 0
    counts = [int(n) for n in args.clients.split(",")]
    began = time.time()
    scratch = tempfile.mkdtemp(prefix="multitenancy-")
    trace_dir = args.trace_dir or scratch
    os.makedirs(trace_dir, exist_ok=True)
    names = [f"c{i}" for i in range(max(max(counts), 4))]
    keys_dir = os.path.join(scratch, "keys")
    subprocess.run([sys.executable, "-m", "pathways_torch.launch.controller_main", "--make-keys", keys_dir,
                    "--clients", ",".join(names), "--executors", str(EXECUTORS)], cwd=ROOT, check=True,
                   capture_output=True)
    clients = []
    try:
        clients = [Client(name, scratch) for name in names]
        for c in clients:
            c.reply()
        print(f"{len(clients)} client processes up in {time.time() - began:.1f} s", flush=True)
        throughput = run_throughput(clients, keys_dir, args)
        shares, kept = run_shares(clients, keys_dir, trace_dir, args)
    finally:
        for c in clients:
            c.stop()
    lines = report(throughput, shares, counts)
    label, ms = "1:2:4:8", float(args.share_ms.split(",")[-1])
    events, window, trace = kept[(label, ms)]
    weights = {r["client"]: r["weight"] for s in shares if (s["weights"], s["program_ms"]) == (label, ms) for r in s["rows"]}
    pngs = [os.path.join(RESULTS_DIR, "multitenancy.png"), os.path.join(ROOT, "docs", "images", "multitenancy.png")]
    plot_timeline(events, window, trace, weights, pngs,
                  f"4 clients at weights {label}, {ms:g} ms programs, 8 sim executors: {TIMELINE_MS:g} ms")
    elapsed = time.time() - began
    print("timeline written to", ", ".join(pngs))
    print(f"the whole run took {elapsed:.0f} s")
    if not args.trace_dir:
        for s in shares:
            del s["trace"]    # in the scratch folder, removed below
    print("written to", write_results("multitenancy", {"args": vars(args), "throughput": throughput, "shares": shares,
                                                       "verdicts": lines, "elapsed_s": elapsed, "png": pngs}, args.json))
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
