"""Proportional shares of an island's device time among the clients of one controller (stride scheduling).

A controller serving many clients interleaves their programs on each island so that device time follows the
clients' weights (the Pathways paper, §4.4 and §5.2: weights 1:2:4:8 get 1/15, 2/15, 4/15 and 8/15 of it).
Each island has a `ShareScheduler`. Every client has a *pass*, its weighted device time so far: admitting a call
advances it by the call's estimated device seconds divided by the client's weight, and `finished` corrects the
estimate by what the executors measured. The island admits, among the clients waiting, the one with the
smallest pass, as long as the island has a free slot; so over time each client's device seconds divided by its
weight stay level, which is device time in proportion to the weights. Estimates come from a `CostModel`.

Every pass stays finite: weights are bounded where they enter (`pathways_torch.wire.limits.WEIGHT`), and a charge
that would make a pass infinite or NaN is refused loudly (`_charged`): one NaN pass makes every comparison false,
and nobody would be admitted again. A client that leaves keeps its pass for a while (`REMEMBERED_CLIENTS`): one
that reconnects under its name comes back with its debt, never with a fresh start ahead of the busy ones.

Stdlib only: the controller never touches tensors.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import logging
import threading
import time
from typing import Callable, Hashable

from pathways_torch.wire.limits import WEIGHT, bounded

__all__ = ["ShareScheduler", "Ticket", "ClientGone", "CostModel", "NonFinitePassError", "check_weight"]

log = logging.getLogger(__name__)

# `shares` sees at most this far back, and at most this many finished records: memory stays bounded however
# long the island runs (describe() asks for the last minute).
HISTORY_S = 600.0
HISTORY_RECORDS = 200_000
# Passes of clients that left, kept (the most recently gone) so that one reconnecting resumes its own.
REMEMBERED_CLIENTS = 4096
# An admitted call still unfinished after this long gives its slots back (charged to its client): stuck or very
# long calls cannot hold an island's admission window for good. Waiters look at most this often.
HOLD_S = 10.0
_EXPIRY_CHECK_S = 1.0


class ClientGone(Exception):
    """The client was removed while its call waited for admission: the call was never dispatched."""


class NonFinitePassError(ArithmeticError):
    """A charge would have made a client's pass infinite or NaN; refused, the pass kept as it was."""


@dataclasses.dataclass(frozen=True)
class Ticket:
    """An admission: `slots` calls of `client`, charged `estimate_s`; hand it back to `finished`."""
    client: str
    slots: int
    estimate_s: float
    admitted_at: float
    number: int = 0          # unique per scheduler, so a ticket is finished once, and not after its client left


class _Waiter:
    """One blocked `admit`: its arrival order breaks ties and keeps a client's own calls FIFO."""
    __slots__ = ("client", "slots", "seq", "gone")

    def __init__(self, client: str, slots: int, seq: int):
        self.client, self.slots, self.seq, self.gone = client, slots, seq, False


def check_weight(client: str, weight: float) -> float:
    return bounded(weight, f"client {client!r}: weight", WEIGHT,
                   "give a share such as 1 (weights are relative: 1 and 2 give the second client twice the device "
                   "time of the first)")


def _check_seconds(client: str, what: str, seconds: float) -> None:
    """Device seconds the scheduler is handed (an estimate, a measure): a finite number >= 0."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
        raise ValueError(f"client {client!r}: {what} must be finite device seconds >= 0, got {seconds!r}")


class ShareScheduler:
    """One island's admission of calls from many clients, by stride scheduling on device time.

    One condition guards everything; every blocked `admit` re-checks both of its conditions (room on the
    island, smallest pass among the waiting clients) whenever something changes, so there is no hand-off
    logic to get wrong. A client's own waiters are FIFO and only its oldest one competes: otherwise a
    client's later call could overtake its earlier one, and a client's pass would be compared with itself.
    """

    def __init__(self, island: str, *, slots: int, clock: Callable[[], float] = time.monotonic,
                 quantum_s: float = 0.002, hold_s: float = HOLD_S):
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"island {island!r}: slots must be an int >= 1 (calls in flight at once), "
                             f"got {slots!r}")
        if not quantum_s >= 0:
            raise ValueError(f"island {island!r}: quantum_s must be >= 0, got {quantum_s!r}")
        self.island, self.slots, self.quantum_s, self._clock = island, slots, float(quantum_s), clock
        self.hold_s = float(hold_s)
        self.expired = 0   # tickets whose slots went back unfinished after hold_s (stuck or very long calls)
        self._cond = threading.Condition()
        self._weight: dict[str, float] = {}
        self._pass: dict[str, float] = {}
        self._queue: dict[str, collections.deque[_Waiter]] = {}
        self._held: dict[str, int] = {}                      # client → slots in flight
        self._live: dict[int, Ticket] = {}                   # admitted, not finished
        self._voided: set[int] = set()                       # live when their client was removed
        self._expired: set[int] = set()                      # slots given back after hold_s, not yet finished
        self._in_flight = 0
        self._vtime = 0.0                                    # smallest backlogged pass, last seen
        self._left: collections.OrderedDict[str, float] = collections.OrderedDict()   # gone client → its pass
        self._seq = itertools.count(1)
        self._records: collections.deque[tuple[float, str, float]] = collections.deque(maxlen=HISTORY_RECORDS)

    # -- clients ------------------------------------------------------------------------------------------

    def add_client(self, client: str, weight: float) -> None:
        """Register `client` with a relative `weight`; adding it again only sets its weight.

        A new client's pass starts at 0, one that left and comes back (a reconnect) at the pass it left with; its
        first `admit` lifts it to at least the island's (see `admit`), so it neither starts ahead of the others
        nor behind them, and leaving does not clear what it used."""
        weight = check_weight(client, weight)
        with self._cond:
            if client not in self._weight:
                self._pass[client] = self._left.pop(client, 0.0)
                self._queue[client], self._held[client] = collections.deque(), 0
            self._weight[client] = weight
            self._cond.notify_all()

    def set_weight(self, client: str, weight: float) -> None:
        """Change a known client's weight; its pass so far stays, its later calls are charged at the new one."""
        weight = check_weight(client, weight)
        with self._cond:
            self._known(client)
            self._weight[client] = weight
            self._cond.notify_all()

    def remove_client(self, client: str) -> None:
        """Forget `client`: its waiting calls raise `ClientGone`, its slots in flight are free at once.

        Its tickets still running are void: finishing one later changes nothing. Its pass is remembered (the last
        `REMEMBERED_CLIENTS` to leave): adding it again resumes it."""
        with self._cond:
            self._known(client)
            for waiter in self._queue.pop(client):
                waiter.gone = True
            self._in_flight -= self._held.pop(client)
            for number in [n for n, t in self._live.items() if t.client == client]:
                del self._live[number]
                self._voided.add(number)
            self._left[client] = self._pass.pop(client)
            self._left.move_to_end(client)
            while len(self._left) > REMEMBERED_CLIENTS:
                self._left.popitem(last=False)
            del self._weight[client]
            self._cond.notify_all()

    def _known(self, client: str) -> None:
        if client not in self._weight:
            raise ValueError(f"unknown client {client!r} on island {self.island!r}; known clients: "
                             f"{sorted(self._weight)}; add it first with add_client(client, weight)")

    # -- admission ----------------------------------------------------------------------------------------

    def admit(self, client: str, estimate_s: float, slots: int = 1, timeout_s: float | None = None) -> Ticket:
        """Block until `client` may dispatch `slots` calls expected to take `estimate_s` device seconds.

        It may when the island has room (nothing in flight, or room for all `slots`: a program wider than
        the island runs alone rather than never) and, of the clients waiting now, it has the smallest pass
        (ties: the earliest waiter). A client coming back from idle (nothing waiting, nothing in flight)
        first has its pass lifted to at least the island's pass less one quantum: the smallest pass of the
        backlogged clients, or, with none, the last such pass seen. So idle time is neither charged nor
        banked: it loses at most a quantum of share, and cannot come back with a burst.
        """
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"client {client!r}: slots must be an int >= 1, got {slots!r}")
        _check_seconds(client, "estimate_s", estimate_s)
        with self._cond:
            self._known(client)
            queue = self._queue[client]
            if not queue and not self._held[client]:
                floor = self._island_pass(exclude=client) - self.quantum_s / self._weight[client]
                self._pass[client] = max(self._pass[client], floor)
            waiter = _Waiter(client, slots, next(self._seq))
            queue.append(waiter)
            self._note_vtime()
            ready = self._wait_for_turn(waiter, timeout_s)
            if waiter.gone:
                raise ClientGone(f"client {client!r} was removed from island {self.island!r} while its "
                                 f"{slots} slot(s) waited for admission; nothing was dispatched")
            if not ready:
                ahead = self._ahead_of(waiter)
                self._drop_waiter(waiter)
                raise TimeoutError(f"client {client!r} waited {timeout_s:.3g} s for {slots} slot(s) on island "
                                   f"{self.island!r} and was not admitted: {ahead}; try again later, or ask the "
                                   f"operator for a larger weight or a longer admission timeout")
            try:
                charged = self._charged(client, estimate_s)
            except NonFinitePassError:
                self._drop_waiter(waiter)
                raise
            queue.popleft()
            self._in_flight += slots
            self._held[client] += slots
            self._pass[client] = charged
            ticket = Ticket(client, slots, float(estimate_s), self._clock(), next(self._seq))
            self._live[ticket.number] = ticket
            self._note_vtime()
            self._cond.notify_all()                 # its next waiter is the client's head now; room may remain
            return ticket

    def _wait_for_turn(self, waiter: _Waiter, timeout_s: float | None) -> bool:
        """Wait (the condition held) until ``waiter`` is gone or may be admitted; False after ``timeout_s``. Every
        second at most it also takes back the slots of tickets held past ``hold_s`` (`_expire_held`)."""
        deadline = None if timeout_s is None else self._clock() + timeout_s
        while True:
            self._expire_held()
            if waiter.gone or self._may_admit(waiter):
                return True
            left = None if deadline is None else deadline - self._clock()
            if left is not None and left <= 0:
                return False
            self._cond.wait(_EXPIRY_CHECK_S if left is None else min(left, _EXPIRY_CHECK_S))

    def _expire_held(self) -> None:
        """A ticket unfinished after ``hold_s`` gives its slots back, and its client is charged the time it held
        them (as device time of every slot: what it kept from the others). A call whose inputs never come (a put
        its client never sends) held the island's window for good before (issue 46: found by bench/fuzz_service);
        now it costs its client, and the others go on. The call still runs if its inputs come."""
        now = self._clock()
        for number, ticket in list(self._live.items()):
            if now - ticket.admitted_at <= self.hold_s:
                continue
            del self._live[number]
            self._expired.add(number)
            self._in_flight -= ticket.slots
            self._held[ticket.client] -= ticket.slots
            self.expired += 1
            try:
                self._pass[ticket.client] = self._charged(ticket.client, self.hold_s * ticket.slots)
            except NonFinitePassError:
                pass
            self._cond.notify_all()

    def _drop_waiter(self, waiter: _Waiter) -> None:
        self._queue[waiter.client].remove(waiter)
        self._cond.notify_all()                     # it may have been the head everyone else waited behind

    def _ahead_of(self, waiter: _Waiter) -> str:
        """Who is ahead of ``waiter`` on this island: the calls in flight and the waiting ones that go first, by
        client."""
        in_flight = {c: n for c, n in sorted(self._held.items()) if n}
        mine = (self._pass[waiter.client], waiter.seq)
        first = {c: len(q) for c, q in sorted(self._queue.items())
                 if q and c != waiter.client and (self._pass[c], q[0].seq) <= mine}
        own = list(self._queue[waiter.client]).index(waiter)
        if own:
            first[waiter.client] = own
        return (f"{sum(in_flight.values()) + sum(first.values())} call(s) ahead of it ({self._in_flight} of "
                f"{self.slots} slots in flight: {in_flight or 'none'}; waiting to go first: {first or 'none'})")

    def _charged(self, client: str, seconds: float) -> float:
        """``client``'s pass after ``seconds`` more device seconds; `NonFinitePassError` (logged) if not finite.

        Checked inputs cannot get here; this is the scheduler's own guard: a NaN pass would freeze the island."""
        charged = self._pass[client] + seconds / self._weight[client]
        if not math.isfinite(charged):
            error = NonFinitePassError(
                f"island {self.island!r}: charging client {client!r} {seconds!r} device seconds at weight "
                f"{self._weight[client]!r} would make its pass {charged!r} (it is {self._pass[client]!r}); refused, "
                f"the pass is kept. Costs and weights must be finite and bounded where they enter "
                f"(pathways_torch/wire/limits.py)")
            log.error("%s", error)
            raise error
        return charged

    def _may_admit(self, waiter: _Waiter) -> bool:
        queue = self._queue[waiter.client]
        if queue[0] is not waiter:
            return False
        if self._in_flight and self._in_flight + waiter.slots > self.slots:
            return False
        if self._over_own_share(waiter):
            return False
        # Its own head is in the comparison too: a later waiter of the same client never counts as first.
        mine = (self._pass[waiter.client], waiter.seq)
        return all(mine <= (self._pass[c], q[0].seq) for c, q in self._queue.items() if q)

    def _over_own_share(self, waiter: _Waiter) -> bool:
        """While another client waits or holds slots, no client holds more than half the window: one whose calls
        are slow or stuck leaves the others room (alone, a client may fill the window)."""
        client = waiter.client
        others = any(q for c, q in self._queue.items() if c != client) or any(
            n for c, n in self._held.items() if c != client)
        return others and self._held[client] > 0 and self._held[client] + waiter.slots > max(1, self.slots // 2)

    def _island_pass(self, exclude: str) -> float:
        backlogged = [p for c, p in self._pass.items() if c != exclude and (self._queue[c] or self._held[c])]
        return min(backlogged) if backlogged else self._vtime

    def _note_vtime(self) -> None:
        backlogged = [p for c, p in self._pass.items() if self._queue[c] or self._held[c]]
        if backlogged:
            self._vtime = min(backlogged)

    def finished(self, ticket: Ticket, device_s: float) -> None:
        """The ticket's calls ended after `device_s` device seconds (the executors' measure).

        Frees its slots and corrects its client's pass by what the estimate missed, so a client whose
        estimates run low pays the difference before its next call competes."""
        _check_seconds(ticket.client, "device_s", device_s)
        with self._cond:
            if ticket.number in self._voided:
                self._voided.discard(ticket.number)
                return
            if ticket.number in self._expired:   # its slots went back already, its hold charged
                self._expired.discard(ticket.number)
                return
            if self._live.pop(ticket.number, None) is None:
                raise ValueError(f"ticket {ticket.number} of client {ticket.client!r} on island "
                                 f"{self.island!r} is not in flight: finished twice, or from another island")
            client = ticket.client
            try:
                self._pass[client] = self._charged(client, device_s - ticket.estimate_s)
            except NonFinitePassError:
                pass                                # logged; its slots are freed all the same
            self._note_vtime()                      # while it is still backlogged
            self._in_flight -= ticket.slots
            self._held[client] -= ticket.slots
            now = self._clock()
            self._records.append((now, client, float(device_s)))
            while self._records and self._records[0][0] < now - HISTORY_S:
                self._records.popleft()
            self._cond.notify_all()

    # -- reading ------------------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        with self._cond:
            return self._in_flight

    @property
    def waiting(self) -> dict[str, int]:
        """Calls waiting for admission, per known client (0 included), in name order."""
        with self._cond:
            return self._waiting_counts()

    def _waiting_counts(self) -> dict[str, int]:
        return {c: len(self._queue[c]) for c in sorted(self._queue)}

    def shares(self, window_s: float = 60.0) -> dict[str, float]:
        """Each known client's fraction of the device time finished in the last `window_s` seconds.

        0.0 for a known client with none; the fractions sum to 1 when any device time finished. Looks back
        at most `HISTORY_S`."""
        totals = self.device_seconds(window_s)
        whole = sum(totals.values())
        return {c: (s / whole if whole > 0 else 0.0) for c, s in totals.items()}

    def device_seconds(self, window_s: float = 60.0) -> dict[str, float]:
        """Each known client's device seconds finished in the last `window_s` seconds (0.0 for none)."""
        with self._cond:
            since = self._clock() - window_s
            totals = dict.fromkeys(sorted(self._weight), 0.0)
            for at, client, device_s in self._records:
                if at >= since and client in totals:
                    totals[client] += device_s
            return totals

    def load(self) -> dict[str, tuple[int, int]]:
        """Per known client: (calls waiting for admission, calls admitted and unfinished)."""
        with self._cond:
            return {c: (len(self._queue[c]), self._held[c]) for c in sorted(self._weight)}

    def describe(self) -> str:
        """A table, one line per client in name order: weight, pass, waiting, in flight, share of the last minute."""
        shares = self.shares(60.0)
        with self._cond:
            rows = [("client", "weight", "pass", "waiting", "in flight", "share 60s")]
            rows += [(c, f"{self._weight[c]:g}", f"{self._pass[c]:.6g}", str(len(self._queue[c])),
                      str(self._held[c]), f"{100 * shares.get(c, 0.0):.1f}%") for c in sorted(self._weight)]
            head = f"island {self.island!r}: {self._in_flight} of {self.slots} slots in flight"
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        return "\n".join([head, *lines])


class CostModel:
    """Per function key, an exponential moving average of measured device seconds: the estimate `admit` charges.

    The estimate only has to be roughly right: `finished` charges the measured time anyway, so a wrong
    estimate shifts when a client's share is paid, not how much."""

    def __init__(self, alpha: float = 0.2):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1] (the weight of the newest measure), got {alpha!r}")
        self.alpha = alpha
        self._mean: dict[Hashable, float] = {}
        self._lock = threading.Lock()

    def observe(self, key: Hashable, device_s: float) -> None:
        """Fold one measure in; the first measure of a key is its estimate."""
        if not device_s >= 0:
            raise ValueError(f"function {key!r}: device_s must be >= 0, got {device_s!r}")
        with self._lock:
            old = self._mean.get(key)
            self._mean[key] = float(device_s) if old is None else old + self.alpha * (device_s - old)

    def estimate(self, key: Hashable, default_s: float = 0.001) -> float:
        """The key's average so far, or `default_s` for a key never measured."""
        with self._lock:
            return self._mean.get(key, default_s)
