"""The controller's status service over gRPC: its view of the executors and its queue, for ``pathways-status``.

Service ``pathways.Status``, method ``Get``, messages in ``pathways.proto``: every executor's island, device,
state, epoch, last heartbeat, node and store bytes, and the number of calls in flight and arrays. Served on
**loopback only** (a launched script's ``--status-port``): it names hosts and sizes, so it is read on node 0
(``pathways-status 127.0.0.1:PORT``, or ``kubectl exec``), never exposed. It reads only the controller's public
state. No generated gRPC stubs: the method is a generic handler over the protobuf messages.
"""

from __future__ import annotations

from concurrent import futures

from pathways_torch.wire import pb
from pathways_torch.wire.threads import threads_leave_signals
from pathways_torch.wire.status_service import STATUS_ADMIN, STATUS_GET, STATUS_SERVICE

__all__ = ["serve_status", "status_of"]


def serve_status(controller, port: int, run_id: str = "", admin=None, host: str = "127.0.0.1"):
    """Serve `pathways.Status` for ``controller`` on ``host``:``port`` (loopback by default); returns the gRPC server
    (stop() it). With ``admin`` (a standalone controller's `admin.Admin`): the clients in the status, the operator's
    requests (`pathways.Status/Admin`), and the standard health service (``grpc.health.v1``, service "")."""
    import grpc   # only a launched script serves status: plain imports of the controller need no gRPC

    def get(request, _):
        reply = status_of(controller, request.with_stats, run_id)
        return reply if admin is None else admin.add_clients(reply)

    methods = {STATUS_GET: grpc.unary_unary_rpc_method_handler(
        get, request_deserializer=pb.StatusRequest.FromString, response_serializer=pb.StatusReply.SerializeToString)}
    if admin is not None:
        methods[STATUS_ADMIN] = grpc.unary_unary_rpc_method_handler(
            lambda request, _: admin.handle(request), request_deserializer=pb.AdminRequest.FromString,
            response_serializer=pb.AdminReply.SerializeToString)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(STATUS_SERVICE, methods),))
    if admin is not None:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        checks = health.HealthServicer()
        checks.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"--status-port {port}: could not listen on {host}:{port}")
    with threads_leave_signals():   # gRPC's threads, and the pool's started from them
        server.start()
    return server


def status_of(controller, with_stats: bool, run_id: str = "") -> pb.StatusReply:
    """The controller's view of its executors and queue (``with_stats``: and each executor's store, asked now)."""
    now = controller.clock()
    reply = pb.StatusReply(run_id=run_id, calls_in_flight=controller.calls_in_flight, arrays=len(controller.arrays))
    stats = {}
    if with_stats:
        try:
            stats = {executor_id: envelope.stats for executor_id, envelope in controller.gather("stats").items()}
        except Exception as exc:   # noqa: BLE001 - a status reader must not fail on a slow executor
            reply.stats_error = f"{type(exc).__name__}: {exc}"
    for info in controller.resources.ordered():
        mine = stats.get(info.executor_id)
        reply.executors.append(pb.ExecutorStatus(
            executor_id=info.executor_id, island=info.island, device=info.device, backend=info.backend,
            state=_state(info), epoch=info.epoch,
            seconds_since_heartbeat=max(0.0, now - info.last_heard),
            node=controller.executor_labels.get(info.executor_id, ""),
            store_bytes=mine.store_bytes if mine is not None else 0,
            queue_high_water=mine.queue_high_water if mine is not None else 0))
    return reply


def _state(info) -> str:
    if info.draining:
        return "removed" if info.lost else "draining"
    return "lost" if info.lost else "alive"
