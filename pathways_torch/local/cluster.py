"""Start executor processes on this machine and make sure none outlives the client."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from .fork_server import fork_server

__all__ = ["LocalCluster", "describe_exit", "with_huge_pages"]

_HUGE_PAGES = "glibc.malloc.hugetlb=1"


class LocalCluster:
    """One executor process (``python -m executor``) per id in ``executor_ids``, connected to ``controller_address``.

    Each gets ``--parent-pid`` so it exits when this process dies, even by SIGKILL,
    and its own session so a Ctrl-C in the terminal reaches only the client, which
    then stops the executors by message. ``keys_dir`` is the launcher's key
    directory (`pathways_torch.wire.security.KeyDirectory`) with a key pair per id.
    ``checkpoint_root``: where they write service clients' checkpoints (`pathways-controller --checkpoint-root`).
    With ``sims_per_process`` (simulated executors only) one process runs up to that many of them
    (`executor.sim_host`): ``processes[i]`` is then the process executor i shares with others.
    """

    def __init__(self, controller_address: str, executor_ids: list[str], *, keys_dir: str, backend: str = "eager",
                 devices: list[str] | None = None, threads: int = 1, heartbeat_interval_s: float = 0.5,
                 heartbeat_timeout_s: float = 10.0,
                 log_dir: str | None = None, cpus: list[tuple[int, ...]] | None = None,
                 islands: list[str] | None = None, bind_host: str = "127.0.0.1", join_timeout_s: float = 60.0,
                 mmap_threshold_mb: float | None = None, sims_per_process: int | None = None,
                 checkpoint_root: str | None = None):
        # A log directory made here is removed when every executor ended cleanly (see `stop`): a test run
        # or a notebook starts many contexts, and each left one behind in /tmp.
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="pathways-logs-")
        self.executor_ids = list(executor_ids)
        self.processes: list[subprocess.Popen] = []
        self.replaced: list[subprocess.Popen] = []   # earlier incarnations (a stopped one may still run): killed at stop
        self._replaced_ids: list[str] = []           # the executor id of each of `replaced`
        self._reported: set[str] = set()
        devices = devices or ["cpu"] * len(self.executor_ids)
        cpus = cpus or [()] * len(self.executor_ids)
        islands = islands or [""] * len(self.executor_ids)
        self._argv = {}
        self._log_name = {}   # executor id -> the log of its process (simulated executors share one)
        for group in _process_groups(islands, sims_per_process):
            executor_id = self.executor_ids[group[0]]
            device, cores, island = devices[group[0]], cpus[group[0]], islands[group[0]]
            ids = [self.executor_ids[i] for i in group]
            self._argv[executor_id] = [
                sys.executable, "-m", "executor", "--controller", controller_address, "--id", ",".join(ids),
                "--backend", backend, "--device", device, "--threads", str(threads),
                "--parent-pid", str(os.getpid()), "--heartbeat-interval-s", str(heartbeat_interval_s),
                "--heartbeat-timeout-s", str(heartbeat_timeout_s), "--cpus", ",".join(map(str, cores)),
                "--host-addr", bind_host, "--join-timeout-s", str(join_timeout_s),
                *(["--island", island] if island else []),
                *(["--sim-count", str(len(ids))] if sims_per_process else []),
                *(["--mmap-threshold-mb", str(mmap_threshold_mb)] if mmap_threshold_mb is not None else []),
                *(["--checkpoint-root", checkpoint_root] if checkpoint_root is not None else [])]
            process = self._start(executor_id, keys_dir)
            for other in ids:
                self._log_name[other] = executor_id
                self.processes.append(process)
        atexit.register(self.stop, 2.0)

    def _start(self, executor_id: str, keys_dir: str, log_mode: str = "wb", extra_args=()) -> subprocess.Popen:
        # Transparent huge pages for the executor's large buffers (executor/allocator.py).
        env = with_huge_pages(dict(os.environ, PYTHONUNBUFFERED="1"))
        argv = self._argv[executor_id]
        # Simulated executors import no torch (their point is a small process): they keep Popen.
        backend = argv[argv.index("--backend") + 1]
        forkable = argv[1:3] == ["-m", "executor"] and backend != "sim"
        server = fork_server(env, with_jax=backend not in ("eager", "inductor")) if forkable else None
        if server is not None:   # torch and jax imported once (pathways_torch/local/fork_server.py)
            return server.spawn([*argv[3:], "--keys", keys_dir, *extra_args], env,
                                os.path.join(self.log_dir, f"{executor_id}.log"), append=log_mode == "ab")
        with open(os.path.join(self.log_dir, f"{executor_id}.log"), log_mode) as log_file:
            return subprocess.Popen([*self._argv[executor_id], "--keys", keys_dir, *extra_args],
                                    stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)

    def respawn(self, executor_id: str, keys_dir: str, extra_args=()) -> subprocess.Popen:
        """Start a new incarnation of ``executor_id`` with the keys in ``keys_dir`` (its log appended to the
        old one's; ``extra_args``: more flags, e.g. the spare key's role); the old process is kept (it may be
        stopped, not dead) and killed at `stop`."""
        index = self.executor_ids.index(executor_id)
        if self.processes.count(self.processes[index]) > 1:
            raise ValueError(f"{executor_id} is one of several simulated executors of one process "
                             f"(sims_per_process): it cannot be restarted alone")
        with open(os.path.join(self.log_dir, f"{executor_id}.log"), "ab") as log_file:
            log_file.write(f"\n---- replacement of pid {self.processes[index].pid} ----\n".encode())
        self.replaced.append(self.processes[index])
        self._replaced_ids.append(executor_id)
        self.processes[index] = self._start(executor_id, keys_dir, "ab", extra_args)
        self._reported.discard(executor_id)
        return self.processes[index]

    def replaced_incarnations(self) -> list[tuple[str, subprocess.Popen]]:
        """(executor id, process) of each earlier incarnation `respawn` replaced, oldest first."""
        return list(zip(self._replaced_ids, self.replaced))

    def process_of(self, executor_id: str) -> subprocess.Popen:
        return self.processes[self.executor_ids.index(executor_id)]

    @property
    def pids(self) -> list[int]:
        """One per process (simulated executors may share one), in order of their first executor."""
        return list(dict.fromkeys(p.pid for p in self.processes))

    def check_alive(self) -> None:
        """Raise with the log tail if an executor has already exited."""
        for executor_id, process in zip(self.executor_ids, self.processes):
            if process.poll() is not None:
                raise RuntimeError(f"executor {executor_id} exited with code {process.returncode} during start-up; "
                                   f"its log ends:\n{self.log_tail(executor_id)}")

    def newly_exited(self) -> list[tuple[str, str]]:
        """Executors whose process exited since the last call, each once, with how it ended."""
        exited = []
        for executor_id, process in zip(self.executor_ids, self.processes):
            if executor_id not in self._reported and process.poll() is not None:
                self._reported.add(executor_id)
                exited.append((executor_id, f"its process (pid {process.pid}) {describe_exit(process.returncode)}; "
                                            f"log: {os.path.join(self.log_dir, self._log_of(executor_id))}"))
        return exited

    def log_tail(self, executor_id: str, num_lines: int = 30) -> str:
        try:
            with open(os.path.join(self.log_dir, self._log_of(executor_id)), errors="replace") as f:
                return "".join(f.readlines()[-num_lines:])
        except OSError:
            return "(no log)"

    def _log_of(self, executor_id: str) -> str:
        return f"{self._log_name.get(executor_id, executor_id)}.log"

    def terminate(self) -> None:
        """SIGTERM to every executor still running (they have no controller left to tell them to stop)."""
        for process in dict.fromkeys(self.processes):
            if process.poll() is None:
                process.terminate()

    def stop(self, grace_s: float = 5.0) -> None:
        """Wait up to ``grace_s`` for executors told to shut down; kill the rest."""
        deadline = time.monotonic() + grace_s
        for process in self.replaced:   # incarnations declared lost: nothing to wait for
            if process.poll() is None:
                process.kill()
                process.wait(5)
        for process in dict.fromkeys(self.processes):
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        atexit.unregister(self.stop)
        self._remove_logs_if_clean()

    def _remove_logs_if_clean(self) -> None:
        """Drop our own log directory when every executor exited with code 0 and none died before; keep it
        (its path is in the error that reported the death) otherwise."""
        clean = not self._reported and not self.replaced and all(p.returncode == 0 for p in self.processes)
        if self._own_log_dir and clean:
            shutil.rmtree(self.log_dir, ignore_errors=True)


def _process_groups(islands: list[str], per_process: int | None) -> list[list[int]]:
    """Executor indices by process: one each, or up to ``per_process`` simulated executors of one island each."""
    groups: list[list[int]] = []
    for index, island in enumerate(islands):
        if groups and len(groups[-1]) < (per_process or 1) and islands[groups[-1][0]] == island:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def describe_exit(returncode: int) -> str:
    """``-9`` → ``"was killed by SIGKILL"``; ``3`` → ``"exited with code 3"``."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def with_huge_pages(environ: dict) -> dict:
    """``environ`` for an executor process: glibc's transparent huge pages for its large buffers (which it maps
    on their own: executor/allocator.py), unless ``GLIBC_TUNABLES`` already says how (``glibc.malloc.hugetlb``)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables:
        return environ
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{_HUGE_PAGES}" if tunables else _HUGE_PAGES}
