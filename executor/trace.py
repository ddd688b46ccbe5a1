"""Trace events of one executor, kept in a bounded ring for `ctx.trace()`."""

from __future__ import annotations

import collections
import time

__all__ = ["TraceRecorder"]


class TraceRecorder:
    """Records (kind, name, time_ns, seq, call_id, function_id, detail) tuples."""

    def __init__(self, max_events: int = 200_000, clock=time.time_ns):
        self._events: collections.deque = collections.deque(maxlen=max_events)
        self._clock = clock

    def record(self, kind: str, name: str = "", *, seq: int = 0, call_id: int = 0,
               function_id: int = 0, detail: str = "") -> None:
        self._events.append((kind, name, self._clock(), seq, call_id, function_id, detail))

    def fill(self, reply) -> None:
        """Append every event to a `pb.TraceReply`."""
        for kind, name, t, seq, call_id, function_id, detail in list(self._events):
            reply.events.add(kind=kind, name=name, time_ns=t, seq=seq, call_id=call_id,
                             function_id=function_id, detail=detail)

    def __len__(self) -> int:
        return len(self._events)
