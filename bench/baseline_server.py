"""Baselines as long-lived processes, so a benchmark can interleave short timed windows of every system.

This machine's speed drifts by up to 30 % within a minute, so a ratio of two rates is
only meaningful when both were measured close together. Each baseline (Ray, Monarch)
runs as a server for one executor count: it sets up its N workers once, then answers
timed windows on request, and sits blocked on its input (no CPU) in between. (The
multi-controller loop does the same in-tree, through `bench.multicontroller.MultiController`.) The benchmark alternates windows of its own system
and of each baseline and reports the median of the per-round ratios.

Protocol, one line each way: ``<mode> <count>`` in, ``@@ <computations per second>``
out (other output lines — gloo's, Ray's, Monarch's — are skipped); ``@@ ready`` once
the workers are up; ``quit`` ends it.

Between its own windows a baseline is *paused*: its whole process tree (Ray's GCS,
raylet, dashboard and actors; Monarch's actor processes) is stopped with SIGSTOP, so
its daemons' background work (measured idle: Ray about 5 % of a core, Monarch about
2 %) does not slow the other systems' windows; resumed, it gets 0.3 s to catch up on
timers that fell due before its window starts. The runtime's own processes are never
paused (their idle cost, heartbeats, stays in every measurement, the baselines' too).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time

__all__ = ["serve", "serve_size", "BaselineProcess", "signal_tree"]

_MARK = "@@ "
_SETTLE_S = 0.3   # after a resume, before the window
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve_size(description: str) -> int:
    """A baseline module's command line: ``--serve N``, the number of workers to serve windows of."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--serve", type=int, required=True, metavar="N",
                        help="serve timed windows of N workers (see bench/baseline_server.py)")
    return parser.parse_args().serve


def serve(window, close=lambda: None) -> None:
    """Answer ``window(mode, count) -> rate`` requests read from stdin until ``quit`` or EOF."""
    print(f"{_MARK}ready", flush=True)
    try:
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "quit":
                break
            mode, count = words[0], int(words[1])
            print(f"{_MARK}{window(mode, count)!r}", flush=True)
    finally:
        close()


class BaselineProcess:
    """The client side: ``python -m bench.<module> --serve N`` with ``extra_path`` first on PYTHONPATH."""

    def __init__(self, module: str, size: int, extra_path: str = "", timeout_s: float = 600.0):
        self.name, self.timeout_s = module, timeout_s
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (extra_path, ROOT) if p))
        self._log = open(os.path.join(_log_dir(), f"{module}-{size}.log"), "w")
        self._proc = subprocess.Popen([sys.executable, "-u", "-m", f"bench.{module}", "--serve", str(size)],
                                      cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log, text=True, bufsize=1)
        # A reader thread, so a wait for an answer can time out (and see an exit) without select
        # on a buffered pipe.
        self._lines: queue.Queue = queue.Queue()
        self._paused = False
        threading.Thread(target=self._read, daemon=True).start()
        self._reply()   # ready

    def __enter__(self) -> "BaselineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def window(self, mode: str, count: int) -> float:
        """Computations per second of one timed window (``mode``: what the baseline calls its loops),
        resumed for it if paused."""
        with self._resumed():
            self._proc.stdin.write(f"{mode} {count}\n")
            self._proc.stdin.flush()
            return float(self._reply())

    def pause(self) -> None:
        """Stop the baseline's whole process tree until its next window (or `close`)."""
        signal_tree(self._proc.pid, signal.SIGSTOP)
        self._paused = True

    @contextlib.contextmanager
    def _resumed(self):
        paused = self._paused
        if paused:
            signal_tree(self._proc.pid, signal.SIGCONT)
            self._paused = False
            # Timers that fell due while stopped (health checks, heartbeats) fire now: let them
            # run before the window, not in it.
            time.sleep(_SETTLE_S)
        try:
            yield
        finally:
            if paused:
                self.pause()

    def close(self) -> None:
        if self._paused:
            signal_tree(self._proc.pid, signal.SIGCONT)
            self._paused = False
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write("quit\n")
                self._proc.stdin.close()
                self._proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def _read(self) -> None:
        for line in self._proc.stdout:
            if line.startswith(_MARK):
                self._lines.put(line[len(_MARK):].strip())
        self._lines.put(None)   # EOF: the process is gone

    def _reply(self) -> str:
        try:
            line = self._lines.get(timeout=self.timeout_s)
        except queue.Empty:
            self._proc.kill()
            raise TimeoutError(f"baseline {self.name}: no answer in {self.timeout_s:g} s; see {self._log.name}")
        if line is None:
            raise RuntimeError(f"baseline {self.name} exited (code {self._proc.wait()}); see {self._log.name}")
        return line


def signal_tree(root: int, signum: int) -> None:
    """Send ``signum`` to ``root`` and every process below it."""
    for pid in _descendants(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it (from /proc; Linux only, as the benchmarks are)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue   # exited meanwhile
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def _log_dir() -> str:
    path = os.path.join(ROOT, "bench", "results", "logs")
    os.makedirs(path, exist_ok=True)
    return path
