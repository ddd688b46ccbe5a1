"""Shared helpers for the benchmarks: the flags they share, tables, JSON results, trace spans."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import time

__all__ = ["write_results", "print_table", "spans", "machine", "add_run_arguments", "add_quick_and_json",
           "add_backend_argument", "add_model_arguments", "add_trace_dir_argument", "timed_calls", "process_cpu_s",
           "median", "rotated"]

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine() -> dict:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def add_run_arguments(parser, *, sizes: str, steps: int, repeats: int,
                      sizes_help: str = "comma-separated executor counts", steps_help: str | None = None,
                      repeats_help: str | None = None) -> None:
    """The flags every scaling benchmark takes: executor counts, steps per window, windows."""
    parser.add_argument("--sizes", default=sizes, help=sizes_help)
    parser.add_argument("--steps", type=int, default=steps, help=steps_help)
    parser.add_argument("--repeats", type=int, default=repeats, help=repeats_help)


def add_quick_and_json(parser, name: str, *, quick_help: str) -> None:
    """``--quick`` (a short run; ``quick_help`` says what it leaves out) and ``--json PATH`` (where
    `write_results` writes; default bench/results/<name>.json)."""
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--json", default=None, help=f"where to write the results (default bench/results/{name}.json)")


def add_backend_argument(parser, help: str = "the executors' backend (default: the runtime's)") -> None:
    """``--backend``: the executors' backend, None for the runtime's default."""
    parser.add_argument("--backend", default=None, help=help)


def add_model_arguments(parser, *, width: int | None, depth: int, batch: int | None = None,
                        depth_help: str | None = None, batch_help: str | None = None) -> None:
    """``--width`` and ``--depth`` of the benchmark's model, and ``--batch`` (rows) unless ``batch`` is
    None and no ``batch_help`` is given."""
    parser.add_argument("--width", type=int, default=width)
    parser.add_argument("--depth", type=int, default=depth, help=depth_help)
    if batch is not None or batch_help is not None:
        parser.add_argument("--batch", type=int, default=batch, help=batch_help)


def add_trace_dir_argument(parser, whose: str = "the executors'") -> None:
    """``--trace-dir``: keep the Chrome traces of the run here."""
    parser.add_argument("--trace-dir", default=None, help=f"keep {whose} Chrome traces here")


def write_results(name: str, payload: dict, path: str | None = None, **dump) -> str:
    """``payload`` after this machine's description, as JSON at ``path`` (``--json``; default
    bench/results/<name>.json); ``dump``: more `json.dump` options. Returns the path."""
    path = path or os.path.join(RESULTS_DIR, f"{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"machine": machine(), **payload}, f, indent=2, **dump)
    return path


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print(" | ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("-|-".join("-" * w for w in widths))
    for row in cells:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths)))


def spans(trace: dict, name: str, category: str) -> list[float]:
    """Durations (ms) of the complete events named ``name`` in ``category``."""
    return [e["dur"] / 1000.0 for e in trace["traceEvents"]
            if e.get("ph") == "X" and e.get("cat") == category and e.get("name") == name]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def rotated(items: list, shift: int) -> list:
    """``items`` rotated left by ``shift``: round i of a round-robin starts with item i mod n, so that no
    configuration always takes the same place in its rounds."""
    shift %= len(items)
    return list(items[shift:]) + list(items[:shift])


def timed_calls(run, x, count: int, *, awaited: bool, timeout_s: float = 600.0) -> float:
    """Seconds for ``count`` calls ``x = run(x)`` on pathways arrays: each waited for before the next
    (``awaited``), or each fed the previous call's future and only the last waited for (pipelined)."""
    began = time.perf_counter()
    for _ in range(count):
        x = run(x)
        if awaited:
            x.exception(timeout_s=timeout_s)
    error = x.exception(timeout_s=timeout_s)
    elapsed = time.perf_counter() - began
    if error is not None:   # a failing call is fast: never report its rate
        raise RuntimeError(f"a timed call failed, so its rate means nothing: {error}") from error
    return elapsed


def process_cpu_s(pid: int, tid: int | None = None) -> float | None:
    """User + system CPU seconds so far of process ``pid`` (every thread), or of its thread ``tid``,
    from ``/proc``; None if it is gone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime, stime (fields 14, 15)


def _rows(results, ranks: list, timeout_s: float) -> list:
    """One row from each rank; a rank that exits without its row fails the run at once (not at the timeout)."""
    import queue

    rows, deadline = [], time.monotonic() + timeout_s
    while len(rows) < len(ranks):
        try:
            rows.append(results.get(timeout=1.0))
            continue
        except queue.Empty:
            pass
        dead = [(i, p.exitcode) for i, p in enumerate(ranks) if p.exitcode not in (None, 0)]
        if not dead and all(p.exitcode is not None for p in ranks):      # all exited: their rows are queued
            try:
                rows.append(results.get(timeout=5.0))
                continue
            except queue.Empty:
                dead = [(i, p.exitcode) for i, p in enumerate(ranks)]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"torch ranks: {len(rows)} of {len(ranks)} rows came back; exited with a failure "
                               f"(rank, exit code): {dead}; see their output above")
    return rows


def run_ranks(target, size: int, args: tuple, prefix: str, timeout_s: float = 900.0) -> list:
    """``size`` spawned processes ``target(rank, *args, store_path, results)`` (torch's own, on gloo, meeting
    through a FileStore in a private folder); each puts one row, ``(rank, ...)``, on ``results``. The rows in rank
    order; every process is joined (killed after 60 s) and the folder removed."""
    import multiprocessing
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix=prefix)
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    ranks = [spawn.Process(target=target, args=(rank, *args, os.path.join(folder, "store"), results))
             for rank in range(size)]
    try:
        for process in ranks:
            process.start()
        return sorted(_rows(results, ranks, timeout_s))
    finally:
        for process in ranks:
            process.join(60)
            if process.is_alive():
                process.kill()
        shutil.rmtree(folder, ignore_errors=True)
