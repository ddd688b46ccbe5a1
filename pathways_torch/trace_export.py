"""Executor trace events → one Chrome/Perfetto trace (``chrome://tracing``, ui.perfetto.dev)."""

from __future__ import annotations

__all__ = ["chrome_trace"]

_COMPUTE_TID, _IO_TID, _COMPILE_TID = 0, 1, 2
# Paired kinds that make complete spans: (start kind, end kind) → (category, thread).
_SPANS = {"start": ("end", "compute", _COMPUTE_TID), "compile_start": ("compile_end", "compile", _COMPILE_TID),
          "collective_start": ("collective_end", "collective", _COMPUTE_TID)}   # nested in its computation
_ENDS = {end: (start, cat, tid) for start, (end, cat, tid) in _SPANS.items()}


def chrome_trace(events_by_executor: dict, order: dict[str, int], backends: dict[str, str] | None = None,
                 client_waits: list | None = None) -> dict:
    """One process row per executor (named with its backend, e.g. ``executor-0 (xla:torchax)``): computations as
    complete events, messages as instants. ``client_waits``: (start ns, end ns, in flight, what) spans where
    the client waited at the run-ahead bound, on a ``client`` row after the executors'."""
    out = _client_rows(client_waits or [], pid=len(order) + 1)
    backends = backends or {}
    for executor_id, events in events_by_executor.items():
        pid = order.get(executor_id, len(order))
        label = f"{executor_id} ({backends[executor_id]})" if backends.get(executor_id) else executor_id
        out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": _COMPUTE_TID, "args": {"name": "compute"}})
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": _IO_TID, "args": {"name": "io"}})
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": _COMPILE_TID, "args": {"name": "compile"}})
        started = {}
        for e in events:
            args = {"seq": e.seq, "call_id": e.call_id, "function_id": e.function_id}
            if e.detail:
                args["detail"] = e.detail
            ts_us = e.time_ns / 1000.0
            if e.kind in _SPANS:
                started[(e.kind, e.name, e.call_id, e.seq)] = ts_us
            elif e.kind in _ENDS and (_ENDS[e.kind][0], e.name, e.call_id, e.seq) in started:
                start_kind, category, tid = _ENDS[e.kind]
                begin = started.pop((start_kind, e.name, e.call_id, e.seq))
                out.append({"ph": "X", "name": e.name or category, "cat": category, "pid": pid, "tid": tid,
                            "ts": begin, "dur": ts_us - begin, "args": args})
            else:
                out.append({"ph": "i", "s": "t", "name": f"{e.kind} {e.name}".strip(), "cat": e.kind, "pid": pid,
                            "tid": _IO_TID, "ts": ts_us, "args": args})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def _client_rows(waits: list, pid: int) -> list:
    if not waits:
        return []
    out = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": "client"}},
           {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "dispatch"}}]
    for start_ns, end_ns, in_flight, what in waits:
        out.append({"ph": "X", "name": f"run-ahead wait ({what})", "cat": "runahead", "pid": pid, "tid": 0,
                    "ts": start_ns / 1000.0, "dur": (end_ns - start_ns) / 1000.0, "args": {"in_flight": in_flight}})
    return out
