"""One sequencer per island: its sequence numbers and the gang order of its executors' collective actions.

Every computation gets its island's next sequence number, and each collective action
(a computation with collectives, a group formation) names the previous one on the same
executor, so every executor of an island runs the island's collective work in one order
(docs/programs.md, "Gang scheduling"). Islands never share a process group, so their
orders are independent: each has its own `Sequencer`, with its own lock. A call takes the
sequencers of its mesh's islands (in name order) before the controller's lock, so a held
or busy island never delays another island's dispatch.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Iterable

__all__ = ["Sequencer", "Sequencers"]


class Sequencer:
    """An island's sequence numbers and, per executor, the last collective action sequenced there."""

    def __init__(self, island: str):
        self.island = island
        self.lock = threading.RLock()
        self._last_seq = 0
        self.last_collective: dict[str, int] = collections.defaultdict(int)   # executor → seq

    def take(self, count: int) -> int:
        """Reserve ``count`` consecutive sequence numbers; return the first (the caller holds ``lock``)."""
        first = self._last_seq + 1
        self._last_seq += count
        return first

    def chain(self, executor_id: str, seq: int) -> int:
        """Make ``seq`` the executor's latest collective action; return the one it follows."""
        previous = self.last_collective[executor_id]
        self.last_collective[executor_id] = seq
        return previous

    @contextlib.contextmanager
    def held(self):
        """Nothing is sequenced on this island meanwhile (tests; a recovery resetting its order)."""
        with self.lock:
            yield self


class Sequencers:
    """The sequencer of every island, made on first use."""

    def __init__(self):
        self._by_island: dict[str, Sequencer] = {}
        self._guard = threading.Lock()

    def of(self, island: str) -> Sequencer:
        sequencer = self._by_island.get(island)
        if sequencer is None:
            with self._guard:
                sequencer = self._by_island.setdefault(island, Sequencer(island))
        return sequencer

    @contextlib.contextmanager
    def taking(self, islands: Iterable[str]):
        """Hold the sequencers of ``islands`` (in name order: two calls never wait on each other in a cycle)."""
        with contextlib.ExitStack() as stack:
            for island in sorted(set(islands)):
                stack.enter_context(self.of(island).lock)
            yield
