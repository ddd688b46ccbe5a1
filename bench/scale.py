"""The control plane's cost as N grows: the paper's Figure 6 at 16 .. 1,024 simulated executors.

Each N starts ``N`` simulated executors, ``--sims-per-process`` to a process (`executor.sim_host`), and runs a
Chained program of ``--steps`` nodes, every node occupying every device for T. Per N it reports:

- start-up: `pw.Context(...)` until every executor has registered;
- RSS of the client process (client and controller) and of the simulating processes, summed;
- heartbeat load: heartbeats the controller answers per second, and its process's CPU per second while idle;
- per program run, at ``--cpu-time-ms``: the client process's CPU by thread, and without the idle (heartbeat)
  load, per executor; control messages the controller sends and receives (heartbeats apart), bytes (heartbeats
  included); the client's requests to the controller and its data-socket messages (O(1) is the target);
- efficiency at each T: ``steps * T`` (the simulated devices' own clock: the ideal, since N processes cannot run
  a multi-controller loop here) over the measured time per run, awaited (each run waited for) and pipelined (fed
  futures, one wait at the end); the parity point is the smallest T from which it stays >= 95 %
  (`bench.overhead.parity_point`).

Prints a table, writes bench/results/scale.json and the figure docs/images/scale.png.

    .venv/bin/python -m bench.scale [--sizes 16,64,128,256,1024] [--times-ms 0.1,0.3,...] [--sims-per-process 64]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import time

import torch

import pathways_torch as pw
from bench.common import print_table, process_cpu_s, timed_calls, write_results
from bench.cpu_per_call import thread_cpu_s
from bench.overhead import chain_program, parity_point
from tests.handles import client_of, data_client_of, server_of, swap_client

_TARGETS_MS = {16: 0.3, 128: 2.3, 1024: 17.0}   # the parity targets (this 2-core machine)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class _CountingClient:
    """Counts the client's requests to the controller (every method call on the in-process client object)."""

    def __init__(self, client):
        self._client, self.requests = client, collections.Counter()

    def __getattr__(self, name):
        value = getattr(self._client, name)
        if callable(value) and not name.startswith("_"):
            def counted(*args, **kwargs):
                self.requests[name] += 1
                return value(*args, **kwargs)
            return counted
        return value


class Measurement:
    """One N: a context of simulated executors and what is measured on it."""

    def __init__(self, size: int, per_process: int, steps: int, tree: dict):
        self.size, self.steps = size, steps
        began = time.perf_counter()
        self.ctx = pw.Context(num_executors=size, backend="sim", sims_per_process=min(per_process, size),
                              start_timeout_s=600, **tree)
        self.startup_s = time.perf_counter() - began
        self.mesh = self.ctx.mesh({"data": size})
        self.x = self.ctx.put(torch.zeros(size), self.mesh, [pw.Shard(0)])
        self.server = server_of(self.ctx)
        self.hosts = sorted(set(self.ctx.executor_pids))

    def close(self) -> None:
        self.ctx.close()

    def memory(self) -> dict:
        return {"client_rss_mb": rss_mb(os.getpid()), "hosts_rss_mb": sum(rss_mb(pid) for pid in self.hosts),
                "processes": len(self.hosts)}

    def heartbeat_load(self, window_s: float = 5.0, settle_s: float = 2.0) -> dict:
        """Heartbeats answered per second and the client process's CPU per second by thread, idle (after every
        run, and a settle: the tail of start-up, the handshakes, is not idle load)."""
        time.sleep(settle_s)
        beats = self.server.handled_messages["heartbeat"]
        cpu = thread_cpu_s(os.getpid())
        time.sleep(window_s)
        after = thread_cpu_s(os.getpid())
        threads = {name: (after[name] - cpu.get(name, 0.0)) * 1e3 / window_s for name in after}
        return {"heartbeats_per_s": (self.server.handled_messages["heartbeat"] - beats) / window_s,
                "idle_cpu_ms_per_s": sum(threads.values()),
                "idle_threads_ms_per_s": {k: round(v, 1) for k, v in threads.items() if v > 0}}

    @contextlib.contextmanager
    def direct(self):
        """Runs sent to each executor, not down the launch tree (the controller's config, swapped for a while)."""
        controller = self.server.controller
        config = controller.config
        controller.config = dataclasses.replace(config, launch_fanout=0)
        try:
            yield
        finally:
            controller.config = config

    def per_run_both_ways(self, step_s: float, runs: int, rounds: int = 3) -> tuple[dict, dict | None]:
        """`per_run` down the tree and sent to each executor, interleaved in ``rounds``: the median round of each
        (by CPU); the second is None when no tree is used at this N."""
        config = self.server.controller.config
        if not (config.launch_fanout >= 2 and self.size >= config.launch_tree_min_executors):
            return self.per_run(step_s, runs), None
        tree, direct = [], []
        for _ in range(rounds):
            tree.append(self.per_run(step_s, max(1, runs // rounds)))
            with self.direct():
                direct.append(self.per_run(step_s, max(1, runs // rounds)))

        def median(measured):
            return sorted(measured, key=lambda r: r["client_cpu_ms"])[len(measured) // 2]

        return median(tree), median(direct)

    def per_run(self, step_s: float, runs: int) -> dict:
        """CPU by thread, messages and bytes per awaited run (`without_idle` takes the idle load off)."""
        chain = chain_program(self.steps, step_s)
        chain(self.x).exception(timeout_s=600)    # registration and lowering
        counting = _CountingClient(client_of(self.ctx))
        real = swap_client(self.ctx, counting)
        before = self._counters()
        cpu = thread_cpu_s(os.getpid())
        wall = timed_calls(chain, self.x, runs, awaited=True)
        after_cpu = thread_cpu_s(os.getpid())
        after = self._counters()
        swap_client(self.ctx, real)
        threads = {name: (after_cpu[name] - cpu.get(name, 0.0)) * 1e3 / runs for name in after_cpu}
        total = sum(threads.values())
        delta = {k: (after[k] - before[k]) / runs for k in after if k != "kinds"}
        kinds = {k: (n - before["kinds"].get(k, 0)) / runs for k, n in after["kinds"].items()
                 if n != before["kinds"].get(k, 0)}
        return {"step_ms": step_s * 1e3, "wall_ms": wall * 1e3 / runs,
                "client_cpu_ms": total, "threads_ms": {k: round(v, 2) for k, v in threads.items() if v > 0},
                "messages_sent": delta["sent"], "messages_received": delta["received"], "sent_by_kind": kinds,
                "bytes_sent": delta["bytes_sent"], "bytes_received": delta["bytes_received"],
                "heartbeats": delta["heartbeats"],
                "sent_per_executor": delta["sent"] / self.size, "received_per_executor": delta["received"] / self.size,
                "client_requests": sum(counting.requests.values()) / runs,
                "client_data_messages": delta["data_messages"]}

    def _counters(self) -> dict:
        controller = self.server.controller
        loop = self.server.loop
        data = data_client_of(self.ctx).loop
        return {"sent": sum(controller.messages_sent.values()), "kinds": dict(controller.messages_sent),
                "received": sum(controller.handled_messages.values()),   # control connections: Dones, replies
                "heartbeats": self.server.handled_messages["heartbeat"],
                "bytes_sent": self.server.command_bytes + loop.bytes_out["executors"],
                "bytes_received": loop.bytes_in["executors"],
                "data_messages": sum(data.messages_out.values()) + sum(data.messages_in.values())}

    def efficiency(self, step_s: float, repeats: int) -> dict:
        chain = chain_program(self.steps, step_s)
        chain(self.x).exception(timeout_s=600)
        ideal_s = repeats * self.steps * step_s
        awaited = timed_calls(chain, self.x, repeats, awaited=True)
        pipelined = timed_calls(chain, self.x, repeats, awaited=False)
        return {"executors": self.size, "step_ms": step_s * 1e3, "efficiency": ideal_s / awaited,
                "pipelined_efficiency": ideal_s / pipelined, "awaited_run_ms": awaited * 1e3 / repeats,
                "pipelined_run_ms": pipelined * 1e3 / repeats}


def chain_on_controller(controller, steps: int, executor_ids=None, function_id: int | None = None):
    """A Chained program of ``steps`` nodes registered on an in-process `Controller`, on ``executor_ids`` (None: every
    registered executor); its lowered form and a ready input array (bench and unit tests)."""
    from controller import CallSpec
    from controller.arrays import READY
    from controller.program import ProgramSpec
    from pathways_torch.wire import pb

    if function_id is None:
        function_id = controller.call_dispatch.register_function("step", pb.Graph(), [])
    count = len(executor_ids) if executor_ids is not None else len(controller.resources.executors)
    mesh = controller.resources.allocate({"data": count}, executor_ids)
    nodes = tuple(CallSpec(name="step", function_id=function_id, mesh=mesh, inputs=(i,), outputs=(i + 1,))
                  for i in range(steps))
    lowered = controller.call_dispatch.register_program(ProgramSpec(
        name="chain", input_values=(0,), input_meshes=(mesh,), output_values=(steps,), nodes=nodes))
    x = controller.arrays.new(mesh.executor_ids)
    x.state = READY
    return lowered, x


def controller_with_executors(outbox, config, size: int):
    """An in-process `Controller` with ``size`` simulated executors registered (e0 .. e{size-1})."""
    from controller import Controller
    from pathways_torch.wire import pb

    controller = Controller(outbox, config)
    for index in range(size):
        controller.on_message(f"e{index}", pb.Envelope(register=pb.Register(
            executor_id=f"e{index}", data_address=f"tcp://127.0.0.1:{7000 + index}", backend="sim")), [])
    return controller


def controller_python_us(size: int, steps: int, runs: int = 20) -> dict:
    """The controller's own Python per executor per run, without sockets: `CallDispatch.run_program` with an outbox
    that only serializes each message, then a Done from each executor."""
    from controller import ControllerConfig

    class SerializingOutbox:
        def to_executor(self, executor_id, envelope, payload=()):
            envelope.SerializeToString()

    controller = controller_with_executors(SerializingOutbox(), ControllerConfig(), size)
    lowered, x = chain_on_controller(controller, steps)
    send_s = done_s = 0.0
    for _ in range(runs):
        began = time.perf_counter()
        controller.call_dispatch.run_program(lowered.program_id, [x.array_id])
        send_s += time.perf_counter() - began
        call_id = max(controller.state.calls)   # the run's reporting node
        reports = _reports(controller, size, call_id)
        began = time.perf_counter()
        for executor_id, envelope in reports:
            controller.on_message(executor_id, envelope, [])
        done_s += time.perf_counter() - began
    return {"executors": size, "send_us": send_s * 1e6 / runs / size, "done_us": done_s * 1e6 / runs / size}


def _reports(controller, size: int, call_id: int) -> list:
    """What the executors send the controller when a run's reporting node ends: a Done each, or, down a launch tree,
    one batch from each of the controller's children with its subtree's successes (encoded and parsed, as sent)."""
    from pathways_torch.wire import pb

    tree = next(iter(controller.launch_trees._trees.values()), None)
    if tree is None:
        return [(f"e{index}", pb.Envelope.FromString(pb.Envelope(done=pb.Done(call_id=call_id, ok=True))
                                                     .SerializeToString())) for index in range(size)]
    reports = []
    for root in tree.roots:
        batch = pb.DoneBatch(generation=tree.generation, base_call_id=call_id)
        batch.groups.add(call_id=call_id, executor_ids=tree.members[root:tree.ends[root]], device_ns=1000)
        reports.append((tree.members[root], pb.Envelope.FromString(pb.Envelope(done_batch=batch).SerializeToString())))
    return reports


def without_idle(run: dict, load: dict, size: int) -> None:
    """Take the idle (heartbeat) load of the run's duration off its CPU: what the runs themselves cost."""
    idle = load["idle_cpu_ms_per_s"] * run["wall_ms"] / 1e3
    run["client_cpu_ms_without_heartbeats"] = max(0.0, run["client_cpu_ms"] - idle)
    run["cpu_us_per_executor"] = run["client_cpu_ms_without_heartbeats"] * 1e3 / size


def failure_at_scale(m: Measurement, step_s: float, window_s: float = 8.0) -> dict:
    """SIGKILL the last simulating process while a Chained loop runs on the executors of the others: how long until
    its executors are declared lost, what the controller's process spent meanwhile, what a call that needs them
    raises, and the loop's rate before and after."""
    import signal
    import threading

    victim = m.hosts[-1]
    lost_ids = [e for e, pid in zip(m.ctx.executor_ids, m.ctx.executor_pids) if pid == victim]
    alive_ids = [e for e in m.ctx.executor_ids if e not in lost_ids]
    alive = m.ctx.mesh({"data": len(alive_ids)}, alive_ids)
    doomed = m.ctx.mesh({"data": len(lost_ids)}, lost_ids)
    chain = chain_program(m.steps, step_s)
    x = m.ctx.put(torch.zeros(len(alive_ids)), alive, [pw.Shard(0)])
    y = m.ctx.put(torch.zeros(len(lost_ids)), doomed, [pw.Shard(0)])
    chain(x).exception(timeout_s=600)
    chain(y).exception(timeout_s=600)
    runs: list[float] = []     # when each run of the loop on the survivors ended
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            chain(x).exception(timeout_s=600)
            runs.append(time.perf_counter())

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    time.sleep(window_s)
    pending = chain(y)    # will never finish: its executors die under it
    cpu = process_cpu_s(os.getpid())
    killed = time.perf_counter()
    os.kill(victim, signal.SIGKILL)
    error = pending.exception(timeout_s=120)
    detected = time.perf_counter() - killed
    controller = m.server.controller
    deadline = time.monotonic() + 120
    while not all(controller.resources.executors[e].lost for e in lost_ids) and time.monotonic() < deadline:
        time.sleep(0.01)
    all_lost = time.perf_counter() - killed
    storm_cpu = process_cpu_s(os.getpid()) - cpu
    time.sleep(window_s)
    stop.set()
    worker.join(600)
    before = [t for t in runs if t < killed]
    after = [t for t in runs if t > killed + all_lost]

    def rate(times):
        return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0

    return {"killed_pid": victim, "lost_executors": len(lost_ids), "survivors": len(alive_ids),
            "first_failure_s": detected, "all_declared_lost_s": all_lost,
            "storm_cpu_ms": storm_cpu * 1e3, "error": f"{type(error).__name__}: {error}"[:300],
            "error_names_one": any(e in str(error) for e in lost_ids),
            "runs_per_s_before": rate(before), "runs_per_s_after": rate(after),
            # The first run on the survivors after the loss lowers the program again (its island's groups are gone):
            # 128 nodes x 960 executors of plans, seconds on 2 cores. The rate from the run after it on:
            "runs_per_s_after_relowering": rate(after[1:]),
            "slowest_run_after_s": max((b - a for a, b in zip(after, after[1:])), default=0.0),
            "heartbeat_timeout_s": m.ctx.config.heartbeat_timeout_s}


def plot(rows: list[dict], parity: dict, path: str) -> None:
    """Figure 6's shape: efficiency against computation size, a line per N, the 95 % line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for size in sorted({r["executors"] for r in rows}):
        mine = sorted((r for r in rows if r["executors"] == size), key=lambda r: r["step_ms"])
        point = parity[size]["awaited"]
        label = f"N={size} (parity {point:g} ms)" if point is not None else f"N={size} (no parity)"
        ax.plot([r["step_ms"] for r in mine], [100 * r["efficiency"] for r in mine], marker="o", label=label)
    ax.axhline(95, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("computation per node, T (ms)")
    ax.set_ylabel("Chained (awaited) / device clock (%)")
    ax.set_title("Single controller vs the ideal, 128-node Chained program, simulated devices")
    ax.set_ylim(0, 110)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,64,128,256,1024")
    parser.add_argument("--times-ms", default="0.1,0.3,1,2.3,5,10,17,35,70")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="runs per T and mode")
    parser.add_argument("--sims-per-process", type=int, default=64)
    parser.add_argument("--cpu-time-ms", type=float, default=1.0, help="T of the runs CPU is measured on")
    parser.add_argument("--cpu-runs", type=int, default=20, help="runs CPU is measured over (the clock ticks at "
                                                                  "100 Hz: a window should last seconds)")
    parser.add_argument("--figure", default="docs/images/scale.png")
    parser.add_argument("--kill", action="store_true", help="at the largest N, SIGKILL one simulating process while "
                                                             "a Chained loop runs on the others (failure at scale)")
    parser.add_argument("--kill-time-ms", type=float, default=10.0, help="T of that loop")
    parser.add_argument("--launch-fanout", type=int, default=32,
                        help="children per executor in a launch tree (0: none)")
    parser.add_argument("--launch-tree-min", type=int, default=128, help="executors from which runs use the tree")
    parser.add_argument("--in-process", action="store_true", help="only the controller's own Python per executor "
                                                                  "per run, without sockets (seconds)")
    args = parser.parse_args()
    if args.in_process:
        rows = [controller_python_us(int(size), args.steps) for size in args.sizes.split(",")]
        print_table(["N", "send µs/executor/run", "Done µs/executor/run"],
                    [[r["executors"], f"{r['send_us']:.1f}", f"{r['done_us']:.1f}"] for r in rows])
        print("written to", write_results("scale_in_process", {"rows": rows, "steps": args.steps}))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    times = [float(t) / 1000 for t in args.times_ms.split(",")]
    summary, rows, parity = {}, [], {}
    for size in sizes:
        print(f"N={size}: starting ...", flush=True)
        m = Measurement(size, args.sims_per_process, args.steps,
                        {"launch_fanout": args.launch_fanout, "launch_tree_min_executors": args.launch_tree_min})
        try:
            run, direct = m.per_run_both_ways(args.cpu_time_ms / 1000, args.cpu_runs)
            mine = []
            for step_s in times:
                row = m.efficiency(step_s, args.repeats)
                print(f"  T={step_s * 1e3:g} ms: awaited {row['efficiency']:.1%}, pipelined "
                      f"{row['pipelined_efficiency']:.1%}", flush=True)
                mine.append(row)
            memory = m.memory()
            load = m.heartbeat_load()
            without_idle(run, load, size)
            if direct is not None:
                without_idle(direct, load, size)
                run["sent_to_each_executor"] = direct
            if args.kill and size == sizes[-1]:
                failure = failure_at_scale(m, args.kill_time_ms / 1000)
                print(f"failure at N={size}: {failure}", flush=True)
                summary[f"failure_{size}"] = failure
        finally:
            m.close()
        rows += mine
        parity[size] = {"awaited": parity_point(mine), "pipelined": parity_point(mine, "pipelined_efficiency")}
        summary[size] = {"startup_s": m.startup_s, **memory, **load, "per_run": run}
    table = []
    for size in sizes:
        s, run = summary[size], summary[size]["per_run"]
        s["parity_ms"] = parity[size]
        table.append([size, s["processes"], f"{s['startup_s']:.1f}", f"{s['client_rss_mb']:,.0f}",
                      f"{s['hosts_rss_mb']:,.0f}", f"{s['heartbeats_per_s']:,.0f}", f"{s['idle_cpu_ms_per_s']:.0f}",
                      f"{run['client_cpu_ms_without_heartbeats']:.1f}", f"{run['cpu_us_per_executor']:.1f}",
                      f"{run['messages_sent']:,.0f} / {run['messages_received']:,.0f}",
                      f"{run['bytes_sent'] / 1e3:,.0f} / {run['bytes_received'] / 1e3:,.0f}",
                      f"{run['client_requests']:g} / {run['client_data_messages']:g}",
                      _parity_text(parity[size]["awaited"]), _parity_text(parity[size]["pipelined"]),
                      f"{_TARGETS_MS[size]:g}" if size in _TARGETS_MS else "-"])
    print_table(["N", "processes", "start-up s", "client+controller RSS MB", "simulators RSS MB", "heartbeats/s",
                 "idle CPU ms/s", f"CPU ms/run (T={args.cpu_time_ms:g} ms)", "CPU µs/executor/run",
                 "controller msgs out / in per run", "controller kB out / in per run",
                 "client requests / data msgs per run", "parity awaited ms", "parity pipelined ms", "target ms"],
                table)
    print_table(["N", "T ms", "awaited run ms", "efficiency", "pipelined run ms", "efficiency"],
                [[r["executors"], f"{r['step_ms']:g}", f"{r['awaited_run_ms']:,.1f}", f"{r['efficiency']:.1%}",
                  f"{r['pipelined_run_ms']:,.1f}", f"{r['pipelined_efficiency']:.1%}"] for r in rows])
    both = [size for size in sizes if "sent_to_each_executor" in summary[size]["per_run"]]
    if both:
        print(f"Down the launch tree (fanout {args.launch_fanout}) against sent to each executor, per awaited run at "
              f"T={args.cpu_time_ms:g} ms, interleaved rounds (median round of 3 each):")
        print_table(["N", "CPU µs/executor/run, tree", "direct", "controller msgs out / in, tree", "direct",
                     "awaited run ms, tree", "direct"],
                    [[size, f"{tree['cpu_us_per_executor']:.1f}", f"{direct['cpu_us_per_executor']:.1f}",
                      f"{tree['messages_sent']:,.0f} / {tree['messages_received']:,.0f}",
                      f"{direct['messages_sent']:,.0f} / {direct['messages_received']:,.0f}",
                      f"{tree['wall_ms']:,.1f}", f"{direct['wall_ms']:,.1f}"]
                     for size in both for tree in [summary[size]["per_run"]]
                     for direct in [tree["sent_to_each_executor"]]])
    for size in sizes:
        print(f"N={size}: client threads, ms per run at T={args.cpu_time_ms:g} ms: "
              f"{summary[size]['per_run']['threads_ms']}; idle, ms per s: {summary[size]['idle_threads_ms_per_s']}")
    if args.figure:
        plot(rows, parity, args.figure)
        print("figure written to", args.figure)
    print("written to", write_results("scale", {"summary": summary, "rows": rows, "parity_ms": parity,
                                                 "steps": args.steps, "sims_per_process": args.sims_per_process,
                                                 "launch_fanout": args.launch_fanout,
                                                 "launch_tree_min_executors": args.launch_tree_min}))


def _parity_text(point: float | None) -> str:
    return "not reached" if point is None else f"{point:g}"


if __name__ == "__main__":
    main()
