"""`Admission`: which client's call an island's sequencer takes next, when the controller serves many clients.

A controller serving clients (`client_service`) admits each call or program run on its islands through their
`ShareScheduler`s before sequencing it: among the clients waiting, the one furthest behind its share of device
time goes first, and an island holds at most ``window`` admitted calls unfinished (its executors' queues are the
rest of the order; a window of a few calls keeps them busy). Sequencing still happens after admission, under the
islands' sequencers, so every island keeps one order and collectives never deadlock, whoever's calls they are.

A call is charged its estimated device time when admitted (a `CostModel` per function or program: what its
runs measured, else its simulated seconds, else 1 ms per executor) and corrected by the device time its
executors measured once it ends (``Done.device_ns``, summed over the mesh).

A call waits for its turn at most ``timeout_s`` (`ServiceConfig.admission_timeout_s`), then fails with a
`TimeoutError` naming the island and who is ahead of it: it never waits forever. What is charged is bounded: an
estimate or a measure that is not finite counts as nothing (logged), one past `MAX_CHARGE_S` counts that much.

The embedded controller has one client and admits everything at once (``enabled`` False): nothing changes there.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Hashable

from pathways_torch.errors import ContextClosedError
from pathways_torch.wire.limits import COST_SECONDS

from .config import ServiceConfig
from .shares import ClientGone, CostModel, ShareScheduler, Ticket, check_weight

__all__ = ["Admission", "Admitted", "ClientGone", "MAX_CHARGE_S"]

log = logging.getLogger(__name__)

# The most device seconds one call or program run is charged (estimated or measured, all its executors together):
# the longest run a cost may declare (COST_SECONDS) on 10,000 executors. More is a broken clock or report, not
# work: it is clamped, so no pass runs away (an executor's Done.device_ns is a uint64: up to 584 years each).
MAX_CHARGE_S = COST_SECONDS.high * 10_000


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

    def __init__(self, window: int = 16, timeout_s: float = ServiceConfig.admission_timeout_s):
        self.enabled = False
        self.window = window
        self.timeout_s = _check_timeout(timeout_s)
        self.clamped_charges = 0   # estimates or measures out of bounds (not finite, below 0, past MAX_CHARGE_S)
        self.costs = CostModel()
        self._islands: dict[str, ShareScheduler] = {}
        self.weights: dict[str, float] = {}
        self._lock = threading.Lock()
        self.closing_reason = ""

    def enable(self, timeout_s: float = ServiceConfig.admission_timeout_s) -> None:
        """Admit calls island by island at the clients' shares (a controller serving clients), each waiting at
        most ``timeout_s`` for its turn."""
        self.timeout_s = _check_timeout(timeout_s)
        self.enabled = True

    # ------------------------------------------------------------ clients

    def add_client(self, client: str, weight: float) -> None:
        """A client connected (again: a reconnect resumes the pass it left with on each island)."""
        weight = check_weight(client, weight)
        with self._lock:
            for scheduler in self._islands.values():
                scheduler.add_client(client, weight)
            self.weights[client] = weight

    def set_weight(self, client: str, weight: float) -> None:
        weight = check_weight(client, weight)
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

        ``nodes``: the reporting nodes of a program run (it holds that many slots). Waits ``timeout_s`` in all at
        most, then raises `TimeoutError` naming the island and who is ahead."""
        if not self.enabled:
            return None
        names = sorted(set(islands))
        estimate = self._bounded_charge(self.costs.estimate(cost_key, default_cost_s), f"the estimate of {cost_key}")
        deadline = time.monotonic() + self.timeout_s
        taken: list[tuple[ShareScheduler, Ticket]] = []
        try:
            for name in names:
                scheduler = self.island(name)
                left = max(0.0, deadline - time.monotonic())
                taken.append((scheduler, scheduler.admit(client, estimate / max(1, len(names)),
                                                         slots=max(1, nodes), timeout_s=left)))
                if self.closing_reason:
                    raise ContextClosedError(f"{self.closing_reason} while a call of {client} waited for its turn")
        except BaseException:
            for scheduler, ticket in taken:
                scheduler.finished(ticket, 0.0)
            raise
        return Admitted(taken, cost_key, nodes)

    def node_ended(self, admitted: "Admitted | None", device_s: float, costs: CostModel | None = None) -> None:
        """One reporting node of an admitted call ended (finished, failed or lost), having used ``device_s`` (what
        its executors measured: bounded here, see `MAX_CHARGE_S`)."""
        if admitted is None:
            return
        costs = costs or self.costs
        measured = self._bounded_charge(device_s, f"the device time of {admitted.cost_key}")
        admitted.device_s = min(MAX_CHARGE_S, admitted.device_s + measured)
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

    def _bounded_charge(self, seconds: float, what: str) -> float:
        """``seconds`` within [0, MAX_CHARGE_S]; one outside (NaN included) is counted and logged (rate-limited)."""
        if 0 <= seconds <= MAX_CHARGE_S:
            return float(seconds)
        self.clamped_charges += 1
        charged = MAX_CHARGE_S if seconds > MAX_CHARGE_S else 0.0
        if self.clamped_charges <= 10 or self.clamped_charges % 1000 == 0:   # a broken reporter must not flood the log
            log.warning("admission: %s is %r device seconds, outside [0, %g]; charged %g instead (%d so far)",
                        what, seconds, MAX_CHARGE_S, charged, self.clamped_charges)
        return charged

    def describe(self) -> str:
        """Every island's table of clients, weights, passes and shares (printable)."""
        return "\n".join(s.describe() for _, s in sorted(self.islands().items())) or "no island admitted a call yet"


def _check_timeout(timeout_s: float) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise ValueError(f"admission timeout: expected seconds > 0 and finite, got {timeout_s!r}")
    return float(timeout_s)
