"""`MemoryBudget`: bytes per executor, per client, under ``--executor-memory-bytes`` (a controller serving clients).

What it counts, per executor: the bytes of the arrays the controller knows live there, from when they are asked
for until their record is forgotten (the owner released the array and no put of it is still landing). Those are

- each put (``new_array``'s ``shard_bytes``): exactly what the executors store of it. Each shard's put token
  (`pathways_torch.wire.put_tokens`) binds the bytes reserved here, with the array, executor, shard, tag and
  client, and is good for one put; the executor refuses a frame of any other size, a second put, or a put after
  the array was freed (its Free spends the tokens), so a client cannot store more than it was counted for;
- each call's outputs: ``CallSpec.output_shard_bytes`` (the client knows each output's block shape and dtype when
  it traces; an output whose size depends on the data counts 0). The client's word, held to: each Run carries the
  bytes counted per output shard (``Run.output_budget_bytes``), and an executor stores an output found larger as
  a failure of 0 bytes instead (`executor.output_budget`), so what it stores is never more than what is counted
  here (an output that counts 0, its size depending on the data, is one such: it cannot be stored under a limit);
- each program run's outputs (the program's nodes carry ``output_shard_bytes`` too; ``RunProgram`` carries the
  budgets, held to the same way).

It does not count a program's intermediates, copies in transit between executors (or their landing buffers),
function constants, compiled code, or anything else an executor's store or device holds: the executors report
their stores' actual bytes (``ctx.stats()``), and those may be more. A shard's bytes stay counted after its
executor is lost, until its owner drops the array. When a client leaves, its arrays are dropped, those it was
still putting too (`client_ops.ClientOps.release_everything`): their bytes come back at once.

A call or put that would take an executor past the limit waits (back-pressure: the client's call, remote or
embedded, blocks there, holding no lock of the controller's and none of the islands' sequencers, so others' calls
and frees go on) until every executor it names has room, then takes it. After ``ControllerConfig.memory_wait_s``
(``--memory-wait-s``) it fails with `OutOfMemoryError` naming the client, the first executor that lacked room, the
bytes asked for, held and the limit. A request larger than the limit itself fails at once: it never fits. Waiters
are not queued in order: a small request that fits goes ahead of a large one still waiting (other clients keep
running while one waits). A client waiting for memory its own earlier arrays hold waits for their frees: a remote
client's frees sent after the call are read after it, so that wait ends in the timeout.

A client that leaves while its call or put waits here ends that wait at once with `ClientGone` (`forget_client`,
from `client_ops.ClientOps.release_everything`): its worker is not parked for ``memory_wait_s``.

Limit 0 (the default, and the embedded controller's): nothing is counted, nothing waits, and runs carry no budgets.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Mapping

from pathways_torch.errors import ContextClosedError, OutOfMemoryError

from .shares import ClientGone

__all__ = ["MemoryBudget", "Reservation", "demand_of"]


def demand_of(executor_ids, shard_bytes: int, into: dict | None = None) -> dict[str, int]:
    """Bytes per executor of an array with one ``shard_bytes`` shard on each of ``executor_ids`` (added to
    ``into``: an executor named twice counts twice)."""
    demand = {} if into is None else into
    if shard_bytes > 0:
        for executor_id in executor_ids:
            demand[executor_id] = demand.get(executor_id, 0) + shard_bytes
    return demand


class Reservation:
    """Bytes taken for a call or put before its array records exist. Once they do, they hold the bytes
    (``ArrayRecord.held_bytes``) and the reservation is ``claimed``; one never claimed is handed back (`cancel`)."""

    __slots__ = ("client", "demand", "claimed")

    def __init__(self, client: str, demand: dict[str, int]):
        self.client, self.demand, self.claimed = client, demand, False


class MemoryBudget:
    """Per-executor bytes held against ``limit_bytes`` (0: no accounting). Thread-safe."""

    def __init__(self, limit_bytes: int = 0, clock: Callable[[], float] = time.monotonic):
        if not isinstance(limit_bytes, int) or limit_bytes < 0:
            raise ValueError(f"executor memory limit: expected bytes >= 0 (0: no limit), got {limit_bytes!r}")
        self.limit_bytes = limit_bytes
        self.clock = clock
        self._cond = threading.Condition()
        self.held: collections.Counter = collections.Counter()          # executor → bytes
        self.by_client: collections.Counter = collections.Counter()     # (executor, client) → bytes
        self.waiting = 0          # requests waiting for room now
        self.waits = 0            # requests that ever waited
        self.refused = 0          # requests that failed with OutOfMemoryError
        self.closing_reason = ""
        # Client → how many times it left (`forget_client`): a wait that began before its client's latest departure
        # ends with ClientGone.
        self._departures: collections.Counter = collections.Counter()

    @property
    def enabled(self) -> bool:
        return self.limit_bytes > 0

    def reserve(self, client: str, demand: Mapping[str, int], timeout_s: float, what: str = "a call"
                ) -> Reservation | None:
        """Wait until every executor of ``demand`` (executor → bytes) has room for its bytes, then take them all;
        None when there is no limit or nothing is asked. Raises `OutOfMemoryError` after ``timeout_s`` (at once
        for a request over the limit), `ContextClosedError` once the controller closes, `ClientGone` once
        ``client`` leaves while it waits (`forget_client`)."""
        demand = {e: b for e, b in demand.items() if b > 0}
        if not self.enabled or not demand:
            return None
        for executor_id, wanted in demand.items():
            if wanted > self.limit_bytes:
                with self._cond:
                    self.refused += 1
                    held = self.held[executor_id]
                raise self._error(client, executor_id, wanted, held, what, never=True)
        with self._cond:
            departures = self._departures[client]
            if not self._fits(demand):
                self.waiting += 1
                self.waits += 1
                deadline = self.clock() + timeout_s
                try:
                    while (not self.closing_reason and not self._fits(demand)
                           and self._departures[client] == departures):
                        left = deadline - self.clock()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                finally:
                    self.waiting -= 1
            if self.closing_reason:
                raise ContextClosedError(f"{self.closing_reason} while {what} of {client or 'the client'} waited "
                                         f"for executor memory")
            if self._departures[client] != departures:
                raise ClientGone(f"client {client!r} left while {what} waited for executor memory: nothing was "
                                 f"made for it; connect again to go on")
            short = self._short(demand)
            if short is not None:
                self.refused += 1
                raise self._error(client, short, demand[short], self.held[short], what, waited_s=timeout_s)
            self._add(client, demand, 1)
        return Reservation(client, demand)

    def cancel(self, reservation: Reservation | None) -> None:
        """A reservation whose arrays were never made: hand its bytes back."""
        if reservation is not None and not reservation.claimed:
            reservation.claimed = True
            self.release(reservation.client, reservation.demand)

    def release(self, client: str, demand: Mapping[str, int]) -> None:
        """Bytes an array held (its record is forgotten) are free again; wake the waiters."""
        with self._cond:
            self._add(client, demand, -1)
            self._cond.notify_all()

    def forget_client(self, client: str) -> None:
        """``client`` left: the waits its requests have begun end now with `ClientGone` (not after
        ``memory_wait_s``). Its bytes come back as its arrays are released (`release`)."""
        with self._cond:
            self._departures[client] += 1
            self._cond.notify_all()

    def close(self, reason: str) -> None:
        """The controller stops: every wait ends with `ContextClosedError`."""
        with self._cond:
            self.closing_reason = reason
            self._cond.notify_all()

    def snapshot(self) -> dict[str, dict]:
        """Per executor: its bytes held, by client too (for status and tests)."""
        with self._cond:
            out = {e: {"held": b, "clients": {}} for e, b in sorted(self.held.items()) if b}
            for (executor_id, client), b in sorted(self.by_client.items()):
                if b:
                    out.setdefault(executor_id, {"held": 0, "clients": {}})["clients"][client] = b
            return out

    # ------------------------------------------------------------ under the condition's lock

    def _fits(self, demand: Mapping[str, int]) -> bool:
        return self._short(demand) is None

    def _short(self, demand: Mapping[str, int]) -> str | None:
        """The first executor (in name order) without room for its part of ``demand``; None if all have room."""
        for executor_id in sorted(demand):
            if self.held[executor_id] + demand[executor_id] > self.limit_bytes:
                return executor_id
        return None

    def _add(self, client: str, demand: Mapping[str, int], sign: int) -> None:
        for executor_id, b in demand.items():
            self.held[executor_id] += sign * b
            self.by_client[(executor_id, client)] += sign * b
            if self.held[executor_id] <= 0:
                del self.held[executor_id]
            if self.by_client[(executor_id, client)] <= 0:
                del self.by_client[(executor_id, client)]

    def _error(self, client: str, executor_id: str, wanted: int, held: int, what: str, *, never: bool = False,
               waited_s: float = 0.0) -> OutOfMemoryError:
        own = self.by_client[(executor_id, client)] if not never else 0
        who = f"client {client!r}" if client else "the client"
        head = (f"{who}: {what} asks for {_size(wanted)} on executor {executor_id}, whose memory limit is "
                f"{_size(self.limit_bytes)} (--executor-memory-bytes)")
        if never:
            body = "; it never fits, whatever is freed"
            fix = ("make the arrays smaller per executor (shard them over more executors), or ask the controller's "
                   "operator for more memory per executor (--executor-memory-bytes)")
        else:
            body = (f"; it holds {_size(held)} ({_size(own)} of them yours), and no room came within "
                    f"{waited_s:g} s (--memory-wait-s)")
            fix = ("free arrays you no longer need (del them), fetch the results you need and drop their arrays, "
                   "or ask the controller's operator for more memory per executor (--executor-memory-bytes)")
        return OutOfMemoryError(f"{head}{body}. Fix: {fix}", client=client, executor_id=executor_id,
                                requested_bytes=wanted, held_bytes=held, limit_bytes=self.limit_bytes)


def _size(n: int) -> str:
    return f"{n} bytes" if n < 1 << 20 else f"{n} bytes ({n / (1 << 20):.1f} MiB)"
