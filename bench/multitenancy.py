"""Many clients of one standalone controller: aggregate throughput, proportional shares, a device timeline
(the Pathways paper's Figures 8 and 9).

One `pathways-controller` serves 8 simulated executors (``--backend sim``: no torch there). The clients are separate
processes (``python -m bench.multitenancy --as-client NAME``), started once and driven over their stdin and stdout,
a JSON line per command: connect to a controller, register a program, run a phase, write a trace, disconnect. A
"program of X ms" is one call of a ``pw.function(sim_time_s=X/1000, name="work_<client>")`` on a mesh of all 8
executors: each call occupies every executor for X ms, so device utilisation = aggregate calls/s x X / 1000. In a
phase the clients issue calls back to back from a common wall-clock start, each with at most ``--outstanding``
unfinished (then it waits for its oldest); a call counts when its client sees its output settle, and only if that
happens inside the window: after ``--warmup-s``, for ``--window-s`` (issuing stops at its end; the rest drain).

(a) computations/s summed over 1, 2, 4, 8 and 16 clients at programs of 0.04, 0.33, 1 and 2.4 ms (one controller; a
    phase's clients alone are connected), and the CPU (user + system, in cores, from /proc) of the controller, its 8
    executors and the clients over each window;
(b) 4 clients (c0..c3) backlogged for ``--share-s`` at weights 1:1:1:1 and 1:2:4:8, for each of ``--share-ms``, on a
    fresh controller per setting (its trace holds that setting alone); then c0 gathers the executors' trace
    (``ctx.trace``: their own timestamps). A client's device time is the sum over executors of its ``work_<client>``
    computations, clipped to the window where all four ran (the intersection of their computations' spans and the
    measured window); its share = its time / the four's. A sim run's span ends when its thread wakes after the
    deadline, so on a busy machine it lasts longer than X: the table shows the runs and their mean span;
(c) from the 1:2:4:8 trace of the last ``--share-ms``, a PNG in the style of Figure 9: a row per executor, a colour
    per client, 100 ms from the middle of that window (bench/results/ and docs/images/multitenancy.png).

Targets: each share within 3 points of its weight's; utilisation >= 90 % with 4 or more clients of 0.33 ms programs;
16 clients' throughput >= one client's (each size). Prints tables and verdicts, writes bench/results/multitenancy.json.

    .venv/bin/python -m bench.multitenancy [--clients 1,2,4,8,16] [--programs-ms 0.04,0.33,1,2.4] [--share-ms 0.33,2.4]
        [--warmup-s 1] [--window-s 3] [--share-s 10] [--outstanding 64] [--trace-dir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
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
        lo, hi = spans.get(client_of(e["name"]), (e["ts"], e["ts"] + e["dur"]))
        spans[client_of(e["name"])] = (min(lo, e["ts"]), max(hi, e["ts"] + e["dur"]))
    return spans


def intersect(spans) -> tuple[float, float] | None:
    """The interval common to all ``spans`` ((lo, hi) pairs, a list); None if there are none or some do not overlap."""
    lo, hi = max((s[0] for s in spans), default=0), min((s[1] for s in spans), default=0)
    return (lo, hi) if lo < hi else None


def device_time(events: list[dict], window: tuple[float, float]) -> dict[str, float]:
    """Each client's computation time (µs, summed over executors) inside ``window``, events clipped to it."""
    lo, hi = window
    totals: dict[str, float] = collections.defaultdict(float)
    for e in events:
        totals[client_of(e["name"])] += max(0.0, min(hi, e["ts"] + e["dur"]) - max(lo, e["ts"]))
    return dict(totals)


def analyse_shares(events: list[dict], weights: dict[str, float], window: tuple[float, float]) -> dict:
    """Each client's device time in ``window`` (µs), its share of the clients' total against its weight's share
    (``diff_points``: percentage points), its computations that started in the window (``runs``: events / 8) and
    their mean duration (``run_ms``), and the executors' busy fraction over the window."""
    times, total_weight = device_time(events, window), sum(weights.values())
    total, span_us, rows = sum(times.get(c, 0.0) for c in weights), window[1] - window[0], []
    for c, w in weights.items():
        mine = [e["dur"] for e in events if client_of(e["name"]) == c and window[0] <= e["ts"] < window[1]]
        share = times.get(c, 0.0) / total
        rows.append({"client": c, "weight": w, "weight_share": w / total_weight, "measured_share": share,
                     "diff_points": 100.0 * (share - w / total_weight), "device_time_ms": times.get(c, 0.0) / 1000,
                     "runs": len(mine) / EXECUTORS, "run_ms": sum(mine) / len(mine) / 1000 if mine else 0.0})
    return {"window_s": span_us / 1e6, "utilisation": total / (EXECUTORS * span_us), "rows": rows}


def utilisation(calls_per_s: float, program_ms: float) -> float:
    """Busy fraction of the executors: every call occupies all of them for ``program_ms``."""
    return calls_per_s * program_ms / 1000.0


def timeline(events: list[dict], window: tuple[float, float]) -> dict[int, list[tuple[float, float, str]]]:
    """Per executor row (pid): (start ms from the window's start, duration ms, client), clipped to ``window``."""
    lo, hi = window
    rows: dict[int, list] = collections.defaultdict(list)
    for e in sorted(events, key=lambda e: e["ts"]):
        start, end = max(lo, e["ts"]), min(hi, e["ts"] + e["dur"])
        if end > start:
            rows[e["pid"]].append(((start - lo) / 1000.0, (end - start) / 1000.0, client_of(e["name"])))
    return dict(rows)


def verdicts(throughput: list[dict], shares: list[dict]) -> list[str]:
    """One line per target and case: ``target WHAT: met (NUMBERS)`` or ``... MISSED (...)``."""
    out, verdict = [], lambda target, met, detail: f"target {target}: {'met' if met else 'MISSED'} ({detail})"
    for s in shares:
        worst = max(s["rows"], key=lambda r: abs(r["diff_points"]))
        out.append(verdict(f"shares within {SHARE_TOLERANCE_POINTS:g} points at {s['weights']}, {s['program_ms']:g} ms",
                           abs(worst["diff_points"]) <= SHARE_TOLERANCE_POINTS,
                           f"worst {worst['client']}: {worst['diff_points']:+.1f} points"))
    for r in throughput:
        if r["program_ms"] == 0.33 and r["clients"] >= 4:
            out.append(verdict(f"utilisation >= {UTILISATION_TARGET:.0%}, {r['clients']} clients of 0.33 ms",
                               r["utilisation"] >= UTILISATION_TARGET, f"{r['utilisation']:.1%}"))
    if {1, 16} <= {r["clients"] for r in throughput}:
        for ms in sorted({r["program_ms"] for r in throughput}):
            one, many = (next(r for r in throughput if r["program_ms"] == ms and r["clients"] == n) for n in (1, 16))
            out.append(verdict(f"16 clients >= 1 client at {ms:g} ms", many["per_s"] >= one["per_s"],
                               f"{many['per_s']:,.0f}/s vs {one['per_s']:,.0f}/s, x{many['per_s'] / one['per_s']:.2f}"))
    return out


def client_main(name: str) -> int:
    """Serve commands from stdin, one JSON line each; answer each with one ``MT {json}`` line on stdout."""
    import torch
    import pathways_torch as pw

    torch.set_num_threads(1)
    ctx = x = functions = None
    answer = lambda **reply: print(MARK + json.dumps(reply), flush=True)  # noqa: E731
    answer(op="ready", pid=os.getpid())
    for line in sys.stdin:
        op = (cmd := json.loads(line))["op"]
        if op == "connect":     # and register each program, run once before any phase counts
            ctx = pw.Context(controller=cmd["address"], keys=os.path.join(cmd["keys_dir"], "clients", name))
            x = ctx.put(torch.zeros(EXECUTORS), ctx.mesh({"data": EXECUTORS}), [pw.Shard(0)])
            functions = {ms: pw.function(lambda v: v + 1, name=f"work_{name}", sim_time_s=ms / 1000.0)
                         for ms in cmd["programs_ms"]}
            for fn in functions.values():
                fn(x).result(timeout_s=120)
            answer(op=op, executors=len(ctx.executor_ids))
        elif op == "phase":
            answer(op=op, **run_phase(functions[cmd["program_ms"]], x, cmd))
        elif op == "trace":
            answer(op=op, events=len(ctx.trace(cmd["path"])["traceEvents"]))
        elif op == "disconnect":
            ctx.close()
            ctx = x = None
            answer(op=op)
        else:
            break
    if ctx is not None:   # stdin ended: the benchmark is done with this client
        ctx.close()
    return 0


def run_phase(fn, x, cmd: dict) -> dict:
    """Calls back to back from ``start`` to the window's end, at most ``outstanding`` unfinished; what completed."""
    start, lo = cmd["start"], cmd["start"] + cmd["warmup_s"]
    hi, late = lo + cmd["window_s"], time.time() - start
    time.sleep(max(0.0, -late))
    pending, completions, failed, limit = collections.deque(), [], 0, cmd["outstanding"]

    def settle():
        nonlocal failed
        failed += pending.popleft().exception(timeout_s=120) is not None
        completions.append(time.time())

    while time.time() < hi:
        pending.append(fn(x))
        while pending and (len(pending) >= limit or pending[0].done()):
            settle()
    while pending:
        settle()
    return {"completed": len(completions), "failed": failed, "in_window": sum(lo <= t < hi for t in completions),
            "late_s": max(0.0, late), "drain_s": time.time() - hi}   # every call issued has completed (or failed)


class Client:
    """One client process: commands to its stdin, answers (``MT`` lines) from its stdout, its stderr to a log."""

    def __init__(self, name: str, log_dir: str):
        self.name, self.log = name, open(os.path.join(log_dir, f"{name}.log"), "w")
        self.process = subprocess.Popen([sys.executable, "-m", "bench.multitenancy", "--as-client", name], cwd=ROOT,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)

    def send(self, **cmd) -> None:
        self.process.stdin.write(json.dumps(cmd) + "\n")
        self.process.stdin.flush()

    def reply(self) -> dict:
        """Its next answer (a client never hangs for long: its calls time out, and so does a lost controller)."""
        for line in self.process.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        with open(self.log.name) as f:
            raise RuntimeError(f"client {self.name} ended without an answer; its log ends:\n{f.read()[-3000:]}")

    def stop(self) -> None:
        stop(self.process, lambda: self.process.stdin.close())   # end of its commands: it closes and exits
        self.log.close()


def stop(process: subprocess.Popen, ask_to_end) -> None:
    """``ask_to_end()``, then kill it if it has not ended within 30 s."""
    if process.poll() is None:
        try:
            ask_to_end()
            process.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()
            process.wait()


def ask(clients: list[Client], **cmd) -> dict[str, dict]:
    """Send ``cmd`` to every client at once, then collect their answers."""
    for c in clients:
        c.send(**cmd)
    return {c.name: c.reply() for c in clients}


class Controller:
    """``pathways-controller`` serving 8 sim executors at a free loopback port, with ``weights``."""

    def __init__(self, keys_dir: str, weights: dict[str, float], log_path: str):
        command = [sys.executable, "-m", "pathways_torch.launch.controller_main", "--keys-dir", keys_dir,
                   "--bind", "tcp://127.0.0.1:0", "--num-executors", str(EXECUTORS), "--backend", "sim",
                   "--heartbeat-timeout-s", "10", "--weights", ",".join(f"{c}={w:g}" for c, w in weights.items())]
        with open(log_path, "w") as log:    # a file, not a pipe: nothing has to keep draining it
            self.process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        self.address, deadline = "", time.time() + 120
        while not self.address and self.process.poll() is None and time.time() < deadline:
            time.sleep(0.1)
            with open(log_path) as f:
                self.address = next((line[len(READY):].split()[0] for line in f if line.startswith(READY)), "")
        if not self.address:
            self.stop()
            with open(log_path) as f:
                raise RuntimeError("pathways-controller did not start:\n" + f.read()[-4000:])

    def stop(self) -> None:
        stop(self.process, lambda: self.process.send_signal(signal.SIGTERM))   # it stops its executors


def machine_cpu_s() -> float:
    """Busy CPU seconds of the whole machine so far, every core (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def phase(clients: list[Client], ms: float, window_s: float, args, cpu_groups: dict | None = None) -> dict:
    """Every client in ``clients`` runs ``ms`` programs from one start; their answers, the CPU (cores) in the window."""
    start = time.time() + START_MARGIN_S
    for c in clients:
        c.send(op="phase", program_ms=ms, start=start, warmup_s=args.warmup_s, window_s=window_s,
               outstanding=args.outstanding)
    cpu, cpu_s = None, lambda: {**{g: sum(process_cpu_s(p) or 0.0 for p in pids) for g, pids in cpu_groups.items()},
                                "machine": machine_cpu_s()}
    if cpu_groups:   # CPU seconds of each group of processes and of the machine, before and after the window
        time.sleep(max(0.0, start + args.warmup_s - time.time()))
        before, began = cpu_s(), time.time()
        time.sleep(max(0.0, start + args.warmup_s + window_s - time.time()))
        cpu = {g: (s - before[g]) / (time.time() - began) for g, s in cpu_s().items()}
        cpu["rest"] = cpu.pop("machine") - sum(cpu.values())   # the kernel's own work, this script, anyone else
    return {"start": start, "replies": {c.name: c.reply() for c in clients}, "cpu_cores": cpu}


def run_throughput(clients: list[Client], keys_dir: str, scratch: str, args) -> list[dict]:
    counts, programs = [int(n) for n in args.clients.split(",")], [float(m) for m in args.programs_ms.split(",")]
    used, connected = clients[:max(counts)], 0
    controller, rows = Controller(keys_dir, {}, os.path.join(scratch, "controller-a.log")), []
    try:
        tasks = f"/proc/{controller.process.pid}/task"    # its children: the executors
        executors = [int(p) for t in os.listdir(tasks) for p in open(f"{tasks}/{t}/children").read().split()]
        groups = {"controller": [controller.process.pid], "executors": executors}
        for n in sorted(counts):    # connected: the clients of this phase, no idle ones
            ask(used[connected:n], op="connect", address=controller.address, keys_dir=keys_dir, programs_ms=programs)
            connected = n
            for ms in programs:
                got = phase(used[:n], ms, args.window_s, args, {**groups, "clients": [c.process.pid for c in used[:n]]})
                replies = got["replies"].values()
                per_client = [r["in_window"] / args.window_s for r in replies]
                per_s = sum(per_client)
                rows.append({"clients": n, "program_ms": ms, "per_s": per_s, "utilisation": utilisation(per_s, ms),
                             "per_client_min": min(per_client), "per_client_max": max(per_client),
                             "failed": sum(r["failed"] for r in replies), "cpu_cores": got["cpu_cores"],
                             "replies": got["replies"]})
                cpu = ", ".join(f"{g} {v:.2f}" for g, v in got["cpu_cores"].items())
                print(f"(a) {n:2d} clients x {ms:g} ms: {per_s:,.0f} computations/s, utilisation "
                      f"{utilisation(per_s, ms):.1%}, CPU cores {cpu}", flush=True)
        ask(used, op="disconnect")
    finally:
        controller.stop()
    return sorted(rows, key=lambda r: (r["program_ms"], r["clients"]))


def run_shares(clients: list[Client], keys_dir: str, scratch: str, args) -> tuple[list[dict], dict]:
    results, kept, four = [], {}, clients[:4]
    for ms in [float(m) for m in args.share_ms.split(",")]:
        for label, ws in SHARE_WEIGHTS.items():
            weights = {c.name: float(w) for c, w in zip(four, ws)}
            controller = Controller(keys_dir, weights, os.path.join(scratch, f"controller-b-{ms:g}-{ws[-1]}.log"))
            try:
                ask(four, op="connect", address=controller.address, keys_dir=keys_dir, programs_ms=[ms])
                got = phase(four, ms, args.share_s, args)
                path = os.path.join(args.trace_dir or scratch, f"multitenancy_{label.replace(':', '-')}_{ms:g}ms.json")
                ask(four[:1], op="trace", path=path)    # c0 gathers every executor's events
                ask(four, op="disconnect")
            finally:
                controller.stop()
            with open(path) as f:
                trace = json.load(f)
            events, lo = compute_events(trace), (got["start"] + args.warmup_s) * 1e6
            window = intersect([*activity_spans(events).values(), (lo, lo + args.share_s * 1e6)])
            if window is None or set(activity_spans(events)) < set(weights):
                raise RuntimeError(f"{label} at {ms:g} ms: the four clients never ran at the same time")
            results.append({"weights": label, "program_ms": ms, **analyse_shares(events, weights, window),
                            "trace": path if args.trace_dir else None,
                            "completed": {n: r["completed"] for n, r in got["replies"].items()}})
            kept[(label, ms)] = (events, window, {e["pid"]: e["args"]["name"].split()[0] for e in trace["traceEvents"]
                                                  if e.get("ph") == "M" and e.get("name") == "process_name"})
            print(f"(b) {label} at {ms:g} ms: measured shares " + ", ".join(f"{r['client']} {r['measured_share']:.1%}"
                  for r in results[-1]["rows"]) + f" over {results[-1]['window_s']:.1f} s", flush=True)
    return results, kept


def plot_timeline(events: list[dict], window: tuple[float, float], labels: dict[int, str], weights: dict[str, float],
                  paths: list[str], title: str) -> None:
    """Figure 9's style: a row per executor, a colour per client, ``TIMELINE_MS`` from the middle of ``window``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mid = (window[0] + window[1]) / 2
    rows = timeline(events, (mid - TIMELINE_MS * 500, mid + TIMELINE_MS * 500))
    colours = {c: plt.cm.tab10(i) for i, c in enumerate(weights)}
    fig, ax = plt.subplots(figsize=(10, 0.45 * EXECUTORS + 1.4))
    pids = sorted(rows)
    for y, pid in enumerate(pids):
        for client in weights:
            bars = [(s, d) for s, d, c in rows[pid] if c == client]
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colours[client], edgecolor="white", linewidth=0.4)
    ax.set_yticks(range(len(pids)), [labels.get(p, str(p)) for p in pids])
    ax.invert_yaxis()
    ax.set(xlim=(0, TIMELINE_MS), xlabel="time (ms)", title=title)
    handles = [matplotlib.patches.Patch(color=colours[c], label=f"{c} (weight {w:g})") for c, w in weights.items()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=len(weights), frameon=False)
    fig.tight_layout()
    for path in paths:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fig.savefig(path, dpi=120)
    plt.close(fig)


def report(throughput: list[dict], shares: list[dict]) -> list[str]:
    one = {r["program_ms"]: r["per_s"] for r in throughput if r["clients"] == 1}
    print("\n(a) computations/s completed in the window, 8 sim executors, each call on all 8; CPU: cores used")
    print_table(["clients", "program ms", "computations/s", "per client min-max", "utilisation", "vs 1 client",
                 "CPU cores: controller", "executors", "clients", "rest of machine", "CPU ms per computation"],
                [[r["clients"], f"{r['program_ms']:g}", f"{r['per_s']:,.0f}",
                  f"{r['per_client_min']:,.0f}-{r['per_client_max']:,.0f}", f"{r['utilisation']:.1%}",
                  f"x{r['per_s'] / one[r['program_ms']]:.2f}" if one.get(r["program_ms"]) else "-",
                  *(f"{r['cpu_cores'][g]:.2f}" for g in ("controller", "executors", "clients", "rest")),
                  f"{1000 * (sum(r['cpu_cores'].values()) - r['cpu_cores']['rest']) / max(r['per_s'], 1):.2f}"]
                 for r in throughput])
    print("\n(b) shares of device time, 4 clients backlogged (executors' timestamps, window where all 4 ran)")
    print_table(["program ms", "weights", "window s", "busy", "client", "weight share", "measured share",
                 "diff (points)", "device time ms", "computations", "mean run ms"],
                [[f"{s['program_ms']:g}", s["weights"], f"{s['window_s']:.2f}", f"{s['utilisation']:.1%}", r["client"],
                  f"{100 * r['weight_share']:.1f} %", f"{100 * r['measured_share']:.1f} %", f"{r['diff_points']:+.1f}",
                  f"{r['device_time_ms']:,.0f}", f"{r['runs']:,.0f}", f"{r['run_ms']:.3f}"]
                 for s in shares for r in s["rows"]])
    lines = verdicts(throughput, shares)
    print("\n" + "\n".join(lines))
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
    parser.add_argument("--json", default=None, help="where to write the results (default: bench/results/)")
    add_trace_dir_argument(parser, "(b)'s")
    args = parser.parse_args()
    if args.as_client:
        return client_main(args.as_client)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # run the clean-up below: stop every process started
    began, scratch = time.time(), tempfile.mkdtemp(prefix="multitenancy-")
    os.makedirs(args.trace_dir or scratch, exist_ok=True)
    names = [f"c{i}" for i in range(max(4, *(int(n) for n in args.clients.split(","))))]
    keys_dir = os.path.join(scratch, "keys")
    subprocess.run([sys.executable, "-m", "pathways_torch.launch.controller_main", "--make-keys", keys_dir,
                    "--clients", ",".join(names), "--executors", str(EXECUTORS)], cwd=ROOT, check=True,
                   capture_output=True)
    clients = [Client(name, scratch) for name in names]
    try:
        for c in clients:
            c.reply()
        print(f"{len(clients)} client processes up in {time.time() - began:.1f} s", flush=True)
        throughput = run_throughput(clients, keys_dir, scratch, args)
        shares, kept = run_shares(clients, keys_dir, scratch, args)
    finally:
        for c in clients:
            c.stop()
    lines = report(throughput, shares)
    label, ms = "1:2:4:8", float(args.share_ms.split(",")[-1])
    weights = {c: float(w) for c, w in zip(names, SHARE_WEIGHTS[label])}
    pngs = [os.path.join(RESULTS_DIR, "multitenancy.png"), os.path.join(ROOT, "docs", "images", "multitenancy.png")]
    plot_timeline(*kept[(label, ms)], weights, pngs,
                  f"4 clients at weights {label}, {ms:g} ms programs, 8 sim executors: {TIMELINE_MS:g} ms")
    elapsed = time.time() - began
    print("timeline written to", ", ".join(pngs), f"\nthe whole run took {elapsed:.0f} s")
    payload = {"args": vars(args), "throughput": throughput, "shares": shares, "verdicts": lines, "elapsed_s": elapsed,
               "png": pngs}
    print("written to", write_results("multitenancy", payload, args.json))
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
