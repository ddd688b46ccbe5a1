"""bench/islands.py's reading of the executors' trace: the exchange wait of each step, the link transfers' times,
and how much of them their receiver spent computing (`pathways_torch.observe.span_math.transfer_overlap`, the
formula the step picture's ``hidden_share`` uses)."""

from __future__ import annotations

from pathways_torch.observe.span_math import complete_events, link_flows, transfer_overlap


def in_windows(t: float, windows: list[tuple[float, float]]) -> bool:
    return any(a <= t <= b for a, b in windows)


def exchange_steps(spans: list[tuple[int, str, float, float]], island_of, segments_per_step: int = 1) -> list[dict]:
    """Per step, from compute spans ``(executor, kind, start, end)`` (kind ``grads``, ``update`` or other
    compute) of the timed steps: on each executor, wait = its update's start - its grads' end of the same step
    (the step's grads are ``segments_per_step`` spans, the backward cut per bucket: the k-th group of them and the
    k-th update of each executor are step k; its grads end is the last one's end); skew = the last grads end of any island -
    this executor's grads end; after_last = update start - that last end; inside = compute that executor ran
    inside its wait. Each value the mean over executors (``max_wait``: the largest)."""
    by_executor: dict[int, dict[str, list]] = {}
    for executor, kind, start, end in spans:
        by_executor.setdefault(executor, {}).setdefault(kind, []).append((start, end))
    if not by_executor:
        return []
    for kinds in by_executor.values():
        for values in kinds.values():
            values.sort()
    per = segments_per_step
    counts = {e: (len(k.get("grads", [])), len(k.get("update", []))) for e, k in by_executor.items()}
    num_steps = min(c[1] for c in counts.values())
    if any(c != (num_steps * per, num_steps) for c in counts.values()):
        raise RuntimeError(f"exchange_steps: expected {per} grads spans per update span on every executor, got "
                           f"(grads, update) = {counts}")
    steps = []
    for k in range(num_steps):
        grads_end = {e: kinds["grads"][k * per + per - 1][1] for e, kinds in by_executor.items()}
        island_end: dict[int, float] = {}
        for e, end in grads_end.items():
            island_end[island_of(e)] = max(end, island_end.get(island_of(e), float("-inf")))
        last_end = max(island_end.values())
        waits, skews, after, inside = [], [], [], []
        for e, kinds in by_executor.items():
            begin, finish = grads_end[e], kinds["update"][k][0]
            if finish < begin:
                raise RuntimeError(f"exchange_steps: executor {e} step {k}: update starts before its grads end")
            waits.append(finish - begin)
            skews.append(max(0.0, last_end - begin))
            after.append(max(0.0, finish - last_end))
            inside.append(sum(max(0.0, min(end, finish) - max(start, begin))
                              for values in kinds.values() for start, end in values))
        n = len(waits)
        steps.append({"wait": sum(waits) / n, "max_wait": max(waits), "skew": sum(skews) / n,
                      "after_last": sum(after) / n, "compute_inside": sum(inside) / n})
    return steps


def link_transfer_times(events: list[dict], windows: list[tuple[float, float]]) -> list[float]:
    """Seconds from each link transfer's send (flow start, ``ph`` s) to its receipt (flow end, f), for the
    transfers sent inside ``windows`` (trace timestamps in microseconds)."""
    return [received["ts"] / 1e6 - sent["ts"] / 1e6 for sent, received in link_flows(events)
            if in_windows(sent["ts"] / 1e6, windows)]


def link_transfer_overlap(events: list[dict], windows: list[tuple[float, float]]) -> tuple[float, float]:
    """(seconds of link transfers during which their receiver was computing, seconds of link transfers), for the
    transfers sent inside ``windows``: a transfer costs the step nothing while the executor that waits for it
    still runs its own backward (the exchange hidden behind compute)."""
    compute = [(e["pid"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in complete_events(events)]
    transfers = [(received["pid"], sent["ts"] / 1e6, received["ts"] / 1e6) for sent, received in link_flows(events)
                 if in_windows(sent["ts"] / 1e6, windows)]
    return transfer_overlap(transfers, compute)


def classify(name: str) -> str:
    """A compute span's kind: the cross-island step's ``grads`` and ``update``, else ``other``."""
    if name.startswith("island_grads"):
        return "grads"
    if name == "island_update":
        return "update"
    return "other"
