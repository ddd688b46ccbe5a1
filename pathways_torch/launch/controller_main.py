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
import signal
import sys
import threading
import types

import zmq

from controller import ControllerConfig
from controller.service import ControllerService

from ..client import InProcessClient
from ..config import ContextConfig
from ..incarnations import Incarnations
from ..local.cluster import LocalCluster
from ..wire.security import CONTROLLER, Gatekeeper, KeyDirectory, SecurityError
from .environment import executor_ids
from .service_keys import check_client_names, make_service_keys, service_folders

__all__ = ["main", "parse_weights"]

log = logging.getLogger(__name__)


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
                        help="where the status service listens (loopback by default: it is not authenticated)")
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
    return parser


def parse_weights(text: str, clients) -> dict[str, float]:
    """``"alice=1,bob=4"`` → ``{"alice": 1.0, "bob": 4.0}``; every client named must exist, every weight be > 0."""
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
            weight = float("nan")
        if not weight > 0 or weight == float("inf"):
            raise ValueError(f"--weights: {name}={value!r}: expected a weight > 0 (a share of device time)")
        weights[name] = weight
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
    session = types.SimpleNamespace(client=InProcessClient.over(service.server), cluster=cluster,
                                    gatekeeper=gatekeeper, config=types.SimpleNamespace(controller=None))
    return Incarnations(session).replace


def serve(args, stop: threading.Event) -> int:
    """Serve until ``stop`` is set; 0 on a clean stop."""
    folders = service_folders(args.keys_dir)
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
    context = zmq.Context()
    gatekeeper = Gatekeeper(context, keys.public_keys())
    service = cluster = status = None
    try:
        config = ControllerConfig(bind_address=_executor_bind(args), heartbeat_interval_s=args.heartbeat_interval_s,
                                  heartbeat_timeout_s=args.heartbeat_timeout_s, max_inflight_calls=args.max_inflight,
                                  executor_memory_bytes=args.executor_memory_bytes, memory_wait_s=args.memory_wait_s)
        service = ControllerService(config, keys.credentials(CONTROLLER), context, args.bind, weights)
        if start is not None:
            ids = executor_ids(range(start.num_executors))
            cluster = LocalCluster(service.executor_address, ids, keys_dir=folders.executors,
                                   backend=start.resolved_backend, devices=start.executor_devices(),
                                   islands=start.executor_islands(), **start.liveness_fields())
            service.controller.wait_for_executors(len(ids), start.start_timeout_s)
            service.order_executors(ids)
            service.watch_exits(cluster.newly_exited, args.heartbeat_interval_s)
            service.clients.replacer = _replacer(service, cluster, gatekeeper)
        if args.status_port:
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
