"""`ControllerService`: a controller that outlives any one script, serving many clients (`pathways-controller`).

It is the embedded controller's server (`ControllerServer`: executors register, report and heartbeat there) plus
the client service (`ClientService`: remote clients' requests and events), each on an I/O thread of its own: no
client's traffic delays an executor's heartbeat answer. Executors join it
(``pathways-executor --controller ADDR``) or its host starts them; clients attach with
``pw.Context(controller=..., keys=...)`` and come and go (docs/service.md).
"""

from __future__ import annotations

import logging
import time

import zmq

from .admin import Admin
from .client_service import ClientService
from .config import ControllerConfig, ServiceConfig
from .exit_watch import watch_exits
from .server import ControllerServer

__all__ = ["ControllerService"]

log = logging.getLogger(__name__)


class ControllerService:
    """Serves executors at ``config.bind_address`` and clients at ``client_bind``; `stop` ends both."""

    def __init__(self, config: ControllerConfig, credentials, zmq_context: zmq.Context, client_bind: str,
                 weights: dict | None = None, service_config: ServiceConfig | None = None):
        self.server = ControllerServer(config, credentials, zmq_context)
        try:
            self.clients = ClientService(self.server, client_bind, heartbeat_timeout_s=config.heartbeat_timeout_s,
                                         weights=weights, config=service_config)
        except BaseException:
            self.server.stop()
            raise
        self.server.start()
        self.clients.start()
        self.controller = self.server.controller
        self.admin = Admin(self.controller, self.clients)   # the operator's levers (served with the status)
        self.executor_address = self.server.address
        self.client_address = self.clients.address

    def watch_exits(self, newly_exited, interval_s: float) -> None:
        """Local executor processes that exit are declared lost at once (`exit_watch`)."""
        watch_exits(self.controller, self.server.loop, newly_exited, interval_s)

    def order_executors(self, executor_ids) -> None:
        """Each executor's place in every client's ``ctx.executor_ids``: this order, the others after."""
        order = {e: i for i, e in enumerate(executor_ids)}
        for info in self.controller.resources.ordered():
            info.index = order.get(info.executor_id, len(order) + info.index)

    def serve_status(self, port: int, host: str = "127.0.0.1"):
        """Status, health and the operator's requests over gRPC on ``host``:``port``; the server (stop() it)."""
        from .status import serve_status

        return serve_status(self.controller, port, "pathways-controller", admin=self.admin, host=host)

    def stop(self, why: str = "the controller stopped") -> None:
        """Tell every client (each fails what it waits for with `ControllerLostError`), free what they hold, tell
        every executor to exit, and close the sockets."""
        try:
            self.clients.close(why)
            self.controller.call_dispatch.fail_pending(why)
            self.controller.members.shutdown_executors(why)
            time.sleep(0.2)   # the I/O threads send the news before their sockets close
        finally:
            self.clients.stop()
            self.server.stop()
