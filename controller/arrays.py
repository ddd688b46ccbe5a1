"""Arrays and their lifetimes: where each array's shards live, its state, who still holds it, and its frees.

`ArrayTable` holds the records; `Lifetimes` follows a put's shards landing and the client's releases, and sends
the Free messages once nothing holds an array (riding on the next message to the executor where it can).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from typing import Callable

from pathways_torch.wire import pb
from pathways_torch.wire.put_tokens import PUT_SECRET_BYTES, put_token, put_token_claim, shard_put_token
from pathways_torch.wire.security import owner_role

from .memory import demand_of

__all__ = ["ArrayRecord", "ArrayTable", "Lifetimes", "PENDING", "READY", "FAILED", "shard_refs"]

PENDING, READY, FAILED = "pending", "ready", "failed"


@dataclasses.dataclass
class ArrayRecord:
    """One logical array: shard ``p`` lives on ``executor_ids[p]``."""

    array_id: int
    executor_ids: tuple[str, ...]
    state: str = PENDING
    error: BaseException | None = None
    landing: int = 0              # put shards not yet acknowledged by their executor
    released: bool = False        # the client dropped its handle
    producer_call: int = 0
    block_shape: tuple[int, ...] | None = None   # set on completion when the sizes depended on the data
    event: threading.Event = dataclasses.field(default_factory=threading.Event)
    replicated: bool = False      # every shard holds the same value (a Replicate() output)
    owner: str = ""               # the client it was handed to (`client_ops`): "" the embedded one
    # What lets its owner put its shards: one token per shard, in shard order (`put_tokens.put_token`; each good for
    # one put of exactly the bytes the budget counted, on the shard's executor, which checks it). A service client's
    # put only. The embedded client's puts need none (its role owns what no one else does).
    put_token: bytes = b""
    # Executors whose shard of it was lost: gone for good, even once a replacement takes the executor's place
    # (a call reading it there would wait forever), so the array may no longer be an input.
    lost_holders: set = dataclasses.field(default_factory=set)
    # Bytes of each shard counted in the controller's memory budget (`memory.MemoryBudget`; 0: none), given back
    # when the record is forgotten.
    held_bytes: int = 0
    # Told of every change (settled, or a holder lost), on the thread that made it, under the controller's lock:
    # the client's own state of the array follows it (pathways_torch.client). Must be quick and not block.
    listener: Callable[["ArrayRecord"], None] | None = dataclasses.field(default=None, repr=False, compare=False)

    def settle(self, state: str, error: BaseException | None = None) -> None:
        if self.state != PENDING:
            return  # the earliest outcome is kept
        self.state, self.error = state, error
        self.event.set()
        if self.listener is not None:
            self.listener(self)

    def lose(self, executor_id: str, error: BaseException) -> None:
        """A shard's executor is gone: fail the array even if it was ready (an earlier failure stays), unless it is
        replicated and a replica is left."""
        self.lost_holders.add(executor_id)
        if self.state == READY and self.replicated and len(self.lost_holders) < len(set(self.executor_ids)):
            pass      # a replica is left: the value stays readable from it (`live_position`)
        elif self.state != FAILED:
            self.state, self.error = FAILED, error
            self.event.set()
        if self.listener is not None:
            self.listener(self)


class ArrayTable:
    """Array records by id. The controller holds its lock while using it."""

    def __init__(self):
        self._records: dict[int, ArrayRecord] = {}
        self._next_id = 1

    def new(self, executor_ids: tuple[str, ...], *, producer_call: int = 0, landing: int = 0,
            array_id: int | None = None) -> ArrayRecord:
        """A new record: the next id, or ``array_id`` (one `reserve` handed out before, not in use)."""
        if array_id is None:
            array_id = self._next_id
            self._next_id += 1
        elif array_id in self._records or not 0 < array_id < self._next_id:
            raise ValueError(f"array id {array_id}: expected an id reserved before and not in use")
        record = ArrayRecord(array_id, executor_ids, producer_call=producer_call, landing=landing)
        self._records[array_id] = record
        return record

    def reserve(self, count: int) -> int:
        """Skip ``count`` ids (a program run's intermediates, a remote client's own ids); return the first."""
        first = self._next_id
        self._next_id += count
        return first

    def get(self, array_id: int) -> ArrayRecord | None:
        return self._records.get(array_id)

    def forget(self, array_id: int) -> None:
        self._records.pop(array_id, None)

    def __len__(self) -> int:
        return len(self._records)

    def records(self) -> list[ArrayRecord]:
        return list(self._records.values())


# Frees wait for the next message to their executor, or for the client to idle; past this
# many shards per executor they go at once, in a Free of their own.
_MAX_PENDING_FREES = 256


def shard_refs(pairs) -> list:
    """``(array id, shard)`` pairs as the ``ShardRef`` messages a Free carries."""
    return [pb.ShardRef(array_id=array_id, shard=shard) for array_id, shard in pairs]


class Lifetimes:
    """The `Controller`'s array lifetimes: puts landing, handles released, shards freed.

    Its public methods take the controller's lock; `take_pending_frees` expects it held. A put waits for room in
    ``memory`` (`MemoryBudget`), and a forgotten array gives its bytes back there and tells ``failures``
    (`CallFailures`), which keeps a failed call's error while an output of it is held.
    """

    def __init__(self, state, *, memory, failures):
        self._state = state
        self._lock, self.arrays, self.resources = state.lock, state.arrays, state.resources
        self._send = state.send
        self._memory, self._failures = memory, failures
        # executor → (array id, shard) of each shard to free there: tuples, not ShardRefs (a release on 1,024
        # executors would make 1,024 messages' worth; down a launch tree only the array ids travel)
        self._pending_frees: dict[str, list] = collections.defaultdict(list)
        self._batching_frees = False     # inside release_many (under the lock)
        # The key of every put token (`new_array`); each executor has it from its Welcome.
        self.put_secret = os.urandom(PUT_SECRET_BYTES)
        self._put_sequences: collections.Counter = collections.Counter()   # (client, executor) → tokens made
        # executor → `pb.SpentPut` of each forgotten put array's shards there, and those shards: sent at once in a
        # Free of their own (the executor fails the runs still waiting for a shard named there, so a Free with
        # spent puts names put arrays' shards only: never a computed one whose run has not begun)
        self._spent_puts: dict[str, list] = collections.defaultdict(list)
        self._put_frees: dict[str, list] = collections.defaultdict(list)

    def new_array(self, executor_ids: tuple[str, ...], *, landing: int = 0, owner: str = "",
                  shard_bytes: int = 0) -> ArrayRecord:
        """An array whose shards the client ``owner`` puts itself (``landing`` shards still on their way).

        With a memory limit, first waits (no lock held) until each executor has room for a ``shard_bytes`` shard."""
        memory = self._memory
        reservation = None
        if memory.limit_bytes and shard_bytes > 0:
            reservation = memory.reserve(owner, demand_of(executor_ids, shard_bytes),
                                         self._state.config.memory_wait_s, what="a put")
        try:
            return self._new_array(executor_ids, landing, owner, shard_bytes, reservation)
        except BaseException:
            memory.cancel(reservation)
            raise

    def _new_array(self, executor_ids, landing: int, owner: str, shard_bytes: int, reservation) -> ArrayRecord:
        with self._lock:
            self.resources.check_live(executor_ids)
            record = self.arrays.new(executor_ids, landing=landing)
            record.owner = owner
            if reservation is not None:
                record.held_bytes, reservation.claimed = shard_bytes, True
            if owner:
                record.put_token = self._put_tokens(record, owner, shard_bytes)
            if landing == 0:
                record.settle(READY)
            return record

    def _put_tokens(self, record: ArrayRecord, owner: str, shard_bytes: int) -> bytes:
        """One token per shard of ``record``: its executor (and incarnation), its position, and ``shard_bytes``, the
        bytes the budget reserved for it (the executor refuses a frame of any other size)."""
        role, executors, tokens = owner_role(owner), self.resources.executors, []
        for position, executor_id in enumerate(record.executor_ids):
            self._put_sequences[(owner, executor_id)] += 1
            tokens.append(put_token(self.put_secret, sequence=self._put_sequences[(owner, executor_id)],
                                    array_id=record.array_id, shard=position, nbytes=max(shard_bytes, 0),
                                    executor_id=executor_id, epoch=executors[executor_id].epoch, role=role))
        return b"".join(tokens)

    def abandon_puts(self, array_ids, error: BaseException) -> None:
        """The client that puts these arrays left: the shards not landed yet never will (its tokens are spent with
        the arrays' Free, so a put still on its way is refused, not kept); settle them failed."""
        with self._lock:
            for array_id in array_ids:
                record = self.arrays.get(array_id)
                if record is not None and record.landing > 0:
                    record.settle(FAILED, error)
                    record.landing = 0
                    self._maybe_forget(record)

    def landed(self, array_id: int, error: BaseException | None = None) -> None:
        """One put shard arrived on its executor (the client saw the ack), or never will (``error``)."""
        with self._lock:
            record = self.arrays.get(array_id)
            if record is None:
                return
            if error is not None:
                record.settle(FAILED, error)
            record.landing -= 1
            if record.landing == 0:
                record.settle(READY)
            self._maybe_forget(record)

    def release(self, array_id: int) -> None:
        """The client dropped its handle; free the shards once nothing else holds them."""
        with self._lock:
            record = self.arrays.get(array_id)
            if record is None or record.released:
                return
            record.released = True
            self._maybe_forget(record)

    def _maybe_forget(self, record: ArrayRecord) -> None:
        if not record.released or record.landing > 0:
            return
        self.arrays.forget(record.array_id)
        if record.held_bytes:
            self._memory.release(record.owner, demand_of(record.executor_ids, record.held_bytes))
            record.held_bytes = 0
        pending_frees, array_id, flush = self._pending_frees, record.array_id, False
        if record.put_token:
            pending_frees = self._put_frees
        for position, executor_id in enumerate(record.executor_ids):
            pending = pending_frees[executor_id]
            pending.append((array_id, position))
            flush = flush or len(pending) >= _MAX_PENDING_FREES
        if record.put_token:   # whether or not its puts came (the client's word), its tokens are spent: sent now
            self._spend_put_tokens(record)
            flush = True
        if flush and not self._batching_frees:
            self._flush_frees()
        self._failures.output_forgotten(record.producer_call)

    def release_many(self, array_ids) -> None:
        """`release` several arrays, with one Free message per executor for all of them.

        Sent at once, on the calling thread: a Free must never overtake a Run this thread
        queued earlier that still reads the array (deferring the send could reorder them).
        """
        with self._lock:
            self._batching_frees = True
            try:
                for array_id in array_ids:
                    self.release(array_id)
            finally:
                self._batching_frees = False
                self._flush_frees()

    def flush_frees(self) -> None:
        """Send every pending free now (the client is idle, or closing)."""
        with self._lock:
            self._flush_frees()

    def _spend_put_tokens(self, record: ArrayRecord) -> None:
        role = owner_role(record.owner)
        for position, executor_id in enumerate(record.executor_ids):
            claim = put_token_claim(shard_put_token(record.put_token, position))
            if claim is not None:
                self._spent_puts[executor_id].append(pb.SpentPut(role=role, sequence=claim.sequence))

    def _flush_frees(self) -> None:
        pending, self._pending_frees = self._pending_frees, collections.defaultdict(list)
        spent, self._spent_puts = self._spent_puts, collections.defaultdict(list)
        put_frees, self._put_frees = self._put_frees, collections.defaultdict(list)
        for executor_id in {**pending, **spent, **put_frees}:
            if self.resources.executors[executor_id].lost:
                continue
            if executor_id in pending:
                self._send(executor_id, pb.Envelope(free=pb.Free(shards=shard_refs(pending[executor_id]))))
            if executor_id in spent or executor_id in put_frees:
                free = pb.Free(shards=shard_refs(put_frees.get(executor_id, ())), spent_puts=spent.get(executor_id, ()))
                self._send(executor_id, pb.Envelope(free=free))

    def take_pending_frees(self, executor_id: str) -> list | None:
        """The frees waiting for ``executor_id``, no longer pending (they ride on a message to it, or it is lost), as
        (array id, shard) pairs: `shard_refs` makes them messages."""
        return self._pending_frees.pop(executor_id, None)
