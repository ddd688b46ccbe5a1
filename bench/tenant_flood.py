"""One tenant's flood costs another tenant little latency and no executor (issue 46, Deliver point 2).

One `pathways-controller` (2 eager executors, heartbeat every 0.2 s, an executor lost after 2 s of silence, its
status on a loopback port) serves two tenants with keys of their own:

- alice, a real remote ``pw.Context`` in this process, times back to back (1) an awaited tiny call (``x * 2`` on a
  mesh of both executors) and (2) an awaited training step of a tiny model (``ctx.wrap``, ``trainer.step(batch)
  .result()``);
- bob, a separate process (`bench.tenant_flood_bob`: his CPU is a tenant's, not this script's), on a raw DEALER
  of his own, sends (a) one message of ``--big-mb`` MB or (b) ``--junk`` small junk messages (not JSON, an unknown
  op, a call with wrong arguments, a request with an extra frame; the latter three ask for answers), then a probe
  request (``executors``), pinging as a client library does, and reports when the probe was answered (or he was
  cut off).

Each round runs, for each flood, an undisturbed window of ``--quiet-s`` then a disturbed one (from bob's first
message until his probe is answered, or he is disconnected): the windows interleave, so each ratio compares
latencies measured seconds apart. A sample is disturbed if its call overlaps bob's window. Per round and flood: the
median latency of each kind, undisturbed and disturbed, and their ratio (target: at most 2x); after each disturbed
window the controller's status is read (`pathways_torch.launch.health.get_status`): an executor not alive, or
registered again (epoch > 1), is lost (target: 0). The controller's CPU by thread over the windows (``/proc``) shows
where a flood's time goes. Prints tables and verdicts, writes bench/results/tenant_flood.json.

    .venv/bin/python -m bench.tenant_flood [--rounds 5] [--quiet-s 2] [--junk 20000] [--big-mb 16]
        [--after-s 1] [--max-queued-requests N] [--bob-nice 19] [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

import pathways_torch as pw
from bench.common import free_port, print_table, process_cpu_s, write_results
from bench.cpu_per_call import thread_cpu_s
from bench.multitenancy import machine_cpu_s
from bench.tenant_flood_bob import MARK
from pathways_torch.launch.health import get_status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READY = "pathways-controller: serving clients at "
EXECUTORS = 2
HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S = 0.2, 2.0
TARGET_RATIO = 2.0
KINDS = ("awaited call", "training step")


# ------------------------------------------------------------ pure helpers (tests/unit/test_bench_tenant_flood.py)

def overlaps(sample: tuple[float, float], window: tuple[float, float]) -> bool:
    """True if the call that ran over ``sample`` (start, end) overlaps ``window`` (start, end)."""
    return sample[0] <= window[1] and sample[1] >= window[0]


def latencies_ms(samples: list[dict], kind: str, window: tuple[float, float] | None = None,
                 after: float | None = None) -> list[float]:
    """The latencies (ms) of ``kind``'s samples ({"kind", "start", "end"}, seconds): those overlapping ``window``
    if one is given, those started later than ``after`` if that is."""
    return [1000 * (s["end"] - s["start"]) for s in samples
            if s["kind"] == kind and (window is None or overlaps((s["start"], s["end"]), window))
            and (after is None or s["start"] > after)]


def compare(quiet: list[float], disturbed: list[float]) -> dict:
    """Medians (ms) of two windows' latencies and their ratio (NaN where a window has none)."""
    q = statistics.median(quiet) if quiet else float("nan")
    d = statistics.median(disturbed) if disturbed else float("nan")
    return {"quiet_n": len(quiet), "quiet_ms": q, "disturbed_n": len(disturbed), "disturbed_ms": d,
            "disturbed_max_ms": max(disturbed, default=float("nan")), "ratio": d / q if q > 0 else float("nan")}


def executors_lost(executors) -> list[str]:
    """The executors of a status reply that were lost: not alive now, or registered again since (epoch > 1)."""
    return [f"{e.executor_id} ({e.state}, epoch {e.epoch})" for e in executors if e.state != "alive" or e.epoch > 1]


def cpu_rates(cpu: dict) -> dict[str, dict[str, float]]:
    """CPU seconds over the windows of each label (``"(window s)"``: their total length) as cores: CPU seconds per
    second of window."""
    return {label: {k: s / (used.get("(window s)") or float("nan")) for k, s in used.items() if k != "(window s)"}
            for label, used in cpu.items()}


def counted_since_last(reports: list[dict]) -> list[tuple[int, int]]:
    """Each flood's share of the controller's running counts (dropped client messages, refused client requests)."""
    out, last = [], (0, 0)
    for r in reports:
        now = (r["dropped_client_messages"], r["refused_client_requests"])
        out.append((now[0] - last[0], now[1] - last[1]))
        last = now
    return out


def verdicts(rows: list[dict], lost: list[str], failures: int) -> list[str]:
    """One line per target: ``target WHAT: met (NUMBERS)`` or ``... MISSED (...)``."""
    def verdict(target, met, detail):
        return f"target {target}: {'met' if met else 'MISSED'} ({detail})"

    out = [verdict("0 executors lost", not lost, ", ".join(lost) or "none"),
           verdict("0 of alice's calls failed", failures == 0, f"{failures} failed")]
    for s in summary(rows):   # the median round's ratio: a short window holds one or two calls, all of them hit
        out.append(verdict(f"{s['kind']} within {TARGET_RATIO:g}x of undisturbed under {s['flood']}",
                           s["median_round_ratio"] <= TARGET_RATIO,
                           f"median of per-round ratios x{s['median_round_ratio']:.2f}, per round "
                           f"x{', x'.join(f'{x:.2f}' for x in s['round_ratios'])}; all rounds' samples together: "
                           f"{s['quiet_ms']:.2f} -> {s['disturbed_ms']:.2f} ms, x{s['ratio']:.2f}"))
    return out


def summary(rows: list[dict]) -> list[dict]:
    """Per flood and kind: every round's samples together (``rows`` carry them as ``quiet``/``disturbed`` lists),
    their medians and ratio, and the per-round ratios."""
    out = []
    for flood in dict.fromkeys(r["flood"] for r in rows):
        for kind in dict.fromkeys(r["kind"] for r in rows):
            mine = [r for r in rows if r["flood"] == flood and r["kind"] == kind]
            pooled = compare([x for r in mine for x in r["quiet"]], [x for r in mine for x in r["disturbed"]])
            ratios = [r["ratio"] for r in mine]
            known = [x for x in ratios if x == x]   # NaN: no call of this kind overlapped that round's window
            out.append({"flood": flood, "kind": kind, **pooled, "round_ratios": ratios,
                        "median_round_ratio": statistics.median(known) if known else float("nan")})
    return out


class Bob:
    """Bob's process: floods asked on its stdin, reports read from its stdout (on a thread, into ``reports``)."""

    def __init__(self, keys: str, address: str, log_path: str, nice: int = 0):
        self.log = open(log_path, "w")
        self.process = subprocess.Popen([sys.executable, "-m", "bench.tenant_flood_bob", keys, address],
                                        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                        text=True, preexec_fn=(lambda: os.nice(nice)) if nice else None)
        self.reports: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.pid = self.report(120)["pid"]

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.startswith(MARK):
                self.reports.put(json.loads(line[len(MARK):]))
        self.reports.put(None)

    def ask(self, **cmd) -> None:
        self.process.stdin.write(json.dumps(cmd) + "\n")
        self.process.stdin.flush()

    def report(self, timeout_s: float) -> dict:
        got = self.reports.get(timeout=timeout_s)
        if got is None:
            with open(self.log.name) as f:
                raise RuntimeError(f"bob's process ended without a report; its log ends:\n{f.read()[-3000:]}")
        return got

    def stop(self) -> None:
        _stop(self.process, self.process.stdin.close)
        self.log.close()


# ------------------------------------------------------------ the controller and alice (this process)

def _stop(process: subprocess.Popen, ask_to_end) -> None:
    if process.poll() is None:
        try:
            ask_to_end()
            process.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()
            process.wait()


class Controller:
    """``pathways-controller`` with 2 eager executors and its status on a free loopback port; output to a file."""

    def __init__(self, keys_dir: str, log_path: str, extra: list[str]):
        self.status = f"127.0.0.1:{free_port()}"
        command = [sys.executable, "-m", "pathways_torch.launch.controller_main", "--keys-dir", keys_dir,
                   "--num-executors", str(EXECUTORS), "--backend", "eager", "--checkpoint-root",
                   os.path.join(os.path.dirname(keys_dir), "checkpoints"), "--status-port",
                   self.status.rsplit(":", 1)[1], "--heartbeat-interval-s", str(HEARTBEAT_INTERVAL_S),
                   "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S), *extra]
        with open(log_path, "w") as log:   # a file, not a pipe: nothing has to keep draining it
            self.process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        self.log_path, self.address, deadline = log_path, "", time.time() + 120
        while not self.address and self.process.poll() is None and time.time() < deadline:
            time.sleep(0.1)
            with open(log_path) as f:
                self.address = next((line[len(READY):].split()[0] for line in f if line.startswith(READY)), "")
        if not self.address:
            self.stop()
            raise RuntimeError("pathways-controller did not start:\n" + self.log_tail())

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log_path) as f:
            return f.read()[-chars:]

    def stop(self) -> None:
        _stop(self.process, lambda: self.process.send_signal(signal.SIGTERM))   # it stops its executors


class Alice:
    """A remote context timing awaited tiny calls and training steps of a tiny model, one of each per sample."""

    def __init__(self, address: str, keys: str):
        self.ctx = pw.Context(controller=address, keys=keys, heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
                              heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
        mesh = self.ctx.mesh({"data": EXECUTORS})
        self.double = pw.function(lambda a: a * 2, name="alice_double")
        self.x = self.ctx.put(torch.arange(4.0), mesh, [pw.Shard(0)])
        self.expected = torch.arange(4.0) * 2
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.trainer = self.ctx.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                                     loss_fn=torch.nn.functional.mse_loss, mesh=mesh)
        self.batch = (torch.randn(16, 8), torch.randn(16, 1))
        self.failures: list[str] = []

    def sample(self) -> list[dict]:
        """One awaited call and one awaited step, each timed (a failure is kept, not timed)."""
        out = []
        for kind, run in (("awaited call", lambda: torch.equal(self.double(self.x).result(30), self.expected)),
                          ("training step", lambda: self.trainer.step(self.batch).result(30))):
            start = time.monotonic()
            try:
                if run() is False:
                    raise AssertionError("x * 2 came back wrong")
            except Exception as exc:   # noqa: BLE001 - counted and reported: a flood must never fail alice's work
                self.failures.append(f"{kind}: {type(exc).__name__}: {exc}"[:300])
                continue
            out.append({"kind": kind, "start": start, "end": time.monotonic()})
        return out

    def run_until(self, done) -> list[dict]:
        samples = []
        while not done():
            samples += self.sample()
            if len(self.failures) > 10:
                raise RuntimeError("alice's calls keep failing: " + "; ".join(self.failures[-3:]))
        return samples


# ------------------------------------------------------------ the rounds

class CpuMeter:
    """CPU seconds so far (``/proc``): each thread of the controller, the controller as a whole (threads that ended
    too: a client's worker ends with its session), its executors, bob, this process (alice) and the machine."""

    def __init__(self, controller_pid: int, bob_pid: int):
        executors = descendants(controller_pid)   # started through a fork server: grandchildren
        self.pid, self.groups = controller_pid, {"controller, all threads": [controller_pid], "executors": executors,
                                                 "bob": [bob_pid], "alice (this process)": [os.getpid()]}

    def snapshot(self) -> dict[str, float]:
        out = {f"controller: {t}": s for t, s in thread_cpu_s(self.pid).items()}
        out.update({g: sum(process_cpu_s(p) or 0.0 for p in pids) for g, pids in self.groups.items()})
        out["machine, busy cores"] = machine_cpu_s()
        return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc/PID/task/*/children)."""
    tasks, out = f"/proc/{pid}/task", []
    for child in (int(c) for t in os.listdir(tasks) for c in open(f"{tasks}/{t}/children").read().split()):
        out += [child, *descendants(child)]
    return out


def add_usage(total: collections.Counter, before: dict, after: dict, seconds: float) -> None:
    """Add the CPU seconds used between two snapshots, and the window's length (``"(window s)"``), to ``total``."""
    for key, used in after.items():
        total[key] += max(0.0, used - before.get(key, 0.0))
    total["(window s)"] += seconds


def _after(seconds: float):
    end = time.monotonic() + seconds
    return lambda: time.monotonic() >= end


def quiet_window(alice: Alice, meter: CpuMeter, cpu: dict, seconds: float) -> list[dict]:
    before, began = meter.snapshot(), time.monotonic()
    samples = alice.run_until(_after(seconds))
    add_usage(cpu["quiet"], before, meter.snapshot(), time.monotonic() - began)
    return samples


def flood_window(alice: Alice, bob: Bob, meter: CpuMeter, cpu: dict, name: str, cmd: dict, after_s: float):
    """Alice's samples from bob's start until ``after_s`` after his report, and his report (the CPU counted to it)."""
    before, began, got = meter.snapshot(), time.monotonic(), {}
    bob.ask(**cmd)

    def done() -> bool:
        if not got:
            try:
                got.update(bob.reports.get_nowait() or {"error": "bob's process ended"})
            except queue.Empty:
                return False
            got["reported"] = time.monotonic()
            add_usage(cpu[name], before, meter.snapshot(), got["reported"] - began)   # bob's window, not what follows
        return "error" in got or time.monotonic() >= got["reported"] + after_s

    samples = alice.run_until(done)
    if "error" in got:
        raise RuntimeError(f"{name}: {got['error']}")
    return samples, got


def run_round(index: int, alice: Alice, bob: Bob, controller: Controller, meter: CpuMeter, args,
              cpu: dict) -> tuple[list, list]:
    """For each flood: an undisturbed window, then the flood's; a row per kind of alice's calls, a report per flood."""
    rows, reports = [], []
    floods = {f"{args.big_mb:g} MB message": {"flood": "big", "nbytes": int(args.big_mb * 1e6)},
              f"{args.junk:,} junk messages": {"flood": "junk", "count": args.junk}}
    for name, cmd in floods.items():
        quiet = quiet_window(alice, meter, cpu, args.quiet_s)
        disturbed, got = flood_window(alice, bob, meter, cpu, name, {**cmd, "timeout_s": args.timeout_s}, args.after_s)
        span = (got["first_sent"], got["end"])
        status = get_status(controller.status, with_stats=False)
        timeline = [[x["kind"], round(x["start"] - span[0], 4), round(1000 * (x["end"] - x["start"]), 2)]
                    for x in disturbed]   # alice's calls from bob's first message on (s, ms): when a flood hurts
        reports.append({"round": index, "flood": name, **got, "window_s": span[1] - span[0],
                        "lost": executors_lost(status.executors), "timeline": timeline,
                        "refused_client_requests": status.refused_client_requests,
                        "dropped_client_messages": status.dropped_client_messages})
        for kind in KINDS:
            q, d = latencies_ms(quiet, kind), latencies_ms(disturbed, kind, span)
            later = latencies_ms(disturbed, kind, after=span[1])
            rows.append({"round": index, "flood": name, "kind": kind, **compare(q, d), "quiet": q, "disturbed": d,
                         "after_n": len(later), "after_ms": statistics.median(later) if later else float("nan")})
        print(f"round {index} {name}: bob's window {span[1] - span[0]:.2f} s ({got['outcome'][:90]}); "
              + "; ".join(f"{r['kind']} {r['quiet_ms']:.1f} -> {r['disturbed_ms']:.1f} ms (x{r['ratio']:.2f})"
                          for r in rows[-len(KINDS):])
              + (f"; LOST {reports[-1]['lost']}" if reports[-1]["lost"] else ""), flush=True)
    return rows, reports


def report_tables(rows: list[dict], reports: list[dict], cpu: dict, lost: list[str], failures: list[str]) -> list:
    print("\nalice's latency (ms, medians): undisturbed window, disturbed (calls overlapping bob's window), ratio; "
          "after: calls started in the following window (not counted)")
    print_table(["round", "flood", "kind", "undisturbed n", "undisturbed ms", "disturbed n", "disturbed ms",
                 "disturbed max ms", "ratio", "after n", "after ms"],
                [[r["round"], r["flood"], r["kind"], r["quiet_n"], f"{r['quiet_ms']:.2f}", r["disturbed_n"],
                  f"{r['disturbed_ms']:.2f}", f"{r['disturbed_max_ms']:.2f}", f"x{r['ratio']:.2f}", r["after_n"],
                  f"{r['after_ms']:.2f}"] for r in rows])
    print("\nall rounds together (ms, medians of every sample)")
    print_table(["flood", "kind", "undisturbed n", "undisturbed ms", "disturbed n", "disturbed ms", "disturbed max ms",
                 "ratio", "per-round ratios", "median round"],
                [[s["flood"], s["kind"], s["quiet_n"], f"{s['quiet_ms']:.2f}", s["disturbed_n"],
                  f"{s['disturbed_ms']:.2f}", f"{s['disturbed_max_ms']:.2f}", f"x{s['ratio']:.2f}",
                  " ".join(f"x{x:.2f}" for x in s["round_ratios"]), f"x{s['median_round_ratio']:.2f}"]
                 for s in summary(rows)])
    print("\nbob's floods: his window (first message to probe answered), his CPU, the messages the controller dropped "
          "and the requests it refused since the last flood (its status), what came back to bob")
    print_table(["round", "flood", "window s", "bob CPU s", "dropped", "refused", "outcome", "answers"],
                [[r["round"], r["flood"], f"{r['window_s']:.2f}", f"{r['bob_cpu_s']:.2f}", dropped, refused,
                  r["outcome"][:100],
                  "; ".join(f"{k} x{v}" for k, v in sorted(r["answers"].items(), key=lambda kv: -kv[1]))]
                 for r, (dropped, refused) in zip(reports, counted_since_last(reports))])
    print("\nCPU in cores (CPU seconds per second of window, all rounds; a flood's window ends at bob's report; "
          "controller threads above 0.01)")
    rates = cpu_rates(cpu)
    keys = [k for k in dict.fromkeys(k for used in rates.values() for k in used)
            if not k.startswith("controller: ") or any(used.get(k, 0) > 0.01 for used in rates.values())]
    print_table(["who", *rates], [[k, *(f"{used.get(k, 0):.2f}" for used in rates.values())] for k in keys])
    lines = verdicts(rows, lost, len(failures))
    print("\n" + "\n".join(lines))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quiet-s", type=float, default=2.0, help="each undisturbed window, seconds")
    parser.add_argument("--after-s", type=float, default=1.0,
                        help="alice samples this long after bob's window before the next (not counted in either)")
    parser.add_argument("--junk", type=int, default=20_000, help="junk messages in flood (b)")
    parser.add_argument("--big-mb", type=float, default=16.0, help="MB of flood (a)'s one message")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="bob waits this long for his probe's answer")
    parser.add_argument("--max-queued-requests", type=int, default=None,
                        help="the controller's bound on a client's queue (default: its own)")
    parser.add_argument("--bob-nice", type=int, default=0,
                        help="bob's process runs at this niceness (19: his own CPU yields to everyone else's, as if "
                             "he ran on another machine)")
    parser.add_argument("--json", default=None,
                        help="where to write the results (default bench/results/tenant_flood.json)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # run the clean-up below: stop every process started
    scratch, began = tempfile.mkdtemp(prefix="tenant-flood-"), time.time()
    keys_dir = os.path.join(scratch, "keys")
    subprocess.run([sys.executable, "-m", "pathways_torch.launch.controller_main", "--make-keys", keys_dir,
                    "--clients", "alice,bob", "--executors", str(EXECUTORS)], cwd=ROOT, check=True, capture_output=True)
    extra = ["--max-queued-requests", str(args.max_queued_requests)] if args.max_queued_requests else []
    controller = Controller(keys_dir, os.path.join(scratch, "controller.log"), extra)
    bob = alice = None
    rows, reports, cpu = [], [], collections.defaultdict(collections.Counter)
    try:
        bob = Bob(os.path.join(keys_dir, "clients", "bob"), controller.address, os.path.join(scratch, "bob.log"),
                  args.bob_nice)
        alice = Alice(controller.address, os.path.join(keys_dir, "clients", "alice"))
        meter = CpuMeter(controller.process.pid, bob.pid)
        for _ in range(20):   # warm: traced, registered, compiled
            alice.sample()
        for index in range(1, args.rounds + 1):
            got_rows, got_reports = run_round(index, alice, bob, controller, meter, args, cpu)
            rows += got_rows
            reports += got_reports
        time.sleep(1.1)   # the status cache is at most 1 s old
        lost = executors_lost(get_status(controller.status, with_stats=False).executors)
        failures = list(alice.failures)
    except BaseException:
        print("the controller's log ends:\n" + controller.log_tail(), file=sys.stderr)
        raise
    finally:
        if alice is not None:
            alice.ctx.close()
        if bob is not None:
            bob.stop()
        controller.stop()
    lines = report_tables(rows, reports, cpu, lost, failures)
    elapsed = time.time() - began
    print(f"the whole run took {elapsed:.0f} s")
    payload = {"args": vars(args), "rows": rows, "floods": reports, "controller_cpu_s": cpu, "lost": lost,
               "alice_failures": failures, "verdicts": lines, "elapsed_s": elapsed}
    print("written to", write_results("tenant_flood", payload, args.json))
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
