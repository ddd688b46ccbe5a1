"""The object store: buffers by id, reference counts and byte accounting.

A key is ``(array_id, shard, tag)``: tag 0 is the array's own shard, a non-zero
tag is a transient copy made for the call with that id. An entry lives while it
is *owned* (the controller has not freed it) or *pinned* (a queued computation,
a pending send or a pending fetch still needs it); it may exist before its bytes
do (a placeholder), and callbacks wait for it to become ready.

An entry no longer owned and pinned by one computation alone is *handed over* to it when it starts
(`hand_over`): the store lets go of the buffer, so the computation frees it at its last use (XLA's buffer
donation, torch's boxed calls) instead of holding two copies of a training step's state. Nobody else can
want it: only the controller names arrays to new readers, and it names no freed array. A call that
*donates* an input frees it on arrival (`Run.donated_inputs`), so the hand-over does not wait on a Free.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["ObjectStore", "Entry", "Key"]

Key = tuple  # (array_id, shard, tag)


class Entry:
    __slots__ = ("value", "failure", "owned", "pins", "waiters", "nbytes", "computing", "owner", "handed", "freed",
                 "budget")

    def __init__(self):
        self.value = None
        self.failure = None       # a pb.RemoteFailure when the producer failed
        self.owned = False
        self.pins = 0
        self.waiters: list[Callable[["Entry"], None]] = []
        self.nbytes = 0
        # Local chaining: the producing job is queued on this executor's compute thread, which
        # finishes (stores) each job before it starts the next, so a consumer may be queued
        # right behind it.
        self.computing = False
        # The role of the client it belongs to, as the controller announced it (a Run's or a program run's owner,
        # a put's checked token); "" when none was (the embedded client's): see executor/data_roles.py. It lives
        # and dies with the entry.
        self.owner = ""
        self.handed = False       # its value went to the computation that read it last (`ObjectStore.hand_over`)
        # The controller freed it (or a run it was donated to arrived): bytes that arrive later do not own it again.
        self.freed = False
        # A run's output under the controller's memory limit: the bytes counted for it there, which its value may
        # not exceed (`executor.output_budget`); None: not checked (no limit, or not a run's output).
        self.budget: int | None = None

    @property
    def ready(self) -> bool:
        return self.value is not None or self.failure is not None


class ObjectStore:
    """Buffers of one executor, with the bytes they hold counted."""

    def __init__(self):
        self._entries: dict[Key, Entry] = {}
        # Array id → its shards here (untagged: not a run's copy), so that a launch tree's frees can name arrays alone
        # (`free_array`).
        self._shards: dict[int, set[int]] = {}
        self._held = 0              # bytes of the values stored (I/O thread, under the core's lock)
        self._handed = 0            # of those, bytes handed over to computations (the compute thread's alone)
        self.bytes_high_water = 0   # the most bytes held at once since `take_high_water` last ran
        self.handed_over = 0        # inputs handed over to their computation (`hand_over`)

    @property
    def bytes(self) -> int:
        """The bytes the store holds: a value handed over to its computation (`hand_over`) is that computation's.
        Two counters, each written by one thread, so that neither update can lose the other's."""
        return self._held - self._handed

    def take_high_water(self) -> int:
        """The peak bytes held since the last call; the next period starts from what is held now."""
        peak, self.bytes_high_water = self.bytes_high_water, self.bytes
        return peak

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def get(self, key: Key) -> Entry | None:
        return self._entries.get(key)

    def claim(self, key: Key, *, owned: bool = False, pin: bool = False) -> Entry:
        """Return the entry for ``key``, creating a placeholder; optionally own or pin it."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = Entry()
            if not key[2]:
                self._shards.setdefault(key[0], set()).add(key[1])
        if owned and not entry.freed:
            entry.owned = True
        if pin:
            entry.pins += 1
        return entry

    def fill(self, key: Key, value=None, failure=None, *, owned: bool = True) -> None:
        """Give ``key`` its bytes (or its failure) and wake whoever waits for it.

        ``owned=True`` makes the store own the buffer (a put or a transfer arriving);
        ``owned=False`` leaves ownership as claimed before (a computation's output).
        """
        entry = self.claim(key, owned=owned)
        if entry.ready:
            return  # a duplicate delivery; the first one wins
        if failure is not None:
            entry.failure = failure
        else:
            entry.value = value
            entry.nbytes = value.nbytes  # torch tensors, jax arrays and sim values all have it
            self._held += entry.nbytes
            if self.bytes > self.bytes_high_water:
                self.bytes_high_water = self.bytes
        waiters, entry.waiters = entry.waiters, []
        for waiter in waiters:
            waiter(entry)
        self._collect(key, entry)

    def when_ready(self, key: Key, callback: Callable[[Entry], None]) -> None:
        """Call ``callback(entry)`` once ``key`` is ready (now, if it is). The caller pins it."""
        entry = self.claim(key)
        if entry.ready:
            callback(entry)
        else:
            entry.waiters.append(callback)

    def unpin(self, key: Key) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.pins = max(0, entry.pins - 1)
        self._collect(key, entry)

    def hand_over(self, entry: Entry, failure) -> object:
        """The value of a computation's input, handed over when the store no longer needs it: an entry not
        owned and pinned by this computation alone then holds ``failure`` (what a late reader gets) instead
        of the value, and its bytes leave the store's count at once. Called on the compute thread without
        the lock: an entry in that state is never pinned again (only the controller names new readers)."""
        value = entry.value
        if value is not None and not entry.owned and entry.pins == 1:
            entry.failure = failure   # first: a reader in between sees one or the other, never neither
            entry.value = None
            self._handed += entry.nbytes   # both counters keep it: collecting it leaves _held as it is
            entry.handed = True
            self.handed_over += 1
        return entry.failure if value is None else value

    def give_up(self, key: Key, failure) -> None:
        """Nothing will ever fill ``key`` (a put its client abandoned: it left, or said the shard landed without
        putting it): whoever waits for it gets ``failure`` now instead of waiting for good."""
        entry = self._entries.get(key)
        if entry is not None and not entry.ready and not entry.computing:
            self.fill(key, failure=failure)

    def free(self, key: Key) -> None:
        """The controller dropped ``key``: delete it once nothing pins it."""
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.owned, entry.freed = False, True
        self._collect(key, entry)

    def free_array(self, array_id: int) -> None:
        """The controller dropped array ``array_id``: `free` each of its shards held here (not a run's copies)."""
        for shard in list(self._shards.get(array_id, ())):
            self.free((array_id, shard, 0))

    def abandon(self, key: Key) -> None:
        """Forget ``key`` whether or not it was filled: a copy whose run was cancelled (nothing pins it any more;
        should it still arrive, it is refused as late)."""
        entry = self._entries.get(key)
        if entry is None or entry.pins:
            return
        self._delete(key, entry)

    def _collect(self, key: Key, entry: Entry) -> None:
        # A waiter may already have released (and deleted) the entry it was woken for.
        if entry.owned or entry.pins or not entry.ready or self._entries.get(key) is not entry:
            return
        self._delete(key, entry)

    def _delete(self, key: Key, entry: Entry) -> None:
        del self._entries[key]
        if not key[2]:
            shards = self._shards.get(key[0])
            if shards is not None:
                shards.discard(key[1])
                if not shards:
                    del self._shards[key[0]]
        self._release_bytes(entry)

    def _release_bytes(self, entry: Entry) -> None:
        if not entry.handed:   # a handed-over value left the count when it was handed over
            self._held -= entry.nbytes
