"""The arithmetic on a trace's spans, written once for the step pictures (`timeline`) and the benchmarks (bench/).

Every function takes plain values, so that a picture's spans, a benchmark's trace events and a test's made-up
numbers go through the same formula:

- a span is ``(row, start, end)``: ``row`` anything hashable (a row name, a trace pid, a pipe rank), ``start``
  and ``end`` in one unit (seconds or the trace's microseconds: the results are in that unit, or ratios);
- a transfer is ``(receiver, sent, received)``, the receiver a row of the spans it is compared with;
- a window is ``(start, end)``.

The two readers of raw Chrome trace events (`complete_events`, `link_flows`) are here too: the rest of the trace
is read by `timeline`, which knows the step's names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Sequence

__all__ = ["Occupancy", "occupancy", "transfer_overlap", "WindowBusy", "busy_in_windows", "complete_events",
           "link_flows"]

_Span = tuple[Hashable, float, float]


@dataclasses.dataclass(frozen=True)
class Occupancy:
    """How full the rows were between the first start and the last end (a pipeline's bubble)."""

    busy: float        # time inside spans, summed over the rows
    makespan: float    # the first start to the last end on any row
    bubble: float      # 1 - busy / (rows x makespan): the share of the rows' time spent idle


def occupancy(spans: Sequence[_Span], num_rows: int | None = None) -> Occupancy:
    """Busy time, makespan and bubble = 1 - busy / (num_rows x makespan) of ``spans``. ``num_rows`` defaults to
    the rows the spans name; pass it when a row may have run nothing (it was idle the whole makespan)."""
    if not spans:
        raise ValueError("occupancy: expected at least one span (row, start, end), got none")
    rows = len({row for row, _, _ in spans}) if num_rows is None else num_rows
    begin, end = min(s for _, s, _ in spans), max(e for _, _, e in spans)
    busy = sum(e - s for _, s, e in spans)
    makespan = end - begin
    return Occupancy(busy=busy, makespan=makespan,
                     bubble=1.0 - busy / (rows * makespan) if makespan > 0 else 0.0)


def transfer_overlap(transfers: Iterable[tuple[Hashable, float, float]],
                     spans: Iterable[_Span]) -> tuple[float, float]:
    """(time of the transfers during which their receiver was inside one of its spans, time of the transfers):
    a transfer costs a step nothing while the row that waits for it is still computing."""
    by_row: dict[Hashable, list[tuple[float, float]]] = {}
    for row, start, end in spans:
        by_row.setdefault(row, []).append((start, end))
    hidden = total = 0.0
    for receiver, sent, received in transfers:
        total += received - sent
        # Summed per transfer, then added: the benchmarks' figures have always been rounded this way.
        hidden += sum(max(0.0, min(b, received) - max(a, sent)) for a, b in by_row.get(receiver, []))
    return hidden, total


@dataclasses.dataclass(frozen=True)
class WindowBusy:
    """One row's time inside its spans during the windows."""

    busy_fraction: float                 # its spans' overlap with the windows / the windows' length
    durations_started_inside: tuple[float, ...]   # the lengths of its spans that started inside a window


def busy_in_windows(spans: Iterable[_Span], windows: Sequence[tuple[float, float]]) -> dict:
    """Per row of ``spans`` (sorted): how much of the ``windows`` (disjoint) it spent inside its spans, and which
    of its spans started inside a window (``start <= t < end``)."""
    total = sum(b - a for a, b in windows)
    busy: dict[Hashable, float] = {}
    started: dict[Hashable, list[float]] = {}
    for row, start, end in spans:
        busy.setdefault(row, 0.0)
        started.setdefault(row, [])
        for a, b in windows:
            busy[row] += max(0.0, min(end, b) - max(start, a))
        if any(a <= start < b for a, b in windows):
            started[row].append(end - start)
    return {row: WindowBusy(busy_fraction=busy[row] / total if total else 0.0,
                            durations_started_inside=tuple(started[row])) for row in sorted(busy)}


def complete_events(events: Iterable[dict], *categories: str) -> list[dict]:
    """The trace's complete events (``ph`` X: a span with a duration) of ``categories`` (default ``compute``)."""
    wanted = categories or ("compute",)
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in wanted]


def link_flows(events: Iterable[dict]) -> list[tuple[dict, dict]]:
    """(send event, receipt event) of each link transfer: the flows of category ``link``, a start (``ph`` s) paired
    with the end (f) of the same id, in the order the transfers were sent; a transfer not yet received is left
    out."""
    starts, ends = {}, {}
    for e in events:
        if e.get("cat") == "link" and e.get("ph") in ("s", "f"):
            (starts if e["ph"] == "s" else ends)[e["id"]] = e
    return [(s, ends[i]) for i, s in starts.items() if i in ends]
