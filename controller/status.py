"""The controller's status service over gRPC: its view of the executors and its queue, for ``pathways-status``.

Service ``pathways.Status``, method ``Get``, messages in ``pathways.proto``: every executor's island, device,
state, epoch, last heartbeat, node and store bytes, and the number of calls in flight and arrays. Served on
**loopback only** (a launched script's ``--status-port``): it names hosts and sizes, so it is read on node 0
(``pathways-status 127.0.0.1:PORT``, or ``kubectl exec``), never exposed. It reads only the controller's public
state. No generated gRPC stubs: the method is a generic handler over the protobuf messages.

Answers come from a cache (`StatusCache`) at most ``cache_s`` old (`ServiceConfig.status_cache_s`, 1 s): a burst of
status calls, however many, asks the executors for their stats once per ``cache_s``, not once per call. The
clients' table (a standalone controller's) is always read fresh: it asks no executor. The operator's requests
(`pathways.Status/Admin`) carry the admin token as gRPC metadata (`ADMIN_TOKEN_METADATA`); one that changed
something empties the cache, so the next status shows it.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

from pathways_torch.wire import pb
from pathways_torch.wire.threads import threads_leave_signals
from pathways_torch.wire.status_service import ADMIN_TOKEN_METADATA, STATUS_ADMIN, STATUS_GET, STATUS_SERVICE

from .config import ServiceConfig

__all__ = ["StatusCache", "serve_status", "status_of"]


def serve_status(controller, port: int, run_id: str = "", admin=None, host: str = "127.0.0.1",
                 cache_s: float = ServiceConfig.status_cache_s):
    """Serve `pathways.Status` for ``controller`` on ``host``:``port`` (loopback by default); returns the gRPC server
    (stop() it). With ``admin`` (a standalone controller's `admin.Admin`): the clients in the status, the operator's
    requests (`pathways.Status/Admin`, each with the admin token), and the standard health service
    (``grpc.health.v1``, service ""). Executors' stats are asked at most once per ``cache_s``."""
    import grpc   # only a launched script serves status: plain imports of the controller need no gRPC

    cache = StatusCache(lambda with_stats: status_of(controller, with_stats, run_id), cache_s)

    def get(request, _):
        reply = cache.get(request.with_stats)
        return reply if admin is None else admin.add_clients(reply)

    def operate(request, context):
        token = dict(context.invocation_metadata()).get(ADMIN_TOKEN_METADATA)
        reply = admin.handle(request, token)
        if reply.ok:
            cache.clear()
        return reply

    methods = {STATUS_GET: grpc.unary_unary_rpc_method_handler(
        get, request_deserializer=pb.StatusRequest.FromString, response_serializer=pb.StatusReply.SerializeToString)}
    if admin is not None:
        methods[STATUS_ADMIN] = grpc.unary_unary_rpc_method_handler(
            operate, request_deserializer=pb.AdminRequest.FromString,
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


class StatusCache:
    """Status replies at most ``max_age_s`` old, one per kind (with and without the executors' stats).

    ``compute(with_stats)`` makes a fresh reply (with stats: a round trip to every executor). Callers that find the
    reply too old while another refreshes it wait for that refresh and share it, so a burst costs one ``compute``.
    Each caller gets its own copy (the clients are added to it)."""

    def __init__(self, compute, max_age_s: float, clock=time.monotonic):
        if not 0 < max_age_s < float("inf"):
            raise ValueError(f"status cache: expected an age in seconds > 0 and finite, got {max_age_s!r}")
        self._compute, self._max_age_s, self._clock = compute, max_age_s, clock
        self._locks = {True: threading.Lock(), False: threading.Lock()}
        self._replies: dict[bool, tuple[float, pb.StatusReply]] = {}

    def get(self, with_stats: bool) -> pb.StatusReply:
        with_stats = bool(with_stats)
        with self._locks[with_stats]:
            kept = self._replies.get(with_stats)
            now = self._clock()
            if kept is None or now - kept[0] >= self._max_age_s:
                kept = (now, self._compute(with_stats))   # its age counts from before it was asked
                self._replies[with_stats] = kept
        reply = pb.StatusReply()
        reply.CopyFrom(kept[1])
        return reply

    def clear(self) -> None:
        """Forget every reply: the next `get` computes afresh (after the operator changed something)."""
        for with_stats, lock in self._locks.items():
            with lock:
                self._replies.pop(with_stats, None)


def status_of(controller, with_stats: bool, run_id: str = "") -> pb.StatusReply:
    """The controller's view of its executors and queue (``with_stats``: and each executor's store, asked now)."""
    now = controller.clock()
    reply = pb.StatusReply(run_id=run_id, calls_in_flight=controller.call_dispatch.calls_in_flight,
                           arrays=len(controller.arrays))
    stats = {}
    if with_stats:
        try:
            replies = controller.requests.gather("stats")
            stats = {executor_id: envelope.stats for executor_id, envelope in replies.items()}
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
