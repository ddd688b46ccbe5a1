"""The rendezvous store: where an island's executors meet to form a process group, kept by the controller.

Gloo and NCCL need a key-value store to exchange addresses while a group forms. This
one lives in the controller and is reached only over each executor's CURVE connection
(identity ``<id>#store``), so it needs no shared disk and opens no port of its own
(no ``TCPStore`` listening on every interface). A group's keys sit under the prefix
its ``FormGroup`` names, ``group-G/epoch-E``: keyed by the group and an epoch so that
the same members can form a group again later. Only the group's members may read or
write under its prefix; a ``get`` of a key not yet set is answered when it is (the
executor waits at most its group timeout). Used on the controller's I/O thread;
`allow` from any thread.

Nothing stays: a group's keys go once it has formed (each member adds 1 to `FORMED_KEY` when its
group stands; the last one's add forgets the prefix), when a member is lost (`fail_member`), when the
controller abandons the group (`forget_groups`), or when a get under it waits past the group timeout
(`expire`, every second: that member's formation failed, so the group never forms).
"""

from __future__ import annotations

import collections
import threading
import time

from pathways_torch.wire import pb

__all__ = ["RendezvousStore", "FORMED_KEY"]

# Under a group's prefix: each member adds 1 once its group stands; at the group's size no member reads its keys again.
FORMED_KEY = "pathways-formed"

_MAX_WAITING = 4096          # parked gets, in all (an executor waits for a handful at a time)
_MAX_KEYS_PER_PREFIX = 4096


class RendezvousStore:
    """The groups' keys, open to their members; ``timeout_s``: the group timeout (a get parked longer fails)."""

    def __init__(self, timeout_s: float = 60.0, clock=time.monotonic):
        self._lock = threading.Lock()
        self.timeout_s, self._clock = timeout_s, clock
        self._members: dict[str, frozenset[str]] = {}             # prefix → who may use it
        self._values: dict[str, dict[str, bytes]] = collections.defaultdict(dict)
        # (prefix, key) → parked gets: (request id, reply, deadline)
        self._waiting: dict[tuple[str, str], list] = collections.defaultdict(list)
        self._num_waiting = 0
        self.requests_served = 0      # requests answered or parked: proof that groups met here (tests)
        self.groups_forgotten = 0     # formed, abandoned or failed, their keys gone

    def sizes(self) -> dict[str, int]:
        """What the store holds now: open groups, keys, parked gets (nothing, between formations)."""
        with self._lock:
            return {"groups": len(self._members), "keys": sum(len(v) for v in self._values.values()),
                    "waiting": self._num_waiting}

    def stored_bytes(self) -> int:
        """The bytes of the keys and values held now, prefixes included (none, between formations)."""
        with self._lock:
            return sum(len(prefix) + sum(len(k) + len(v) for k, v in values.items())
                       for prefix, values in self._values.items())

    def allow(self, prefix: str, members) -> None:
        """Open ``prefix`` to ``members`` (before their FormGroup is sent)."""
        with self._lock:
            self._members[prefix] = frozenset(members)

    def forget(self, prefix: str, why: str = "the group was abandoned") -> None:
        """Drop a formed (or abandoned) group's keys; a get still parked under it fails with ``why``."""
        with self._lock:
            self._forget([prefix], why)

    def forget_groups(self, group_ids, why: str = "the controller abandoned the group") -> None:
        """Drop the keys of groups ``group_ids`` (every epoch): the controller abandoned them."""
        ids = {f"group-{g}" for g in group_ids}
        with self._lock:
            self._forget([p for p in self._members if p.split("/", 1)[0] in ids], why)

    def fail_member(self, executor_id: str, why: str) -> None:
        """A member was lost: the gets parked under its groups' prefixes fail now (a rendezvous that waits for it
        would wait out the group timeout), and its groups' keys go."""
        with self._lock:
            self._forget([prefix for prefix, members in self._members.items() if executor_id in members],
                         f"member {executor_id} was lost: {why}")

    def expire(self) -> int:
        """Fail the gets parked longer than the group timeout (their executor gave up: its group cannot form)
        and forget their groups. Returns how many failed. On the I/O thread, every second."""
        now = self._clock()
        with self._lock:
            late = sorted({prefix for (prefix, _), parked in self._waiting.items()
                           if any(deadline <= now for _, _, deadline in parked)})
            before = self._num_waiting
            self._forget(late, f"no member answered within the group timeout ({self.timeout_s:g} s): the group "
                               f"did not form")
            return before - self._num_waiting

    def _forget(self, prefixes, why: str) -> None:
        """Under the lock: fail the gets parked under ``prefixes`` and drop their keys and members."""
        doomed = set(prefixes)
        if not doomed:
            return
        for (prefix, key), parked in list(self._waiting.items()):
            if prefix in doomed:
                del self._waiting[(prefix, key)]
                self._num_waiting -= len(parked)
                for request_id, reply, _ in parked:
                    reply(pb.StoreReply(request_id=request_id, error=why))
        for prefix in doomed:
            if self._members.pop(prefix, None) is not None:
                self.groups_forgotten += 1
            self._values.pop(prefix, None)

    def handle(self, executor_id: str, request: pb.StoreRequest, reply) -> None:
        """Answer ``request`` through ``reply(pb.StoreReply)`` now, or when the key it waits for is set."""
        with self._lock:
            self.requests_served += 1
            prefix, key = _split(request.key)
            if prefix is None or executor_id not in self._members.get(prefix, ()):
                reply(pb.StoreReply(request_id=request.request_id, error=(
                    f"{executor_id} may not use store key {request.key!r}: it is no member of that group")))
                return
            values = self._values[prefix]
            handler = getattr(self, f"_{request.op}", None)
            if handler is None:
                reply(pb.StoreReply(request_id=request.request_id, error=f"unknown store op {request.op!r}"))
                return
            handler(prefix, key, values, request, reply)

    # ------------------------------------------------------------ ops (under the lock)

    def _set(self, prefix, key, values, request, reply):
        if key not in values and len(values) >= _MAX_KEYS_PER_PREFIX:
            reply(pb.StoreReply(request_id=request.request_id, error=f"too many keys under {prefix!r}"))
            return
        values[key] = bytes(request.value)
        reply(pb.StoreReply(request_id=request.request_id, ok=True))
        self._wake(prefix, key, values)

    def _get(self, prefix, key, values, request, reply):
        if key in values:
            reply(pb.StoreReply(request_id=request.request_id, ok=True, value=values[key], found=True))
            return
        if self._num_waiting >= _MAX_WAITING:
            reply(pb.StoreReply(request_id=request.request_id, error="the store has too many waiting gets"))
            return
        self._waiting[(prefix, key)].append((request.request_id, reply, self._clock() + self.timeout_s))
        self._num_waiting += 1

    def _add(self, prefix, key, values, request, reply):
        number = int(values.get(key, b"0") or b"0") + request.amount
        values[key] = str(number).encode()
        reply(pb.StoreReply(request_id=request.request_id, ok=True, number=number))
        self._wake(prefix, key, values)
        if key == FORMED_KEY and number >= len(self._members.get(prefix, ())):
            self._forget([prefix], "the group has formed")   # every member stands: none reads its keys again

    def _check(self, prefix, key, values, request, reply):
        keys = [_split(k)[1] for k in request.keys]
        reply(pb.StoreReply(request_id=request.request_id, ok=True, found=all(k in values for k in keys)))

    def _delete(self, prefix, key, values, request, reply):
        found = values.pop(key, None) is not None
        reply(pb.StoreReply(request_id=request.request_id, ok=True, found=found))

    def _wake(self, prefix, key, values):
        for request_id, reply, _ in self._waiting.pop((prefix, key), ()):
            self._num_waiting -= 1
            reply(pb.StoreReply(request_id=request_id, ok=True, value=values[key], found=True))


def _split(full_key: str) -> tuple[str | None, str]:
    """("group-G/epoch-E", rest) of a key under a group's prefix, or (None, key)."""
    parts = full_key.split("/", 2)
    if len(parts) < 3 or not parts[0].startswith("group-") or not parts[1].startswith("epoch-"):
        return None, full_key
    return f"{parts[0]}/{parts[1]}", parts[2]
