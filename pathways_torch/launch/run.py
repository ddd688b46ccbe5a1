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

Lifecycle: node 0 exits with the script's exit code once every executor it started has
exited; another node exits when its executors have (told by the controller when the script's
context closes, or when the controller stops answering, or when this launcher dies: each
executor watches its launcher's pid). Ctrl-C or SIGTERM on node 0 interrupts the script
(SIGINT: its context closes and stops every executor); SIGTERM on another node stops its
executors, and the script's next use of them fails with ``ExecutorLostError`` naming the
node. ``--max-restarts K`` starts the whole job again (at most K times) when it fails, as
torchrun does; the script resumes from its own last checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from .environment import LaunchEnvironment, executor_ids

__all__ = ["LaunchConfig", "parse_args", "main", "route_address", "resolve_nproc"]

STANDALONE_PORT = 0        # --standalone: any free port on loopback


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """One node's launch, validated (see ``pathways-run --help``)."""

    nnodes: int
    nproc_per_node: int
    node_rank: int
    master_addr: str
    master_port: int
    keys_dir: str
    host_addr: str
    island: str = ""
    run_id: str = "none"
    max_restarts: int = 0
    max_executor_restarts: int = 0   # per executor of this node, each with the next spare key (keys.SPARES)
    # With restarts: an executor stopped (SIGSTOP, a tracer) this long is killed, then restarted like a dead one.
    kill_stopped_after_s: float = 60.0
    backend: str = ""
    join_timeout_s: float = 300.0
    health_port: int = 0
    status_port: int = 0
    standalone: bool = False
    script: str = ""
    script_args: tuple[str, ...] = ()

    @property
    def controller_address(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"

    @property
    def executor_ids(self) -> list[str]:
        first = self.node_rank * self.nproc_per_node
        return executor_ids(range(first, first + self.nproc_per_node))

    def environment(self) -> LaunchEnvironment:
        return LaunchEnvironment(controller_bind=self.controller_address, keys_dir=self.keys_dir,
                                 nnodes=self.nnodes, nproc_per_node=self.nproc_per_node, backend=self.backend,
                                 run_id=self.run_id, join_timeout_s=self.join_timeout_s,
                                 status_port=self.status_port if self.node_rank == 0 else 0)


class LaunchError(SystemExit):
    """Bad flags: the message names the flag, the value and the fix; the launcher exits 2, starting nothing."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pathways-run",
        description="Launch a pathways_torch job: the script runs once, on node 0 (client + controller); every node "
                    "runs --nproc-per-node executors that join it. Flags as torchrun's where they apply.",
        epilog="The script sees PATHWAYS_* variables, not RANK/WORLD_SIZE; pw.Context() in it attaches to the "
               "launched executors. See docs/launch.md.")
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes (hosts) in the job")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", default="1",
                        help="executors on this node: an integer, 'cpu' (one per CPU), 'gpu' (one per CUDA device) "
                             "or 'auto' (gpu if there are GPUs, else cpu)")
    parser.add_argument("--node-rank", "--node_rank", type=int, default=0,
                        help="this node's rank, 0 .. nnodes-1; node 0 runs the script")
    parser.add_argument("--master-addr", "--master_addr", default="127.0.0.1",
                        help="node 0's address, reachable from every node: the controller listens there")
    parser.add_argument("--master-port", "--master_port", type=int, default=29400,
                        help="the controller's port on --master-addr (open it to the other nodes)")
    parser.add_argument("--standalone", action="store_true",
                        help="one node: loopback, a free port, keys made for this run in a private temporary folder")
    parser.add_argument("--run-id", "--run_id", default="none", help="a name for the job (shown in logs)")
    parser.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                        help="start the whole job again at most this many times when it fails")
    parser.add_argument("--max-executor-restarts", type=int, default=0,
                        help="start an executor of this node again when it dies, at most this many times each "
                             "(with its next spare key: at most 3); the script's trainer recovers onto it "
                             "(checkpoint_every, docs/faults.md)")
    parser.add_argument("--kill-stopped-after-s", type=float, default=60.0,
                        help="with --max-executor-restarts: an executor of this node stopped (SIGSTOP, a tracer) "
                             "this long is killed and started again like one that died (the controller has "
                             "declared it lost by then if its heartbeat bound is shorter)")
    parser.add_argument("--island", default="", help="the island of this node's executors (default: island 0)")
    parser.add_argument("--keys-dir", default=None,
                        help="this run's keys (pathways-run --make-keys): this node's folder, or the folder holding "
                             "node-0, node-1, ...; required unless --standalone")
    parser.add_argument("--host-addr", default=None,
                        help="the address this node's executors bind and advertise (default: this host's address on "
                             "the interface that routes to --master-addr)")
    parser.add_argument("--backend", default=None,
                        help="the executors' backend (default: the runtime's, e.g. xla:torchax on CPU)")
    parser.add_argument("--join-timeout-s", type=float, default=300.0,
                        help="how long executors wait for the controller, and the controller for every executor")
    parser.add_argument("--health-port", type=int, default=0,
                        help="serve grpc.health.v1 on --host-addr:PORT for the scheduler's probes (service '': this "
                             "node; 'executor-K': each of its executors); 0: none")
    parser.add_argument("--status-port", type=int, default=0,
                        help="node 0: serve the controller's status (pathways-status 127.0.0.1:PORT) on loopback; "
                             "0: none")
    parser.add_argument("--make-keys", metavar="DIR", default=None,
                        help="write the run's keys for --nnodes x --nproc-per-node executors, one folder per node, "
                             "then exit (distribute node-K to node K only)")
    parser.add_argument("script", nargs="?", help="the training script (runs on node 0)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def resolve_nproc(value: str) -> int:
    """``--nproc-per-node``: an integer >= 1, or cpu / gpu / auto as torchrun reads them."""
    if value in ("cpu", "gpu", "auto"):
        gpus = _cuda_count()
        if value == "gpu" and gpus == 0:
            raise LaunchError("--nproc-per-node gpu: this host has no CUDA device (torch.cuda.device_count() is 0); "
                              "give a number of CPU executors, e.g. --nproc-per-node 2, or 'cpu'")
        if value == "gpu" or (value == "auto" and gpus):
            return gpus
        return os.cpu_count() or 1
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise LaunchError(f"--nproc-per-node {value!r}: expected an integer >= 1, 'cpu', 'gpu' or 'auto'")
    return count


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:   # noqa: BLE001 - no torch or no driver: no GPUs
        return 0


def route_address(master_addr: str, master_port: int) -> str:
    """This host's address on the interface that routes to ``master_addr`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master_addr, master_port or 9))
        return probe.getsockname()[0]


def parse_args(argv=None) -> LaunchConfig | tuple[str, int, int]:
    """A `LaunchConfig`, or ``(DIR, nnodes, nproc)`` for ``--make-keys``; bad flags raise `LaunchError`."""
    args = _parser().parse_args(argv)
    if args.make_keys:
        return args.make_keys, args.nnodes, resolve_nproc(args.nproc_per_node)
    if not args.script:
        raise LaunchError("pathways-run: expected a script to run (pathways-run [flags] train.py [its args]); "
                          "see pathways-run --help")
    if args.standalone:
        args.nnodes, args.node_rank, args.master_addr, args.master_port = 1, 0, "127.0.0.1", _free_port()
    if args.nnodes < 1:
        raise LaunchError(f"--nnodes {args.nnodes}: expected >= 1")
    if not 0 <= args.node_rank < args.nnodes:
        raise LaunchError(f"--node-rank {args.node_rank}: expected 0 .. {args.nnodes - 1} for --nnodes {args.nnodes}; "
                          f"give each node its own rank (SLURM: $SLURM_NODEID; Kubernetes: the pod's index)")
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts {args.max_restarts}: expected >= 0")
    from .keys import SPARES

    if not args.kill_stopped_after_s > 0:
        raise LaunchError(f"--kill-stopped-after-s {args.kill_stopped_after_s}: expected a positive number of seconds")
    if not 0 <= args.max_executor_restarts <= SPARES:
        raise LaunchError(f"--max-executor-restarts {args.max_executor_restarts}: expected 0 .. {SPARES} (each "
                          f"restart uses one of the {SPARES} spare keys --make-keys made per executor)")
    master = _resolve(args.master_addr)
    if not args.standalone and not args.keys_dir:
        raise LaunchError("--keys-dir: required with --nnodes/--master-addr (every connection is authenticated); "
                          "make the run's keys once with pathways-run --make-keys DIR --nnodes N --nproc-per-node P "
                          "and give node K its folder DIR/node-K; or use --standalone on one machine")
    host = args.host_addr or route_address(master, args.master_port)
    return LaunchConfig(nnodes=args.nnodes, nproc_per_node=resolve_nproc(args.nproc_per_node),
                        node_rank=args.node_rank, master_addr=master, master_port=args.master_port,
                        keys_dir=args.keys_dir or "", host_addr=host, island=args.island, run_id=args.run_id,
                        max_restarts=args.max_restarts, max_executor_restarts=args.max_executor_restarts,
                        kill_stopped_after_s=args.kill_stopped_after_s,
                        backend=args.backend or _default_backend(),
                        join_timeout_s=args.join_timeout_s, health_port=args.health_port,
                        status_port=args.status_port, standalone=args.standalone, script=args.script,
                        script_args=tuple(args.script_args))


def _resolve(address: str) -> str:
    try:
        return socket.gethostbyname(address)
    except OSError as exc:
        raise LaunchError(f"--master-addr {address!r} does not resolve ({exc}); give node 0's host name or IP "
                          f"address as every node sees it") from None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _default_backend() -> str:
    """What ``pw.Context()`` would run on this (CPU) host: the installed XLA route."""
    from ..wire.backend_names import default_backend, resolve_backend_name

    return resolve_backend_name(default_backend("cpu"))


def _node_keys(config: LaunchConfig) -> str:
    """This node's key folder: ``--keys-dir`` itself, or its ``node-K``; checked as executors will read it."""
    from ..wire.security import KeyDirectory, SecurityError
    from .keys import node_folder, roles_of_node

    folder = node_folder(config.keys_dir, config.node_rank)
    folder = folder if os.path.isdir(folder) else config.keys_dir
    try:
        keys = KeyDirectory(folder)
        for role in roles_of_node(config.node_rank, config.nproc_per_node):
            keys.keypair(role)
    except SecurityError as exc:
        raise LaunchError(f"--keys-dir {config.keys_dir}: {exc}") from None
    return folder


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
        self.cluster = LocalCluster(
            config.controller_address, config.executor_ids, keys_dir=self.keys_dir, backend=config.backend,
            islands=[config.island] * config.nproc_per_node, bind_host=config.host_addr,
            join_timeout_s=config.join_timeout_s)
        _say(f"node {config.node_rank}: {config.nproc_per_node} executor(s) {', '.join(config.executor_ids)} on "
             f"{config.host_addr}, joining {config.controller_address}; logs in {self.cluster.log_dir}")
        if config.node_rank == 0:
            environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
            environ.update(dataclasses.replace(env, keys_dir=self.keys_dir).to_environ())
            self.script = subprocess.Popen([sys.executable, config.script, *config.script_args], env=environ,
                                           preexec_fn=_die_with_parent)
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
            # The script's context told them to stop (a script that failed before making one did not): kill
            # what has not stopped by then.
            self.cluster.stop(grace_s=10.0 if code == 0 else 3.0)
            return code
        while True:
            if self.config.max_executor_restarts:
                self.restart_lost_executors()
            if all(p.poll() is not None for p in self.cluster.processes):
                break
            time.sleep(0.2)
        codes = [p.returncode for p in self.cluster.processes]
        self.cluster.stop(grace_s=0.0)
        return 0 if all(c == 0 for c in codes) else 1

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
    keys = _node_keys(config)
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
