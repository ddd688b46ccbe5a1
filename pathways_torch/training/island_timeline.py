"""A picture of one step across islands from the executors' own timestamps: rows grouped by island, the backward's
segments one per gradient bucket, and each link transfer as an arrow from its send to its receipt.

The spans come from the executors' trace (``ctx.trace``, `trace_export`): on each executor the
last ``island_update`` and the gradient segments (``island_grads[k]``) of the same step just
before it; the link transfers are the trace's flows of category ``link`` sent during that
step. `step_picture` returns them as data, `describe` as text (tested), `hidden_share` says
how much of the transfers' time their receiver spent computing, `draw` makes the PNG with
matplotlib (``pip install 'pathways-torch[plot]'``).
"""

from __future__ import annotations

import dataclasses

__all__ = ["Span", "Flow", "step_picture", "chrome_step", "describe", "hidden_share", "draw"]

_SEGMENT, _UPDATE = "island_grads[", "island_update"


@dataclasses.dataclass(frozen=True)
class Span:
    row: str            # "island 0 · executor-0 (xla:torchax)"
    kind: str           # "G" (a gradient segment) or "U" (the update)
    segment: int        # the segment's index; -1 for "U"
    start_s: float      # from the step's first start
    end_s: float


@dataclasses.dataclass(frozen=True)
class Flow:
    sender: str
    receiver: str
    sent_s: float
    received_s: float


def _rows(trace: dict) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
            if e.get("ph") == "M" and e.get("name") == "process_name"}


def _last_step(trace: dict, segments_per_step: int) -> list[tuple[int, dict]]:
    """(pid, compute event) of the last step: each executor's last update and the segments just before it."""
    compute = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "compute"]
    chosen = []
    for pid in sorted({e["pid"] for e in compute}):
        mine = sorted((e for e in compute if e["pid"] == pid), key=lambda e: e["ts"])
        updates = [i for i, e in enumerate(mine) if e["name"] == _UPDATE]
        if not updates:
            continue
        last = updates[-1]
        segments = [e for e in mine[:last] if e["name"].startswith(_SEGMENT)][-segments_per_step:]
        chosen += [(pid, e) for e in segments] + [(pid, mine[last])]
    return chosen


def chrome_step(trace: dict, segments_per_step: int) -> dict:
    """The Chrome/Perfetto trace cut to the last step's window (the row names kept)."""
    chosen = _last_step(trace, segments_per_step)
    if not chosen:
        return trace
    begin, end = min(e["ts"] for _, e in chosen), max(e["ts"] + e["dur"] for _, e in chosen)
    kept = [e for e in trace["traceEvents"] if e.get("ph") == "M" or begin <= e.get("ts", begin) <= end]
    return {**trace, "traceEvents": kept}


def step_picture(trace: dict, segments_per_step: int) -> tuple[list[Span], list[Flow]]:
    """The last step's spans and link flows (times from the step's first computation)."""
    rows = _rows(trace)
    chosen = _last_step(trace, segments_per_step)
    if not chosen:
        return [], []
    origin = min(e["ts"] for _, e in chosen)
    end = max(e["ts"] + e["dur"] for _, e in chosen)
    spans = []
    for pid, e in chosen:
        start = (e["ts"] - origin) / 1e6
        kind, index = ("U", -1) if e["name"] == _UPDATE else ("G", int(e["name"][len(_SEGMENT):-1]))
        spans.append(Span(rows.get(pid, str(pid)), kind, index, start, start + e["dur"] / 1e6))
    starts, ends = {}, {}
    for e in trace["traceEvents"]:
        if e.get("cat") == "link" and e.get("ph") in ("s", "f"):
            (starts if e["ph"] == "s" else ends)[e["id"]] = e
    flows = [Flow(rows.get(s["pid"], str(s["pid"])), rows.get(ends[i]["pid"], str(ends[i]["pid"])),
                  (s["ts"] - origin) / 1e6, (ends[i]["ts"] - origin) / 1e6)
             for i, s in starts.items() if i in ends and origin <= s["ts"] <= end]
    return (sorted(spans, key=lambda s: (s.row, s.start_s)),
            sorted(flows, key=lambda f: (f.sent_s, f.sender)))


def describe(spans: list[Span], flows: list[Flow]) -> str:
    """Each row's spans in order, then the transfers: ``island 0 · executor-0: G0 G1 U`` / ``0 -> 1 (2 transfers)``."""
    rows: dict[str, list[str]] = {}
    for s in spans:
        rows.setdefault(s.row, []).append("U" if s.kind == "U" else f"G{s.segment}")
    lines = [f"{row}: {' '.join(labels)}" for row, labels in rows.items()]
    pairs: dict[tuple[str, str], int] = {}
    for f in flows:
        pairs[(f.sender, f.receiver)] = pairs.get((f.sender, f.receiver), 0) + 1
    lines += [f"{a} -> {b}: {n} link transfer(s)" for (a, b), n in sorted(pairs.items())]
    return "\n".join(lines)


def hidden_share(spans: list[Span], flows: list[Flow]) -> float:
    """The share of the link transfers' time during which their receiver was running a gradient segment."""
    total = sum(f.received_s - f.sent_s for f in flows)
    if total <= 0:
        return 0.0
    hidden = sum(max(0.0, min(s.end_s, f.received_s) - max(s.start_s, f.sent_s))
                 for f in flows for s in spans if s.row == f.receiver and s.kind == "G")
    return hidden / total


def draw(spans: list[Span], flows: list[Flow], path: str, title: str) -> str:
    """A PNG: gradient segments in shades of one colour (numbered), updates grey, link transfers as arrows."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("trainer.timeline needs matplotlib: pip install 'pathways-torch[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted({s.row for s in spans})
    figure, axes = plt.subplots(figsize=(12, 0.7 * len(rows) + 2.0))
    for s in spans:
        y = rows.index(s.row)
        colour = "#999999" if s.kind == "U" else ("#DD8452" if s.segment % 2 else "#C44E52")
        axes.barh(y, s.end_s - s.start_s, left=s.start_s, height=0.6, color=colour, edgecolor="white")
        if s.kind == "G":
            axes.text((s.start_s + s.end_s) / 2, y, str(s.segment), ha="center", va="center", fontsize=7,
                      color="white")
    for f in flows:
        if f.sender in rows and f.receiver in rows:
            axes.annotate("", xy=(f.received_s, rows.index(f.receiver)), xytext=(f.sent_s, rows.index(f.sender)),
                          arrowprops={"arrowstyle": "->", "color": "#4C72B0", "lw": 1.2})
    axes.set_yticks(range(len(rows)), rows)
    axes.invert_yaxis()
    axes.set_xlabel("seconds from the step's first computation")
    axes.set_title(title)
    handles = [matplotlib.patches.Patch(color=c, label=n) for n, c in
               (("gradient segment (one per bucket)", "#C44E52"), ("update", "#999999"),
                ("link transfer (send -> receipt)", "#4C72B0"))]
    axes.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
