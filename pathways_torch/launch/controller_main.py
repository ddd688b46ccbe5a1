"""``pathways-controller``: a standalone controller that many clients share (docs/service.md).

    pathways-controller --make-keys DIR --clients alice,bob [--executors 16]
    pathways-controller --keys-dir DIR --bind tcp://HOST:PORT [--status-port P]
                        [--num-executors N --backend B --islands 2,2] [--weights alice=1,bob=4]

The first writes the key folders (`service_keys`): give ``DIR/clients/NAME`` to client NAME alone. The second serves
until SIGTERM or SIGINT: clients at ``--bind``, executors at ``--executor-bind`` (the same host, a free port by
default). With ``--num-executors`` it starts them here; without, they join (``pathways-executor --controller ADDR
--id executor-K --keys-dir DIR/executors``). Once serving it prints one line, ``pathways-controller: serving
clients at ... executors at ...``, which scripts and tests wait for.

The composition root of the service: with `pathways_torch.client`, the one frontend module that hosts the
controller (tests/unit/test_house.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import types

import zmq

from controller import ControllerConfig
from controller.config import ServiceConfig
from controller.service import ControllerService

from ..client import InProcessClient
from ..config import ContextConfig
from ..wire.crash_stacks import enable_crash_stacks
from ..incarnations import Incarnations
from ..local.cluster import LocalCluster
from ..wire.limits import WEIGHT, bounded
from ..wire.security import CONTROLLER, Gatekeeper, KeyDirectory, SecurityError
from .environment import executor_ids
from .service_keys import admin_token, check_client_names, make_service_keys, service_folders

__all__ = ["main", "parse_weights"]

log = logging.getLogger(__name__)

_SWITCH_INTERVAL_S = 0.0002


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pathways-controller", description=__doc__.split("\n\n")[0])
    parser.add_argument("--make-keys", metavar="DIR", default=None,
                        help="write the key folders into DIR (new or empty) and exit; needs --clients")
    parser.add_argument("--clients", default="", help="with --make-keys: the clients' names, e.g. alice,bob")
    parser.add_argument("--executors", type=int, default=16, help="with --make-keys: executor key pairs to make")
    parser.add_argument("--keys-dir", default=None, help="the folder --make-keys wrote")
    parser.add_argument("--bind", default="tcp://127.0.0.1:0", help="where clients reach the controller")
    parser.add_argument("--executor-bind", default=None,
                        help="where executors reach it (default: --bind's host, a free port)")
    parser.add_argument("--status-port", type=int, default=0,
                        help="serve status, health and the operator's requests over gRPC on --status-host:PORT")
    parser.add_argument("--status-host", default="127.0.0.1",
                        help="where the status service listens (loopback by default: reading the status needs no "
                             "key; the operator's requests need the admin token in DIR/controller/admin.token)")
    parser.add_argument("--num-executors", type=int, default=0, help="start this many local executors")
    parser.add_argument("--backend", default=None, help="their backend (default: XLA, as pw.Context's)")
    parser.add_argument("--islands", default=None, help="their islands, executors per island: 2,2")
    parser.add_argument("--weights", default="", help="clients' shares, e.g. alice=1,bob=4 (default 1 each)")
    parser.add_argument("--executor-memory-bytes", type=int, default=0,
                        help="each executor's bytes of arrays (call outputs and puts), at most: a call or put "
                             "past it waits for frees, then fails with OutOfMemoryError (0: no limit)")
    parser.add_argument("--memory-wait-s", type=float, default=30.0,
                        help="how long a call or put waits for executor memory before OutOfMemoryError")
    parser.add_argument("--heartbeat-interval-s", type=float, default=0.5)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=10.0)
    parser.add_argument("--max-inflight", type=int, default=256, help="calls in flight before a client waits")
    parser.add_argument("--checkpoint-root", default="pathways-checkpoints", metavar="DIR",
                        help="where clients' checkpoints live, each under DIR/<client name>/ (the executors started "
                             "here get it; give joining ones the same: pathways-executor --checkpoint-root DIR). "
                             "Default: pathways-checkpoints in the working directory")
    _add_tenant_bounds(parser)
    return parser


def _add_tenant_bounds(parser: argparse.ArgumentParser) -> None:
    """What one client may ask of the service at most (`ServiceConfig`; docs/service.md, "Threats")."""
    defaults = ServiceConfig()
    parser.add_argument("--max-client-message-bytes", type=int, default=defaults.max_client_message_bytes,
                        help="one message from a client, at most: larger ones are refused, the client told why")
    parser.add_argument("--max-queued-requests", type=int, default=defaults.max_queued_requests,
                        help="a client's requests waiting for its worker, at most: past it the client is disconnected")
    parser.add_argument("--max-queued-bytes", type=int, default=defaults.max_queued_bytes,
                        help="the bytes of a client's requests waiting for its worker, at most")
    parser.add_argument("--max-program-nodes", type=int, default=defaults.max_program_nodes,
                        help="the nodes of one program, at most")
    parser.add_argument("--max-graph-bytes", type=int, default=defaults.max_graph_bytes,
                        help="a function's graph constants and creation-op outputs, in bytes, at most")
    parser.add_argument("--admission-timeout-s", type=float, default=defaults.admission_timeout_s,
                        help="a call waits this long for its turn on an island at most, then fails")


def service_config(args) -> ServiceConfig:
    """The `ServiceConfig` of the command line ``args``."""
    return ServiceConfig(max_client_message_bytes=args.max_client_message_bytes,
                         max_queued_requests=args.max_queued_requests, max_queued_bytes=args.max_queued_bytes,
                         max_program_nodes=args.max_program_nodes, max_graph_bytes=args.max_graph_bytes,
                         admission_timeout_s=args.admission_timeout_s,
                         checkpoint_root=getattr(args, "checkpoint_root", None))


def parse_weights(text: str, clients) -> dict[str, float]:
    """``"alice=1,bob=4"`` → ``{"alice": 1.0, "bob": 4.0}``; every client named must exist, every weight be in
    `WEIGHT`'s bounds."""
    weights = {name: 1.0 for name in clients}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--weights: expected NAME=WEIGHT items such as alice=1,bob=4, got {item!r}")
        if name not in weights:
            raise ValueError(f"--weights: no client {name!r}; the clients of these keys are {sorted(weights)}")
        try:
            weight = float(value)
        except ValueError:
            weight = value   # bounded() says what came
        weights[name] = bounded(weight, f"--weights: {name}={value}", WEIGHT,
                                "give a share of device time such as 1 (relative: 2 is twice 1's)")
    return weights


def _make_keys(args) -> int:
    folders = make_service_keys(args.make_keys, check_client_names(args.clients), executors=args.executors)
    print(f"pathways-controller: keys for {len(folders.clients)} client(s) and {args.executors} executor(s) in "
          f"{folders.root}:\n  controller: {folders.controller}\n  executors:  {folders.executors}")
    for name, folder in folders.clients.items():
        print(f"  client {name}: {folder}  (give it to {name} alone)")
    return 0


def _executor_bind(args) -> str:
    if args.executor_bind:
        return args.executor_bind
    host = args.bind.removeprefix("tcp://").rsplit(":", 1)[0]
    return f"tcp://{host}:0"


def _replacer(service, cluster, gatekeeper):
    """Lost local executors are replaced as an embedded context replaces its own (`Incarnations`): a fresh key
    admitted everywhere, the old one revoked, a new process in the lost one's place."""
    session = types.SimpleNamespace(client=InProcessClient(service.server), cluster=cluster,
                                    gatekeeper=gatekeeper, config=types.SimpleNamespace(controller=None))
    return Incarnations(session).replace


def _warn_if_status_is_open(host: str) -> None:
    """Status off loopback: anyone who reaches it reads the executors' hosts and the clients' names and load."""
    import ipaddress

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:   # a host name: it may resolve anywhere
        loopback = False
    if not loopback:
        log.warning("--status-host %s is not loopback: the status (executors' hosts, clients' names and load) is "
                    "readable by anyone who reaches it, unauthenticated; the operator's requests still need the "
                    "admin token (pathways-status --keys-dir DIR). Keep it on 127.0.0.1 unless a firewall stands "
                    "in front", host)


def serve(args, stop: threading.Event) -> int:
    """Serve until ``stop`` is set; 0 on a clean stop."""
    # A thread that wants the GIL waits this long before asking its holder to let go (CPython's default: 5 ms). A
    # client's worker busy in Python (a tenant flooding its own queue) held every other client's hand-off between
    # threads up to 5 ms each, 4.6x an awaited call's latency (tests/integration/test_tenant_flood.py); at 0.2 ms
    # the others' hand-offs barely wait.
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    folders = service_folders(args.keys_dir)
    args.checkpoint_root = os.path.abspath(args.checkpoint_root)   # the working directory at start, not later
    weights = parse_weights(args.weights, folders.clients)
    keys = KeyDirectory(folders.controller)
    start = None
    if args.num_executors:
        islands = tuple(int(n) for n in args.islands.split(",")) if args.islands else None
        start = ContextConfig(num_executors=args.num_executors, backend=args.backend, islands=islands,
                              heartbeat_interval_s=args.heartbeat_interval_s,
                              heartbeat_timeout_s=args.heartbeat_timeout_s)
        available = len([n for n in KeyDirectory(folders.executors).public_keys() if n.startswith("executor-")])
        if args.num_executors > available:
            raise ValueError(f"--num-executors {args.num_executors}: the keys in {args.keys_dir} are for "
                             f"{available} executors; make keys with --executors {args.num_executors} or more")
    # Two libzmq I/O threads: the client socket gets the second (ClientService), so decrypting one tenant's large
    # message never holds up the executors' sockets.
    context = zmq.Context(io_threads=2)
    gatekeeper = Gatekeeper(context, keys.public_keys())
    service = cluster = status = None
    try:
        config = ControllerConfig(bind_address=_executor_bind(args), heartbeat_interval_s=args.heartbeat_interval_s,
                                  heartbeat_timeout_s=args.heartbeat_timeout_s, max_inflight_calls=args.max_inflight,
                                  executor_memory_bytes=args.executor_memory_bytes, memory_wait_s=args.memory_wait_s)
        service = ControllerService(config, keys.credentials(CONTROLLER), context, args.bind, weights,
                                    service_config=service_config(args))
        if start is not None:
            ids = executor_ids(range(start.num_executors))
            cluster = LocalCluster(service.executor_address, ids, keys_dir=folders.executors,
                                   backend=start.resolved_backend, devices=start.executor_devices(),
                                   islands=start.executor_islands(), checkpoint_root=args.checkpoint_root,
                                   **start.liveness_fields())
            service.controller.members.wait_for_executors(len(ids), start.start_timeout_s)
            service.order_executors(ids)
            service.watch_exits(cluster.newly_exited, args.heartbeat_interval_s)
            service.clients.replacer = _replacer(service, cluster, gatekeeper)
        if args.status_port:
            service.admin.use_token(admin_token(folders.controller, create=True))
            _warn_if_status_is_open(args.status_host)
            status = service.serve_status(args.status_port, args.status_host)
        print(f"pathways-controller: serving clients at {service.client_address} executors at "
              f"{service.executor_address}" + (f" status on {args.status_host}:{args.status_port}" if status else ""),
              flush=True)
        stop.wait()
        return 0
    finally:
        if status is not None:
            status.stop(grace=0.2)
        if service is not None:
            service.stop("the controller was stopped (SIGTERM)")
        if cluster is not None:
            cluster.stop()
        gatekeeper.stop()
        context.term()


def main(argv=None) -> int:
    enable_crash_stacks()   # a native crash (or `kill -USR1`) writes every thread's stack to stderr
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pathways-controller %(levelname)s %(message)s")
    try:
        if args.make_keys:
            return _make_keys(args)
        if not args.keys_dir:
            raise ValueError("expected --keys-dir DIR (made by pathways-controller --make-keys DIR --clients ...), "
                             "or --make-keys DIR")
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        return serve(args, stop)
    except (ValueError, OSError, SecurityError) as exc:
        print(f"pathways-controller: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
