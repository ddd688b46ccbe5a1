"""Requests to every executor at once (stats, traces), and the gathering of their replies."""

from __future__ import annotations

import itertools
import threading

from pathways_torch.errors import ExecutorLostError
from pathways_torch.wire import pb

__all__ = ["ExecutorRequests"]


class ExecutorRequests:
    """The `Controller`'s requests to its executors: `gather` waits on a client thread, `on_reply` (under the
    controller's lock, on the I/O thread) collects."""

    def __init__(self, state):
        self._state = state
        self._lock, self.resources, self._send = state.lock, state.resources, state.send
        self._next_request_id = itertools.count(1)
        self._replies: dict[int, dict[str, pb.Envelope]] = {}
        self._reply_events: dict[int, threading.Event] = {}
        self._expected: dict[int, int] = {}

    def gather(self, kind: str, timeout_s: float | None = None) -> dict[str, pb.Envelope]:
        """Send a stats or trace request to every live executor; wait for every reply."""
        timeout_s = timeout_s or self._state.config.request_timeout_s
        with self._lock:
            request_id = next(self._next_request_id)
            targets = [e.executor_id for e in self.resources.ordered() if not e.lost]
            self._replies[request_id], self._reply_events[request_id] = {}, threading.Event()
            self._expected[request_id] = len(targets)
            for executor_id in targets:
                if kind == "stats":
                    envelope = pb.Envelope(stats_request=pb.StatsRequest(request_id=request_id))
                else:
                    envelope = pb.Envelope(trace_request=pb.TraceRequest(request_id=request_id))
                self._send(executor_id, envelope)
            if not targets:
                self._reply_events[request_id].set()
        finished = self._reply_events[request_id].wait(timeout_s)
        with self._lock:
            replies = self._replies.pop(request_id)
            del self._reply_events[request_id], self._expected[request_id]
        if not finished:
            missing = sorted(set(targets) - set(replies))
            raise ExecutorLostError(f"no {kind} reply from {missing} within {timeout_s:.0f} s",
                                    executor_id=missing[0] if missing else "")
        return replies

    def on_reply(self, executor_id: str, request_id: int, envelope: pb.Envelope) -> None:
        replies = self._replies.get(request_id)
        if replies is None:
            return
        replies[executor_id] = envelope
        if len(replies) >= self._expected[request_id]:
            self._reply_events[request_id].set()
