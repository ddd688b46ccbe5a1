"""The seam between the client and the controller: the `ControllerClient` protocol and what the client hears back.

What the client asks is one operation at a time, ``request(op)``, each a frozen dataclass of
`pathways_torch.wire.seam` (`SeamOp`) handled once by the controller's `ClientOps`; what it hears back are the
events of `ClientEvents` and each array's `ArraySettled`. Everything is plain data (frozen dataclasses, ints,
strings, tuples, protobuf envelopes and the errors the controller reports), so `RemoteClient` carries each over
the wire; no lock, event or mutable controller object crosses it. `pathways_torch.client.InProcessClient`
implements it over the controller embedded in this process.

The client keeps its own state of every array it was handed (`ArrayState`): the controller's settle events
update it, and `Array` waits on it alone.
"""

from __future__ import annotations

import threading
from typing import Protocol

from .wire.seam import ArraySettled, ControllerCounters, ExecutorView
from .wire.wake import set_at_turn_end, this_threads_waker

__all__ = ["ControllerClient", "ClientEvents", "ExecutorView", "ArraySettled", "ArrayState", "ControllerCounters",
           "PENDING", "READY", "FAILED"]

PENDING, READY, FAILED = "pending", "ready", "failed"
_RANK = {PENDING: 0, READY: 1, FAILED: 2}   # an array's state only moves forward
_WAITERS = threading.Lock()


class ArrayState:
    """The client's own view of one array: its state, error and lost holders, set by `ArraySettled` events.

    Moves forward only (pending → ready → failed; the first error is kept), so an event that arrives late
    never undoes a newer one. A waiting thread blocks on its own `ThreadWaker`, which the settle wakes with the GIL let
    go: the thread wakes once, not three times (see `pathways_torch.wire.wake`).
    """

    __slots__ = ("array_id", "state", "error", "block_shape", "lost_holders", "put_token", "_wakers")

    def __init__(self, array_id: int):
        self.array_id = array_id
        self.state = PENDING
        self.error: BaseException | None = None
        self.block_shape: tuple[int, ...] | None = None
        self.lost_holders: tuple[str, ...] = ()
        self.put_token = b""   # sent with each put of its shards (the controller's, for a service client's array)
        self._wakers: tuple = ()   # of the threads waiting (`ThreadWaker`): most arrays are never waited for

    def apply(self, event: ArraySettled) -> None:
        """Take in an event about this array (from the controller's thread or the client's)."""
        if event.lost_holders and set(event.lost_holders) - set(self.lost_holders):
            self.lost_holders = tuple(sorted(set(self.lost_holders) | set(event.lost_holders)))
        if _RANK[event.state] <= _RANK[self.state]:
            return
        if event.block_shape is not None:
            self.block_shape = tuple(event.block_shape)
        if self.error is None:
            self.error = event.error
        self.state = event.state
        for waker in self._wakers:   # read after the state is set: see wait
            set_at_turn_end(waker)

    def done(self) -> bool:
        """Computed or failed."""
        return self.state != PENDING

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until computed or failed; False if ``timeout_s`` passed first."""
        if self.state != PENDING:
            return True
        waker = this_threads_waker()
        with _WAITERS:
            self._wakers = (*self._wakers, waker)
        try:   # the state is looked at again after the waker is listed: `apply` sets the state, then wakes the listed
            return waker.wait_until(self.done, timeout_s)
        finally:
            with _WAITERS:
                self._wakers = tuple(w for w in self._wakers if w is not waker)


class ClientEvents(Protocol):
    """What the client hears from the controller, besides each array's `ArraySettled` (sent to its state)."""

    def executor_lost(self, executor_id: str, error: BaseException) -> None:
        """The controller declared ``executor_id`` lost; what depended on it failed with ``error``."""

    def new_incarnation(self, executor: ExecutorView) -> None:
        """An executor registered again (replaced): new address, new key, next epoch."""

    def key_revoked(self, public_key: bytes) -> None:
        """A key the client's sockets admitted belongs to a replaced incarnation: refuse it from now on."""


class ControllerClient(Protocol):
    """How the client speaks to the controller: `InProcessClient` (embedded) or `RemoteClient` (a standalone
    ``pathways-controller``). Every operation is one of `pathways_torch.wire.seam`'s (`SeamOp`), handled once by the
    controller's `ClientOps`; what only an embedded controller does is ``InProcessClient.local``, off the protocol."""

    address: str   # where executors reach the controller

    def request(self, op) -> object:
        """Run one `SeamOp`; its answer (the arrays it makes as `ArrayState` s, kept up to date from then on). An
        operation that needs no answer may return before it runs (remote); a call's error may raise here
        (embedded) or fail its outputs (remote: a call is not waited for); either way it reaches whoever reads
        them."""

    def subscribe(self, events: ClientEvents) -> None:
        """Send the controller's events (losses, incarnations, revoked keys) to ``events``."""

    def fail_pending(self, reason: str) -> int:
        """Fail this client's pending arrays with `ContextClosedError`; how many."""

    def shutdown_executors(self, reason: str) -> None:
        """The client closes: an embedded controller stops its executors; a remote one frees what this client
        held, and serves its other clients on."""

    io_running: bool   # whether the client's I/O thread still runs

    def close(self) -> None:
        """Stop the client's sockets and threads."""
