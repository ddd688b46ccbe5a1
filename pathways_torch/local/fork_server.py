"""Executors forked from a process that imported torch and jax once, not started from scratch each.

An executor's process spends most of its start importing torch, jax and torchax (4.8 s of a 2-core machine's
time for ``import torchax``), and a context starts one per executor: a 2-executor context on the default backend
took 5.3-5.7 s to start, and 0.5-0.6 s with its executors forked from a server that had imported torch and jax
(measured, interleaved). The server (`executor.fork_server`) is started once per client process, at the first
context, with the environment executors get (glibc reads ``GLIBC_TUNABLES`` at exec, not at fork). It imports jax
too only for the XLA route's executors: a client whose first context is eager gets one without, and a second one,
with jax, at its first context on the XLA route.

A forked executor is driven through `ForkedProcess`, which answers as `subprocess.Popen` does (``pid``,
``poll``, ``wait``, ``returncode``, ``kill``); its exit status comes from the server, its parent.
``PATHWAYS_FORK_SERVER=0`` starts every executor with Popen instead.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import sys
import threading

from pathways_torch.wire.threads import leave_signals_to_the_main_thread, name_os_thread

__all__ = ["ForkServer", "ForkedProcess", "fork_server"]

_START_TIMEOUT_S = 120.0


class ForkServer:
    """The client's end of one fork server: spawn executors, learn when they end."""

    def __init__(self, environ: dict, with_jax: bool = True):
        self._process = subprocess.Popen([sys.executable, "-m", "executor.fork_server",
                                          *(["--with-jax"] if with_jax else [])],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=environ,
                                         start_new_session=True)
        self._pids: queue.Queue = queue.Queue()
        self._exits: dict[int, int] = {}
        self._changed = threading.Condition()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="pathways-fork-server", daemon=True)
        self._reader.start()
        ready = self._pids.get(timeout=_START_TIMEOUT_S)
        if ready is None:
            raise RuntimeError("the executors' fork server exited while it started (its errors are above)")

    def _read(self) -> None:
        name_os_thread()
        leave_signals_to_the_main_thread()   # the client's Ctrl-C is its main thread's
        for line in self._process.stdout:
            message = json.loads(line)
            if "exited" in message:
                with self._changed:
                    self._exits[message["exited"]] = message["code"]
                    self._changed.notify_all()
            else:   # "ready" first, then one "pid" per request, in order
                self._pids.put(message.get("pid", message.get("ready")))
        self._pids.put(None)

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def spawn(self, argv: list[str], environ: dict, log_path: str, append: bool) -> "ForkedProcess":
        """An executor process running ``python -m executor *argv`` with ``environ``, its output in ``log_path``."""
        request = {"argv": list(argv), "env": dict(environ), "log": log_path, "append": append, "cwd": os.getcwd()}
        with self._lock:
            self._process.stdin.write((json.dumps(request) + "\n").encode())
            self._process.stdin.flush()
            pid = self._pids.get(timeout=_START_TIMEOUT_S)
        if pid is None:
            raise RuntimeError("the executors' fork server exited; set PATHWAYS_FORK_SERVER=0 to start them one by one")
        return ForkedProcess(self, pid)

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits, timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        try:
            self._process.stdin.close()
            self._process.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            self._process.kill()


class ForkedProcess:
    """An executor forked by the server, with the part of `subprocess.Popen`'s interface the cluster uses."""

    def __init__(self, server: ForkServer, pid: int):
        self._forks, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._forks.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._forks.wait_exit(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"executor pid {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


_servers: dict[bool, ForkServer] = {}   # with jax or not → the server
_server_lock = threading.Lock()


def fork_server(environ: dict, with_jax: bool = True) -> ForkServer | None:
    """This process's fork server, started at the first call (None when ``PATHWAYS_FORK_SERVER=0``). ``with_jax``:
    one that imported jax too (1.5 s here), which only the XLA route's executors use; eager and inductor executors
    come from one that did not, so a client that uses them alone never pays for it."""
    if os.environ.get("PATHWAYS_FORK_SERVER", "1") == "0":
        return None
    with _server_lock:
        server = _servers.get(with_jax)
        if not with_jax and (server is None or not server.alive):   # one with jax serves eager executors as well
            server = _servers.get(True)
        if server is None or not server.alive:
            server = _servers[with_jax] = ForkServer(environ, with_jax)
            atexit.register(server.close)
        return server
