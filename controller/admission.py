"""`Admission`: which client's call an island's sequencer takes next, when the controller serves many clients.

A controller serving clients (`client_service`) admits each call or program run on its islands through their
`ShareScheduler`s before sequencing it: among the clients waiting, the one furthest behind its share of device
time goes first, and an island holds at most ``window`` admitted calls unfinished (its executors' queues are the
rest of the order; a window of a few calls keeps them busy). Sequencing still happens after admission, under the
islands' sequencers, so every island keeps one order and collectives never deadlock, whoever's calls they are.

A call is charged its estimated device time when admitted (a `CostModel` per function or program: what its
runs measured, else its simulated seconds, else 1 ms per executor) and corrected by the device time its
executors measured once it ends (``Done.device_ns``, summed over the mesh).

The embedded controller has one client and admits everything at once (``enabled`` False): nothing changes there.
"""

from __future__ import annotations

import threading
from typing import Hashable

from pathways_torch.errors import ContextClosedError

from .shares import ClientGone, CostModel, ShareScheduler, Ticket

__all__ = ["Admission", "Admitted", "ClientGone"]


class Admitted:
    """One call's or program run's admission: its tickets (one per island) and the device time it measured.

    A program run reports through several nodes: each node's end (`node_ended`) brings it closer; the last one
    hands the tickets back."""

    __slots__ = ("tickets", "cost_key", "nodes_left", "device_s", "dispatched")

    def __init__(self, tickets: list[tuple[ShareScheduler, Ticket]], cost_key: Hashable, nodes: int):
        self.tickets, self.cost_key, self.nodes_left, self.device_s = tickets, cost_key, nodes, 0.0
        self.dispatched = False   # in the calls in flight: from then on, its end hands the tickets back


class Admission:
    """Every island's share scheduler, the clients' weights, and what calls cost."""

    def __init__(self, window: int = 16):
        self.enabled = False
        self.window = window
        self.costs = CostModel()
        self._islands: dict[str, ShareScheduler] = {}
        self.weights: dict[str, float] = {}
        self._lock = threading.Lock()
        self.closing_reason = ""

    # ------------------------------------------------------------ clients

    def add_client(self, client: str, weight: float) -> None:
        with self._lock:
            for scheduler in self._islands.values():
                scheduler.add_client(client, weight)
            self.weights[client] = weight

    def set_weight(self, client: str, weight: float) -> None:
        with self._lock:
            if client not in self.weights:
                raise ValueError(f"set weight of {client!r}: no such client is connected; the connected ones are "
                                 f"{sorted(self.weights) or 'none'}")
            for scheduler in self._islands.values():
                scheduler.set_weight(client, weight)
            self.weights[client] = weight

    def remove_client(self, client: str) -> None:
        """The client is gone: its waiting calls raise `ClientGone`, its admitted ones' slots are freed."""
        with self._lock:
            self.weights.pop(client, None)
            for scheduler in self._islands.values():
                scheduler.remove_client(client)

    def island(self, name: str) -> ShareScheduler:
        with self._lock:
            scheduler = self._islands.get(name)
            if scheduler is None:
                scheduler = self._islands[name] = ShareScheduler(name, slots=self.window)
                for client, weight in self.weights.items():
                    scheduler.add_client(client, weight)
            return scheduler

    def islands(self) -> dict[str, ShareScheduler]:
        with self._lock:
            return dict(self._islands)

    # ------------------------------------------------------------ calls

    def admit(self, client: str, islands, cost_key: Hashable, default_cost_s: float, nodes: int = 1):
        """Wait until ``client`` may dispatch on every one of ``islands`` (in name order); None when not enabled.

        ``nodes``: the reporting nodes of a program run (it holds that many slots)."""
        if not self.enabled:
            return None
        estimate = self.costs.estimate(cost_key, default_cost_s)
        taken: list[tuple[ShareScheduler, Ticket]] = []
        try:
            for name in sorted(set(islands)):
                scheduler = self.island(name)
                taken.append((scheduler, scheduler.admit(client, estimate / max(1, len(set(islands))),
                                                         slots=max(1, nodes))))
                if self.closing_reason:
                    raise ContextClosedError(f"{self.closing_reason} while a call of {client} waited for its turn")
        except BaseException:
            for scheduler, ticket in taken:
                scheduler.finished(ticket, 0.0)
            raise
        return Admitted(taken, cost_key, nodes)

    @staticmethod
    def node_ended(admitted: "Admitted | None", device_s: float, costs: CostModel) -> None:
        """One reporting node of an admitted call ended (finished, failed or lost), having used ``device_s``."""
        if admitted is None:
            return
        admitted.device_s += device_s
        admitted.nodes_left -= 1
        if admitted.nodes_left > 0:
            return
        if admitted.device_s > 0:
            costs.observe(admitted.cost_key, admitted.device_s)
        share = admitted.device_s / max(1, len(admitted.tickets))
        for scheduler, ticket in admitted.tickets:
            scheduler.finished(ticket, share)

    def release(self, admitted: "Admitted | None") -> None:
        """An admitted call never dispatched (its dispatch raised): hand its slots back, uncharged."""
        if admitted is not None:
            for scheduler, ticket in admitted.tickets:
                scheduler.finished(ticket, 0.0)

    def close(self, reason: str) -> None:
        """The controller stops: calls waiting for their turn fail."""
        self.closing_reason = reason
        with self._lock:
            clients = list(self.weights)
        for client in clients:
            self.remove_client(client)

    def usage(self, window_s: float = 60.0) -> dict[str, dict]:
        """Per connected client, over every island: its weight, device seconds of the last ``window_s``, its share
        of them, and its calls waiting for their turn and in flight."""
        out = {c: {"weight": w, "device_s": 0.0, "waiting": 0, "in_flight": 0} for c, w in sorted(self.weights.items())}
        for scheduler in self.islands().values():
            for client, seconds in scheduler.device_seconds(window_s).items():
                if client in out:
                    out[client]["device_s"] += seconds
            for client, (waiting, in_flight) in scheduler.load().items():
                if client in out:
                    out[client]["waiting"] += waiting
                    out[client]["in_flight"] += in_flight
        whole = sum(u["device_s"] for u in out.values())
        for u in out.values():
            u["share"] = u["device_s"] / whole if whole > 0 else 0.0
        return out

    def describe(self) -> str:
        """Every island's table of clients, weights, passes and shares (printable)."""
        return "\n".join(s.describe() for _, s in sorted(self.islands().items())) or "no island admitted a call yet"
