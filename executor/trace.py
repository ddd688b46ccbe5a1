"""Trace events of one executor, kept in a bounded ring for `ctx.trace()`."""

from __future__ import annotations

import collections
import time

__all__ = ["TraceRecorder"]

_STEPS = object()   # marks an entry that stands for one event per step of a segment


class TraceRecorder:
    """Records (kind, name, time_ns, seq, call_id, function_id, detail) tuples; a segment's steps as one entry."""

    def __init__(self, max_events: int = 200_000, clock=time.time_ns):
        self._events: collections.deque = collections.deque(maxlen=max_events)
        self._clock = clock

    def record(self, kind: str, name: str = "", *, seq: int = 0, call_id: int = 0,
               function_id: int = 0, detail: str = "") -> None:
        self._events.append((kind, name, self._clock(), seq, call_id, function_id, detail))

    def record_steps(self, kind: str, steps: tuple, base_seq: int, base_call_id: int, name_of) -> None:
        """An event per step of a segment (``steps``: (offset from the bases, function id) of each, the function
        named by ``name_of(function_id)``), kept as one entry and written out when the trace is read: a run of a
        128-node program recorded 128 events as it was queued, each a clock read and a tuple, about a tenth of a
        simulated executor's time per run. Not the `Step` objects: their resolved process groups would stay alive
        with the ring (an abandoned gloo group's threads, 200,000 entries long)."""
        self._events.append((_STEPS, kind, self._clock(), steps, base_seq, base_call_id, name_of))

    def fill(self, reply) -> None:
        """Append every event to a `pb.TraceReply`."""
        for event in list(self._events):
            if event[0] is _STEPS:
                _, kind, t, steps, base_seq, base_call_id, name_of = event
                for offset, function_id in steps:
                    reply.events.add(kind=kind, name=name_of(function_id) or "run", time_ns=t, seq=base_seq + offset,
                                     call_id=base_call_id + offset, function_id=function_id)
                continue
            kind, name, t, seq, call_id, function_id, detail = event
            reply.events.add(kind=kind, name=name, time_ns=t, seq=seq, call_id=call_id,
                             function_id=function_id, detail=detail)

    def __len__(self) -> int:
        return len(self._events)
