"""The table of arrays: where each array's shards live, its state, and who still holds it."""

from __future__ import annotations

import dataclasses
import threading

__all__ = ["ArrayRecord", "ArrayTable", "PENDING", "READY", "FAILED"]

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
    # Executors whose shard of it was lost: gone for good, even once a replacement takes the executor's place
    # (a call reading it there would wait forever), so the array may no longer be an input.
    lost_holders: set = dataclasses.field(default_factory=set)

    def settle(self, state: str, error: BaseException | None = None) -> None:
        if self.state != PENDING:
            return  # the earliest outcome is kept
        self.state, self.error = state, error
        self.event.set()

    def lose(self, executor_id: str, error: BaseException) -> None:
        """A shard's executor is gone: fail the array even if it was ready (an earlier failure stays), unless it is
        replicated and a replica is left."""
        self.lost_holders.add(executor_id)
        if self.state == READY and self.replicated and len(self.lost_holders) < len(set(self.executor_ids)):
            return    # a replica is left: the value stays readable from it (`live_position`)
        if self.state != FAILED:
            self.state, self.error = FAILED, error
            self.event.set()


class ArrayTable:
    """Array records by id. The controller holds its lock while using it."""

    def __init__(self):
        self._records: dict[int, ArrayRecord] = {}
        self._next_id = 1

    def new(self, executor_ids: tuple[str, ...], *, producer_call: int = 0, landing: int = 0) -> ArrayRecord:
        record = ArrayRecord(self._next_id, executor_ids, producer_call=producer_call, landing=landing)
        self._records[record.array_id] = record
        self._next_id += 1
        return record

    def reserve(self, count: int) -> int:
        """Skip ``count`` ids (a program run's intermediates); return the first."""
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
