"""``pathways-run``'s flags: `LaunchConfig` (one node's launch, validated), the parser, `parse_args`, and the check
of the node's key folder. Bad flags raise `LaunchError` naming the flag, the value and the fix, before anything
starts. Running a node is `run.py`'s.

A node either launches a job (node 0 runs the script, whose ``pw.Context()`` hosts the controller; see run.py) or,
with ``--controller ADDR``, joins a standalone ``pathways-controller`` (docs/service.md): it starts only its
executors, with the keys of the service's ``DIR/executors`` folder, and runs no script.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket

from .environment import LaunchEnvironment, executor_ids

__all__ = ["LaunchConfig", "LaunchError", "parse_args", "route_address", "resolve_nproc", "node_keys"]

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
    # --controller: the executors' address of a standalone pathways-controller this node joins (no script runs).
    controller: str = ""

    @property
    def joins_controller(self) -> bool:
        return bool(self.controller)

    @property
    def controller_address(self) -> str:
        return self.controller or f"tcp://{self.master_addr}:{self.master_port}"

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
                    "runs --nproc-per-node executors that join it. Flags as torchrun's where they apply. With "
                    "--controller, nodes only run executors that join a standalone pathways-controller.",
        epilog="The script sees PATHWAYS_* variables, not RANK/WORLD_SIZE; pw.Context() in it attaches to the "
               "launched executors. See docs/launch.md.")
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes (hosts) in the job")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", default="1",
                        help="executors on this node: an integer, 'cpu' (one per CPU), 'gpu' (one per CUDA device) "
                             "or 'auto' (gpu if there are GPUs, else cpu)")
    parser.add_argument("--node-rank", "--node_rank", type=int, default=0,
                        help="this node's rank, 0 .. nnodes-1; node 0 runs the script")
    parser.add_argument("--master-addr", "--master_addr", default=None,
                        help="node 0's address, reachable from every node: the controller listens there "
                             "(default 127.0.0.1)")
    parser.add_argument("--master-port", "--master_port", type=int, default=None,
                        help="the controller's port on --master-addr (open it to the other nodes; default 29400)")
    parser.add_argument("--controller", default=None, metavar="tcp://HOST:PORT",
                        help="join a standalone pathways-controller instead of launching a script: the executors "
                             "address it prints ('executors at tcp://HOST:PORT'); this node starts its executors "
                             "with the service's keys (--keys-dir DIR/executors), runs no script, and serves until "
                             "SIGTERM/SIGINT (docs/launch.md)")
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
                             "node-0, node-1, ...; with --controller, the service's DIR/executors (pathways-controller "
                             "--make-keys); required unless --standalone")
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
    parser.add_argument("--status-port", type=int, default=None,
                        help="node 0: serve the controller's status (pathways-status 127.0.0.1:PORT) on loopback; "
                             "0: none")
    parser.add_argument("--make-keys", metavar="DIR", default=None,
                        help="write the run's keys for --nnodes x --nproc-per-node executors, one folder per node, "
                             "then exit (distribute node-K to node K only)")
    parser.add_argument("script", nargs="?", help="the training script (runs on node 0; none with --controller)")
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
    if args.controller is not None:
        _check_joining(args)
    elif not args.script:
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
    if args.controller is not None:
        master, port = _controller_host_port(args.controller)
    else:
        master = _resolve(args.master_addr or "127.0.0.1")
        port = 29400 if args.master_port is None else args.master_port
    if args.controller is not None and not args.keys_dir:
        raise LaunchError(f"--keys-dir: required with --controller (every connection is authenticated); give "
                          f"{_SERVICE_KEYS}")
    if not args.standalone and not args.keys_dir:
        raise LaunchError("--keys-dir: required with --nnodes/--master-addr (every connection is authenticated); "
                          "make the run's keys once with pathways-run --make-keys DIR --nnodes N --nproc-per-node P "
                          "and give node K its folder DIR/node-K; or use --standalone on one machine")
    host = args.host_addr or route_address(master, port)
    return LaunchConfig(nnodes=args.nnodes, nproc_per_node=resolve_nproc(args.nproc_per_node),
                        node_rank=args.node_rank, master_addr=master, master_port=port,
                        keys_dir=args.keys_dir or "", host_addr=host, island=args.island, run_id=args.run_id,
                        max_restarts=args.max_restarts, max_executor_restarts=args.max_executor_restarts,
                        kill_stopped_after_s=args.kill_stopped_after_s,
                        backend=args.backend or _default_backend(),
                        join_timeout_s=args.join_timeout_s, health_port=args.health_port,
                        status_port=args.status_port or 0, standalone=args.standalone, script=args.script or "",
                        script_args=tuple(args.script_args), controller=args.controller or "")


_SERVICE_KEYS = ("the service's executors folder, DIR/executors of pathways-controller --make-keys DIR "
                 "--clients ... --executors N")


def _check_joining(args) -> None:
    """``--controller``: this node joins a standalone controller; the flags of a launch's own controller, a script
    and spare keys have no place there."""
    given = f"--controller {args.controller}"
    if args.script:
        raise LaunchError(f"{given} with the script {args.script!r}: a node joining a standalone controller runs no "
                          f"script (each client connects to that controller itself: pw.Context(controller=..., "
                          f"keys=...)); drop {args.script!r}, or drop --controller to run it with its own controller")
    conflicts = [flag for flag, value in (("--master-addr", args.master_addr), ("--master-port", args.master_port),
                                          ("--status-port", args.status_port)) if value is not None]
    conflicts += ["--standalone"] if args.standalone else []
    if conflicts:
        raise LaunchError(f"{given} with {', '.join(conflicts)}: those place and serve a controller this launch "
                          f"starts, and with --controller none starts (the controller is the one at "
                          f"{args.controller}; its status: pathways-controller --status-port); drop "
                          f"{', '.join(conflicts)}")
    if args.max_executor_restarts > 0:
        raise LaunchError(f"--max-executor-restarts {args.max_executor_restarts} with --controller: a restarted "
                          f"executor uses one of its spare keys, which only pathways-run --make-keys makes; the "
                          f"service's keys (pathways-controller --make-keys) have none; drop --max-executor-restarts")


def _controller_host_port(address: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` → (HOST resolved, PORT); LaunchError naming the flag otherwise."""
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"--controller {address!r}: expected tcp://HOST:PORT, the executors address "
                          f"pathways-controller prints ('... executors at tcp://HOST:PORT')")
    whose = "the controller's host name or IP address as this node sees it"
    return _resolve(host.strip("[]"), "--controller", whose), int(port)


def _resolve(address: str, flag: str = "--master-addr", whose: str = "node 0's host name or IP address as every "
                                                                     "node sees it") -> str:
    try:
        return socket.gethostbyname(address)
    except OSError as exc:
        raise LaunchError(f"{flag} {address!r} does not resolve ({exc}); give {whose}") from None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _default_backend() -> str:
    """What ``pw.Context()`` would run on this (CPU) host: the installed XLA route."""
    from ..wire.backend_names import default_backend, resolve_backend_name

    return resolve_backend_name(default_backend("cpu"))


def node_keys(config: LaunchConfig) -> str:
    """This node's key folder, checked as its executors will read it: ``--keys-dir`` itself or its ``node-K``
    (a launch's keys: node 0's also holds the controller's and the client's); with ``--controller``, the service's
    executors folder, which holds every executor's key pair: only this node's executors' are checked."""
    from ..wire.security import KeyDirectory, SecurityError
    from .keys import node_folder, roles_of_node

    folder = node_folder(config.keys_dir, config.node_rank)
    folder = folder if os.path.isdir(folder) and not config.joins_controller else config.keys_dir
    roles = config.executor_ids if config.joins_controller else roles_of_node(config.node_rank, config.nproc_per_node)
    try:
        keys = KeyDirectory(folder)
        for role in roles:
            keys.keypair(role)
    except SecurityError as exc:
        own = " .. ".join(dict.fromkeys([config.executor_ids[0], config.executor_ids[-1]]))
        fix = (f"; with --controller give {_SERVICE_KEYS} (node {config.node_rank} with --nproc-per-node "
               f"{config.nproc_per_node} needs the keys of {own})" if config.joins_controller else "")
        raise LaunchError(f"--keys-dir {config.keys_dir}: {exc}{fix}") from None
    return folder
