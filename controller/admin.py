"""The operator's view and levers of a standalone controller: its status with the clients, and `Admin` requests.

Served over gRPC with the status service (`status.serve_status`, loopback by default) and read by ``pathways-status
HOST:PORT`` (tables; ``--set-weight alice=4``, ``--disconnect alice``, ``--drain executor-3``):

- set a client's weight (the operator's alone: a client has no request for it);
- disconnect a client, freeing everything it holds;
- drain an executor: it takes no new work (a call on a mesh with it fails with `ExecutorLostError`, as for a lost
  one, so a trainer with checkpoints moves on), and once no call runs there it is removed (declared lost, told to
  exit).

Each lever needs the operator's admin token (``--make-keys`` writes it into ``DIR/controller/admin.token``; the
controller loads it at start, `use_token`; ``pathways-status --keys-dir DIR`` sends it): anyone on the host reaches
the loopback port, and a lever can stop any tenant. A request without it, or with another, is refused, logged (the
first ten, then every thousandth) and counted (`refused_requests`, in the status). Tokens are compared in constant
time. The status itself stays readable without one (on loopback by default).
"""

from __future__ import annotations

import hmac
import logging
import threading

from pathways_torch.wire import pb
from pathways_torch.wire.framing import log_dropped
from pathways_torch.wire.limits import WEIGHT, bounded

__all__ = ["Admin", "DRAIN_POLL_S"]

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.1   # how often a draining executor is looked at for idleness


class Admin:
    """What the operator asks of a controller serving clients (``clients``: its `ClientService`)."""

    def __init__(self, controller, clients):
        self.controller, self.clients = controller, clients
        self._draining: set[str] = set()
        self._lock = threading.Lock()
        self._token: bytes | None = None   # none set: every request is refused
        self.refused_requests = 0
        clients.loop.every(DRAIN_POLL_S, self._remove_idle_drained)

    def use_token(self, token: str) -> None:
        """From now on, a request must come with ``token`` (the operator's: `service_keys.admin_token`)."""
        if not token:
            raise ValueError("use_token: expected the operator's admin token, got an empty one")
        self._token = token.encode()

    def handle(self, request: pb.AdminRequest, token: str | None = None) -> pb.AdminReply:
        """Do what ``request`` asks if ``token`` is the operator's; otherwise refuse it, changing nothing."""
        action = request.WhichOneof("action")
        refusal = self._token_refusal(token)
        if refusal is not None:
            with self._lock:
                self.refused_requests += 1
                count = self.refused_requests
            log_dropped(log, count, "controller: an operator request", f"{action or 'no action'}: {refusal}")
            return pb.AdminReply(ok=False, message=f"{action or 'request'} refused: {refusal}")
        try:
            if action == "set_weight":
                return self.set_weight(request.set_weight.client, request.set_weight.weight)
            if action == "disconnect":
                return self.disconnect(request.disconnect)
            if action == "drain":
                return self.drain(request.drain)
        except ValueError as exc:
            return pb.AdminReply(ok=False, message=str(exc))
        return pb.AdminReply(ok=False, message=f"expected set_weight, disconnect or drain, got {action!r}")

    def set_weight(self, client: str, weight: float) -> pb.AdminReply:
        weight = bounded(weight, f"set weight {client}={weight!r}", WEIGHT,
                         "give a share of device time such as 1 (relative: 2 is twice 1's)")
        if client not in self.clients.sessions:
            raise ValueError(f"set weight of {client!r}: no such client is connected; connected: "
                             f"{sorted(self.clients.sessions) or 'none'}")
        self.clients.weights[client] = weight
        self.controller.admission.set_weight(client, weight)
        log.warning("controller: the operator set %s's weight to %g", client, weight)
        return pb.AdminReply(ok=True, message=f"{client}'s weight is {weight:g}")

    def disconnect(self, client: str) -> pb.AdminReply:
        if not self.clients.disconnect(client, "the operator disconnected it"):
            raise ValueError(f"disconnect {client!r}: no such client is connected; connected: "
                             f"{sorted(self.clients.sessions) or 'none'}")
        return pb.AdminReply(ok=True, message=f"{client} disconnected; what it held is freed")

    def drain(self, executor_id: str) -> pb.AdminReply:
        with self.controller.state.lock:
            info = self.controller.resources.executors.get(executor_id)
            if info is None:
                raise ValueError(f"drain {executor_id!r}: no such executor; known: "
                                 f"{sorted(self.controller.resources.executors)}")
            if info.lost:
                raise ValueError(f"drain {executor_id}: it is lost already")
            info.draining = True
        with self._lock:
            self._draining.add(executor_id)
        log.warning("controller: the operator drains %s: no new work; removed once idle", executor_id)
        return pb.AdminReply(ok=True, message=f"{executor_id} takes no new work; it is removed once idle")

    def _token_refusal(self, token: str | None) -> str | None:
        """Why a request with ``token`` is refused (None: it is the operator's)."""
        fix = ("pass pathways-status --keys-dir DIR, the folder pathways-controller --make-keys wrote (the token is "
               "DIR/controller/admin.token)")
        if self._token is None:
            return ("this controller was started without an admin token, so it takes no operator requests; start it "
                    "with pathways-controller --keys-dir DIR")
        if not token:
            return f"expected the operator's admin token, got none; {fix}"
        if not hmac.compare_digest(token.encode(), self._token):
            return f"expected the operator's admin token, got another; {fix}, the DIR this controller serves"
        return None

    def _remove_idle_drained(self) -> None:
        with self._lock:
            draining = list(self._draining)
        for executor_id in draining:
            with self.controller.state.lock:
                busy = any(executor_id in call.waiting for call in self.controller.state.calls.values())
                if busy:
                    continue
                self.controller.members.lose(executor_id, "removed by the operator after draining")
            with self._lock:
                self._draining.discard(executor_id)

    # ------------------------------------------------------------ status

    def add_clients(self, reply: pb.StatusReply) -> pb.StatusReply:
        """The connected clients, with weight, share and load, into ``reply``."""
        usage = self.controller.admission.usage(60.0)
        now = self.clients.clock()
        for name, session in sorted(self.clients.sessions.items()):
            use = usage.get(name, {})
            reply.clients.append(pb.ClientStatus(
                name=name, weight=self.clients.weights.get(name, 1.0), share_last_minute=use.get("share", 0.0),
                device_seconds_last_minute=use.get("device_s", 0.0), calls_in_flight=use.get("in_flight", 0),
                calls_waiting=use.get("waiting", 0), arrays=len(session.ops.arrays),
                requests_served=session.requests_served, seconds_since_heard=max(0.0, now - session.last_heard)))
        reply.refused_clients = self.clients.refused_clients
        reply.dropped_client_messages = self.clients.dropped_messages
        reply.refused_client_requests = sum(self.clients.refusals.values())
        reply.refused_admin_requests = self.refused_requests
        return reply
