"""Executor trace events → one Chrome/Perfetto trace (``chrome://tracing``, ui.perfetto.dev)."""

from __future__ import annotations

__all__ = ["chrome_trace"]

_COMPUTE_TID, _IO_TID, _COMPILE_TID, _SAVE_TID = 0, 1, 2, 3
# Paired kinds that make complete spans: (start kind, end kind) → (category, thread).
_SPANS = {"start": ("end", "compute", _COMPUTE_TID), "compile_start": ("compile_end", "compile", _COMPILE_TID),
          "collective_start": ("collective_end", "collective", _COMPUTE_TID),   # nested in its computation
          "save_start": ("save_end", "save", _SAVE_TID)}   # checkpoint shards written in the background
_ENDS = {end: (start, cat, tid) for start, (end, cat, tid) in _SPANS.items()}


def chrome_trace(events_by_executor: dict, order: dict[str, int], backends: dict[str, str] | None = None,
                 client_waits: list | None = None, islands: dict[str, str] | None = None,
                 address_owner: dict[str, str] | None = None) -> dict:
    """One process row per executor (named with its backend, e.g. ``executor-0 (xla:torchax)``): computations as
    complete events, messages as instants. ``client_waits``: (start ns, end ns, in flight, what) spans where
    the client waited at the run-ahead bound, on a ``client`` row after the executors'. With ``islands``
    (executor → island, more than one island) rows are named and grouped by island, and each transfer is a
    flow arrow from its send to its receive (``address_owner``: a data or link address → its executor),
    named "link transfer" where it crosses islands."""
    out = _client_rows(client_waits or [], pid=len(order) + 1)
    backends, islands = backends or {}, islands or {}
    several = len(set(islands.values())) > 1
    for executor_id, events in events_by_executor.items():
        pid = order.get(executor_id, len(order))
        label = f"{executor_id} ({backends[executor_id]})" if backends.get(executor_id) else executor_id
        if several:
            label = f"island {islands.get(executor_id, '?')} · {label}"
        out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": _COMPUTE_TID, "args": {"name": "compute"}})
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": _IO_TID, "args": {"name": "io"}})
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": _COMPILE_TID, "args": {"name": "compile"}})
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": _SAVE_TID, "args": {"name": "save"}})
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
    if several and address_owner:
        out += _transfer_flows(events_by_executor, order, islands, address_owner)
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def _transfer_flows(events_by_executor: dict, order: dict, islands: dict, address_owner: dict) -> list:
    """A flow arrow per transfer, from its "send transfer" instant to the receiver's "receive transfer"."""
    sends = {}
    for executor_id, events in events_by_executor.items():
        for e in events:
            if e.kind == "send" and e.name == "transfer" and " -> " in e.detail:
                array, address = e.detail.split(" -> ", 1)
                receiver = address_owner.get(address)
                if receiver is not None:
                    sends[(e.call_id, array, receiver)] = (executor_id, e.time_ns)
    flows, next_id = [], 1
    for receiver, events in events_by_executor.items():
        for e in events:
            if e.kind != "receive" or e.name != "transfer":
                continue
            sent = sends.pop((e.call_id, e.detail, receiver), None)
            if sent is None:
                continue
            sender, sent_ns = sent
            crossing = islands.get(sender) != islands.get(receiver)
            name, category = ("link transfer", "link") if crossing else ("transfer", "transfer")
            flows.append({"ph": "s", "id": next_id, "name": name, "cat": category, "pid": order.get(sender, 0),
                          "tid": _IO_TID, "ts": sent_ns / 1000.0})
            flows.append({"ph": "f", "bp": "e", "id": next_id, "name": name, "cat": category,
                          "pid": order.get(receiver, 0), "tid": _IO_TID, "ts": e.time_ns / 1000.0})
            next_id += 1
    return flows


def _client_rows(waits: list, pid: int) -> list:
    if not waits:
        return []
    out = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": "client"}},
           {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "dispatch"}}]
    for start_ns, end_ns, in_flight, what in waits:
        out.append({"ph": "X", "name": f"run-ahead wait ({what})", "cat": "runahead", "pid": pid, "tid": 0,
                    "ts": start_ns / 1000.0, "dur": (end_ns - start_ns) / 1000.0, "args": {"in_flight": in_flight}})
    return out
