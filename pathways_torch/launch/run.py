"""``pathways-run``: launch a job on one or many hosts, with torchrun's flags.

In the single-controller model the user's script runs **once**, on node 0, where
``pw.Context()`` makes the controller; every node (node 0 too) runs ``--nproc-per-node``
executors that join it. So, unlike torchrun, only node 0 starts the script, and the script
sees no ``RANK`` / ``WORLD_SIZE`` (user code and libraries take those as a cue to call
``init_process_group``): it sees ``PATHWAYS_*`` variables (`environment.py`).

    pathways-run --standalone --nproc-per-node 2 train.py --steps 100          # one machine
    pathways-run --nnodes 2 --nproc-per-node 4 --node-rank $RANK --master-addr node0 \\
                 --master-port 29400 --keys-dir /secrets/pathways train.py          # on every node
    pathways-run --make-keys DIR --nnodes 2 --nproc-per-node 4                     # the run's keys, once
    pathways-run --nnodes 2 --nproc-per-node 4 --node-rank $RANK --controller tcp://HOST:PORT \
                 --keys-dir DIR/executors                       # join a standalone pathways-controller

Lifecycle: node 0 exits with the script's exit code once every executor it started has
exited; another node exits when its executors have (told by the controller when the script's
context closes, or when the controller stops answering, or when this launcher dies: each
executor watches its launcher's pid). Ctrl-C or SIGTERM on node 0 interrupts the script
(SIGINT: its context closes and stops every executor); SIGTERM on another node stops its
executors, and the script's next use of them fails with ``ExecutorLostError`` naming the
node. ``--max-restarts K`` starts the whole job again (at most K times) when it fails, as
torchrun does; the script resumes from its own last checkpoint.

With ``--controller`` (a standalone ``pathways-controller``, docs/service.md) no node runs a script: each starts
its executors, which join that controller and serve its clients, until SIGTERM/SIGINT (exit code 0) or until every
one of them has exited (exit code 1, with their logs' tails). Flags: `run_config.py`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from ..wire.crash_stacks import enable_crash_stacks
from .run_config import LaunchConfig, LaunchError, node_keys, parse_args, resolve_nproc, route_address

__all__ = ["LaunchConfig", "LaunchError", "parse_args", "main", "route_address", "resolve_nproc", "run"]


# ------------------------------------------------------------ running a node

class Node:
    """This node's executors (and, on node 0, the script); stopped together."""

    def __init__(self, config: LaunchConfig, keys_dir: str):
        self.config, self.keys_dir = config, keys_dir
        self.cluster = self.script = self.health = None
        self.interrupted = 0
        self._watching = False
        self.restarts: dict[str, int] = {}      # executor id → restarts so far (--max-executor-restarts)
        self._stopped_since: dict[int, float] = {}   # pid → when it was first seen stopped
        self._restart_lock = threading.Lock()
        self._stopping = False

    def start(self) -> None:
        from ..local.cluster import LocalCluster

        config = self.config
        env = config.environment()
        if config.node_rank == 0 and not config.joins_controller:
            # The script first: its imports (torch, seconds) overlap the executors' fork server's; its context waits
            # for them to join. Should the executors fail to start, `stop` kills it.
            environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
            environ.update(dataclasses.replace(env, keys_dir=self.keys_dir).to_environ())
            self.script = subprocess.Popen([sys.executable, config.script, *config.script_args], env=environ,
                                           preexec_fn=_die_with_parent)
        self.cluster = LocalCluster(
            config.controller_address, config.executor_ids, keys_dir=self.keys_dir, backend=config.backend,
            islands=[config.island] * config.nproc_per_node, bind_host=config.host_addr,
            join_timeout_s=config.join_timeout_s)
        joining = " (a standalone controller; no script runs here)" if config.joins_controller else ""
        _say(f"node {config.node_rank}: {config.nproc_per_node} executor(s) {', '.join(config.executor_ids)} on "
             f"{config.host_addr}, joining {config.controller_address}{joining}; logs in {self.cluster.log_dir}")
        if config.health_port:
            self._serve_health()
        if config.max_executor_restarts:
            threading.Thread(target=self._keep_executors, name="pathways-restarts", daemon=True).start()

    def _keep_executors(self) -> None:
        while not self._stopping:
            self.restart_lost_executors()
            time.sleep(0.2)

    def restart_lost_executors(self) -> None:
        """Start again each executor of this node that died (a signal) or was told it is lost (exit code
        EXIT_LOST), with its next spare key, while --max-executor-restarts allows; the controller takes the new
        incarnation in the old one's place and revokes the old key (docs/faults.md)."""
        from ..local.cluster import describe_exit
        from ..wire.security import spare_role

        with self._restart_lock:
            for executor_id in self.cluster.executor_ids:
                process = self.cluster.process_of(executor_id)
                code = process.poll()
                done = self.restarts.get(executor_id, 0)
                if code is None and done < self.config.max_executor_restarts and not self._stopping:
                    self._kill_if_stopped_too_long(executor_id, process)
                    continue
                if (code is None or self._stopping or done >= self.config.max_executor_restarts
                        or not (code < 0 or code == _EXIT_LOST)):
                    continue
                self.restarts[executor_id] = done + 1
                role = spare_role(executor_id, done + 1)
                _say(f"node {self.config.node_rank}: {executor_id} (pid {process.pid}) {describe_exit(code)}; "
                     f"starting it again with the key {role} (restart {done + 1} of "
                     f"{self.config.max_executor_restarts})")
                self.cluster.respawn(executor_id, self.keys_dir, extra_args=("--key-role", role))

    def _kill_if_stopped_too_long(self, executor_id: str, process) -> None:
        """A stopped executor is a live process to this node but lost to the controller, which cannot replace it
        here: past --kill-stopped-after-s it is killed, and the next pass starts it again as one that died."""
        from ..wire.process_state import is_stopped

        if not is_stopped(process.pid):
            self._stopped_since.pop(process.pid, None)
            return
        since = self._stopped_since.setdefault(process.pid, time.monotonic())
        if time.monotonic() - since >= self.config.kill_stopped_after_s:
            _say(f"node {self.config.node_rank}: {executor_id} (pid {process.pid}) has been stopped for "
                 f"{time.monotonic() - since:.0f} s (--kill-stopped-after-s {self.config.kill_stopped_after_s:g}); "
                 f"killing it to start it again")
            process.send_signal(signal.SIGKILL)
            del self._stopped_since[process.pid]

    def _serve_health(self) -> None:
        """grpc.health.v1 for this node, kept current by a thread: '' serving while everything it started runs."""
        import threading

        from .health import HealthServer

        self.health = HealthServer(f"{self.config.host_addr}:{self.config.health_port}")
        self._watching = True

        def watch():
            while self._watching:
                alive = {e: p.poll() is None for e, p in zip(self.cluster.executor_ids, self.cluster.processes)}
                for executor_id, up in alive.items():
                    self.health.set(executor_id, up)
                script_up = self.script is None or self.script.poll() is None
                self.health.set("", all(alive.values()) and script_up)
                time.sleep(0.5)

        threading.Thread(target=watch, name="pathways-health", daemon=True).start()
        _say(f"node {self.config.node_rank}: grpc.health.v1 on {self.health.address}")

    def wait(self) -> int:
        """The node's exit code: the script's on node 0; elsewhere 0 when every executor ended cleanly."""
        if self.script is not None:
            code = _wait_interruptibly(self.script)
            self._stopping = True     # executors that exit from now on are not started again
            if code != 0:
                # A script that failed may have made no context, or lost it: nothing tells its executors to stop.
                # SIGTERM now (a grace of seconds spent waiting for nothing), SIGKILL for what outlives it.
                self.cluster.terminate()
            # The script's context told them to stop: kill what has not stopped by then.
            self.cluster.stop(grace_s=10.0 if code == 0 else 3.0)
            return code
        if self.config.joins_controller:
            return self._serve()
        while True:
            if self.config.max_executor_restarts:
                self.restart_lost_executors()
            if all(p.poll() is not None for p in self.cluster.processes):
                break
            time.sleep(0.2)
        codes = [p.returncode for p in self.cluster.processes]
        self.cluster.stop(grace_s=0.0)
        return 0 if all(c == 0 for c in codes) else 1

    def _serve(self) -> int:
        """--controller: until interrupted (0), or until every executor has exited (1, with their logs' tails); each
        exit is told as it happens (the others go on serving the controller's clients)."""
        from ..local.cluster import describe_exit

        cluster, rank = self.cluster, self.config.node_rank
        while any(p.poll() is None for p in cluster.processes):
            for executor_id, how in ([] if self.interrupted else cluster.newly_exited()):
                _say(f"node {rank}: {executor_id}: {how}")
            time.sleep(0.2)
        if self.interrupted:
            _say(f"node {rank}: stopped its executors {', '.join(cluster.executor_ids)}")
            return 0
        cluster.newly_exited()      # keeps the logs (named below) at stop
        for executor_id, process in zip(cluster.executor_ids, cluster.processes):
            tail = cluster.log_tail(executor_id, 15).rstrip()
            _say(f"node {rank}: {executor_id} (pid {process.pid}) {describe_exit(process.returncode)}; "
                 + (f"its log ends:\n{tail}" if tail else "its log is empty"))
        _say(f"node {rank}: every executor of this node has exited; it no longer serves {self.config.controller}")
        return 1

    def interrupt(self, signum: int) -> None:
        """Ctrl-C / SIGTERM: the script gets SIGINT (its context closes cleanly), then SIGKILL if it insists;
        a node without the script stops its executors."""
        self.interrupted += 1
        if self.script is not None and self.script.poll() is None:
            self.script.send_signal(signal.SIGINT if self.interrupted == 1 else signal.SIGKILL)
        elif self.cluster is not None:
            for process in self.cluster.processes:
                if process.poll() is None:
                    process.terminate()

    def stop(self) -> None:
        self._watching = False
        self._stopping = True
        if self.health is not None:
            self.health.stop()
        if self.script is not None and self.script.poll() is None:
            self.script.kill()
            self.script.wait()
        if self.cluster is not None:
            self.cluster.stop(grace_s=2.0)


_EXIT_LOST = 3   # executor.process.EXIT_LOST (not imported: that module imports zmq and the executor's parts)


def _die_with_parent() -> None:
    """In the script's process, before exec: SIGTERM when this launcher dies (even by SIGKILL), as the
    executors do through --parent-pid."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):   # not Linux: the script outlives a killed launcher
        pass


def _wait_interruptibly(process: subprocess.Popen) -> int:
    while True:
        try:
            return process.wait()
        except KeyboardInterrupt:   # the terminal's Ctrl-C reached the script too; wait for it to close
            continue


def _say(message: str) -> None:
    print(f"pathways-run: {message}", file=sys.stderr, flush=True)


def run(config: LaunchConfig) -> int:
    """Start the node, wait for it, restart the job up to --max-restarts times; the exit code."""
    standalone_keys = None
    if config.standalone:
        from .keys import make_run_keys

        standalone_keys = tempfile.mkdtemp(prefix="pathways-run-keys-")
        make_run_keys(os.path.join(standalone_keys, "run"), 1, config.nproc_per_node)
        config = dataclasses.replace(config, keys_dir=os.path.join(standalone_keys, "run"))
    keys = node_keys(config)
    node = None
    handler = lambda signum, frame: node.interrupt(signum) if node is not None else None   # noqa: E731
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for attempt in range(config.max_restarts + 1):
            node = Node(config, keys)
            try:
                node.start()
                code = node.wait()
            finally:
                node.stop()
            if code == 0 or node.interrupted or attempt == config.max_restarts:
                return code
            _say(f"node {config.node_rank}: the job failed (exit code {code}); restart {attempt + 1} of "
                 f"{config.max_restarts}")
        return code
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if standalone_keys is not None:
            import shutil

            shutil.rmtree(standalone_keys, ignore_errors=True)


def main(argv=None) -> int:
    enable_crash_stacks()   # a native crash (or `kill -USR1`) writes every thread's stack to stderr
    try:
        parsed = parse_args(argv)
        if isinstance(parsed, tuple):
            from .keys import make_run_keys

            folders = make_run_keys(*parsed)
            _say(f"wrote {len(folders)} key folder(s): " + ", ".join(folders) +
                 "; give node K only its folder (node-0 also holds the controller's and the client's keys)")
            return 0
        return run(parsed)
    except LaunchError as exc:
        _say(str(exc))
        return 2


if __name__ == "__main__":
    sys.exit(main())
