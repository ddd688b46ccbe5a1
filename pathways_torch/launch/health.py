"""Health and status over gRPC: what a scheduler's probes and ``pathways-status`` ask.

- **Health** (`grpc.health.v1`, from ``grpcio-health-checking``): each node's ``pathways-run
  --health-port P`` serves it on ``--host-addr:P``, where the kubelet's probes reach the pod. Service
  ``""`` is the node: SERVING while every executor it started runs (and, on node 0, the script);
  ``executor-K`` is each of its executors. A Kubernetes probe of type ``grpc`` works unchanged. It is
  not authenticated: it says SERVING or NOT_SERVING and nothing else (docs/security.md).
- **Status** (service ``pathways.Status``, method ``Get``, messages in ``pathways.proto``): the
  controller's view — every executor's island, device, state, epoch, last heartbeat, node, store
  bytes — and its queue. The controller serves it (`controller.status`) for a launched script's
  context on **loopback only** (``--status-port``); here is its reader, ``pathways-status
  127.0.0.1:PORT`` (on node 0, or through ``kubectl exec``).
- **The operator's requests** to a standalone controller (``--set-weight``, ``--disconnect``, ``--drain``) need
  its admin token: ``pathways-status HOST:PORT --keys-dir DIR --drain executor-3`` reads it from
  ``DIR/controller/admin.token`` (`service_keys.admin_token`) and sends it as gRPC metadata.

No generated gRPC stubs: the status method is a generic handler over the protobuf messages.
"""

from __future__ import annotations

import time
from concurrent import futures

from ..wire.security import SecurityError
from ..wire.status_service import ADMIN_METHOD, ADMIN_TOKEN_METADATA, STATUS_METHOD   # served by controller/status.py
from .service_keys import admin_token

__all__ = ["HealthServer", "get_status", "status_table", "clients_table", "admin", "STATUS_METHOD"]



class HealthServer:
    """``grpc.health.v1`` on ``address`` (``host:port``); `set` each service's state."""

    def __init__(self, address: str):
        import grpc
        from grpc_health.v1 import health, health_pb2_grpc

        self._health = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)
        port = self.server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"--health-port: could not listen on {address} (in use, or not this host's address)")
        self.address = f"{address.rsplit(':', 1)[0]}:{port}"
        self.server.start()

    def set(self, service: str, serving: bool) -> None:
        from grpc_health.v1 import health_pb2

        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self._health.set(service, status)

    def stop(self) -> None:
        self._health.enter_graceful_shutdown()
        self.server.stop(grace=0.5)


def get_status(address: str, with_stats: bool = True, timeout_s: float = 10.0):
    import grpc

    from ..wire import pb

    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(STATUS_METHOD, request_serializer=pb.StatusRequest.SerializeToString,
                                   response_deserializer=pb.StatusReply.FromString)
        return call(pb.StatusRequest(with_stats=with_stats), timeout=timeout_s)


def status_table(reply) -> str:
    """The reply as the table ``pathways-status`` prints."""
    header = ["executor", "island", "device", "backend", "state", "epoch", "heartbeat s ago", "node", "store bytes"]
    rows = [[e.executor_id, e.island, e.device, e.backend, e.state, str(e.epoch), f"{e.seconds_since_heartbeat:.1f}",
             e.node or "-", f"{e.store_bytes:,}"] for e in reply.executors]
    lines = _table(header, rows)
    lines.append(f"run {reply.run_id or '-'}: {len(reply.executors)} executors, {reply.calls_in_flight} calls in "
                 f"flight, {reply.arrays} arrays" + (f"; stats: {reply.stats_error}" if reply.stats_error else ""))
    if reply.clients or reply.run_id == "pathways-controller":
        lines += ["", clients_table(reply)]
    return "\n".join(lines)


def clients_table(reply) -> str:
    """A standalone controller's connected clients: weight, share of the last minute's device time, load."""
    header = ["client", "weight", "share 60s", "device s 60s", "in flight", "waiting", "arrays", "requests",
              "heard s ago"]
    whole = sum(c.weight for c in reply.clients) or 1.0
    rows = [[c.name, f"{c.weight:g} ({100 * c.weight / whole:.0f}%)", f"{100 * c.share_last_minute:.1f}%",
             f"{c.device_seconds_last_minute:.3f}", str(c.calls_in_flight), str(c.calls_waiting), str(c.arrays),
             str(c.requests_served), f"{c.seconds_since_heard:.1f}"] for c in reply.clients]
    refused = (f"; {reply.refused_admin_requests} operator request(s) without the admin token refused"
               if reply.refused_admin_requests else "")
    refused += (f"; {reply.refused_client_requests} client request(s) refused, {reply.dropped_client_messages} "
                f"client message(s) dropped" if reply.refused_client_requests or reply.dropped_client_messages else "")
    return "\n".join(_table(header, rows) + [
        f"{len(reply.clients)} client(s) connected; {reply.refused_clients} message(s) from keys that are no "
        f"client's refused" + refused])


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(header, widths)), "-|-".join("-" * w for w in widths)]
    return lines + [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]


def admin(address: str, request, timeout_s: float = 10.0, token: str | None = None):
    """Send the operator's ``request`` (a ``pb.AdminRequest``) to a standalone controller, with its admin ``token``
    (`service_keys.admin_token`; without it the controller refuses); its ``pb.AdminReply``."""
    import grpc

    from ..wire import pb

    metadata = ((ADMIN_TOKEN_METADATA, token),) if token else None
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(ADMIN_METHOD, request_serializer=pb.AdminRequest.SerializeToString,
                                   response_deserializer=pb.AdminReply.FromString)
        return call(request, timeout=timeout_s, metadata=metadata)


def main(argv=None) -> int:
    """``pathways-status HOST:PORT``: print the controller's status table."""
    import argparse

    parser = argparse.ArgumentParser(prog="pathways-status",
                                     description="Print a launched job's executors and queue (its --status-port, "
                                                 "on node 0's loopback).")
    parser.add_argument("address", help="HOST:PORT of the status service, e.g. 127.0.0.1:29401")
    parser.add_argument("--no-stats", action="store_true", help="skip the executors' store bytes (no round trip)")
    parser.add_argument("--timeout-s", type=float, default=10.0)
    parser.add_argument("--set-weight", metavar="CLIENT=WEIGHT", default=None,
                        help="a standalone controller: set a client's share of device time")
    parser.add_argument("--disconnect", metavar="CLIENT", default=None,
                        help="a standalone controller: disconnect a client, freeing what it holds")
    parser.add_argument("--drain", metavar="EXECUTOR", default=None,
                        help="a standalone controller: no new work for an executor; removed once idle")
    parser.add_argument("--keys-dir", metavar="DIR", default=None,
                        help="the folder pathways-controller --make-keys wrote: its admin token "
                             "(DIR/controller/admin.token) is sent with --set-weight, --disconnect and --drain")
    args = parser.parse_args(argv)
    request = _admin_request(args)
    if request is not None:
        try:
            token = admin_token(args.keys_dir) if args.keys_dir else None
        except SecurityError as exc:
            print(f"pathways-status: {exc}")
            return 2
        return _run_admin(args.address, request, args.timeout_s, token)
    began = time.monotonic()
    try:
        reply = get_status(args.address, not args.no_stats, args.timeout_s)
    except Exception as exc:   # noqa: BLE001 - say what failed, as a tool should
        details = exc.details() if callable(getattr(exc, "details", None)) else exc    # gRPC's, or the error
        print(f"pathways-status: no answer from {args.address} within {args.timeout_s:g} s "
              f"({type(exc).__name__}: {details}); is the job running with "
              f"--status-port, and is this node 0?")
        return 1
    print(status_table(reply))
    print(f"(answered in {time.monotonic() - began:.2f} s)")
    return 0


def _admin_request(args):
    from ..wire import pb

    if args.set_weight is not None:
        client, eq, weight = args.set_weight.partition("=")
        try:
            value = float(weight) if eq else float("nan")
        except ValueError:
            value = float("nan")
        return pb.AdminRequest(set_weight=pb.SetWeight(client=client, weight=value))
    if args.disconnect is not None:
        return pb.AdminRequest(disconnect=args.disconnect)
    if args.drain is not None:
        return pb.AdminRequest(drain=args.drain)
    return None


def _run_admin(address: str, request, timeout_s: float, token: str | None) -> int:
    try:
        reply = admin(address, request, timeout_s, token)
    except Exception as exc:   # noqa: BLE001 - say what failed, as a tool should
        print(f"pathways-status: no answer from {address} within {timeout_s:g} s ({type(exc).__name__}); is a "
              f"pathways-controller serving --status-port there?")
        return 1
    print(f"pathways-status: {'done' if reply.ok else 'refused'}: {reply.message}")
    return 0 if reply.ok else 2


if __name__ == "__main__":
    import sys

    sys.exit(main())
