"""A picture of one pipeline step from the executors' own timestamps: one row per executor, the bubble visible.

The spans come from the executors' trace (``ctx.trace``): every computation of the last
run of the step's program, named by its node. A node's call id is the run's base call id
plus its index in the program, and the program lists the schedule's computations first,
in the simulation's order — so each span is known as ``F``/``B`` of (chunk, microbatch), or
the update (``U``). `step_spans` returns them as data (tested as text), `draw` makes the
PNG with matplotlib (``pip install 'pathways-torch[plot]'``), `chrome_step` keeps the
step's part of the Chrome/Perfetto trace.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Span", "step_spans", "bubble_fraction", "draw", "chrome_step", "describe"]

_PREFIX = "pipeline_"


@dataclasses.dataclass(frozen=True)
class Span:
    row: str            # "rank 0 · data 1 (executor-2)"
    kind: str           # "F", "B" or "U" (tied gradients and the update)
    chunk: int
    microbatch: int     # -1 for "U"
    start_s: float      # from the step's first start
    end_s: float


def _last_run(trace: dict, num_nodes: int, rows: dict[str, str]) -> tuple[list, dict]:
    """The compute events of the last run of the step's program, and each trace pid's executor id."""
    names = {e["pid"]: e["args"]["name"].split(" ")[0] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "compute"
              and str(e.get("name", "")).startswith(_PREFIX) and names.get(e["pid"]) in rows]
    if not events:
        return [], names
    base = max(e["args"]["call_id"] for e in events) - (num_nodes - 1)
    return [e for e in events if e["args"]["call_id"] >= base], names


def step_spans(trace: dict, actions: list, num_nodes: int, rows: dict[str, str]) -> list[Span]:
    """The spans of the last run in ``trace``; ``actions[k]`` is program node k's schedule action (for
    k < len(actions)), ``rows`` maps an executor id to its row name."""
    events, names = _last_run(trace, num_nodes, rows)
    if not events:
        return []
    base = max(e["args"]["call_id"] for e in events) - (num_nodes - 1)
    origin = min(e["ts"] for e in events)
    spans = []
    for e in events:
        node = e["args"]["call_id"] - base
        if node < len(actions):
            action = actions[node]
            kind, chunk, microbatch = action.kind, action.chunk, action.microbatch
        else:
            kind, chunk, microbatch = "U", _chunk_of(e["name"]), -1
        start = (e["ts"] - origin) / 1e6
        spans.append(Span(rows[names[e["pid"]]], kind, chunk, microbatch, start, start + e["dur"] / 1e6))
    return sorted(spans, key=lambda s: (s.row, s.start_s))


def _chunk_of(name: str) -> int:
    return int(name[name.index("[") + 1:name.index("]")]) if "[" in name else -1


def bubble_fraction(spans: list[Span]) -> float:
    """Idle time of the forward/backward rows over the step (from the first start to the last end)."""
    compute = [s for s in spans if s.kind in ("F", "B")]
    if not compute:
        return 0.0
    rows = {s.row for s in compute}
    begin, end = min(s.start_s for s in compute), max(s.end_s for s in compute)
    busy = sum(s.end_s - s.start_s for s in compute)
    return 1.0 - busy / (len(rows) * (end - begin))


def describe(spans: list[Span]) -> str:
    """Each row's spans in order, as text: ``rank 0 · data 0 (executor-0): F0.0 F0.1 B0.0 … U0``."""
    rows: dict[str, list[str]] = {}
    for s in spans:
        label = f"U{s.chunk}" if s.kind == "U" else f"{s.kind}{s.chunk}.{s.microbatch}"
        rows.setdefault(s.row, []).append(label)
    return "\n".join(f"{row}: {' '.join(labels)}" for row, labels in rows.items())


def draw(spans: list[Span], path: str, title: str) -> str:
    """A PNG: forward and backward in two colours, microbatch numbers on the boxes, updates grey."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("trainer.timeline needs matplotlib: pip install 'pathways-torch[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted({s.row for s in spans})
    colours = {"F": "#4C72B0", "B": "#DD8452", "U": "#999999"}
    figure, axes = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.4))
    for s in spans:
        y = rows.index(s.row)
        axes.barh(y, s.end_s - s.start_s, left=s.start_s, height=0.8, color=colours[s.kind], edgecolor="white")
        if s.microbatch >= 0:
            axes.text((s.start_s + s.end_s) / 2, y, str(s.microbatch), ha="center", va="center", fontsize=7,
                      color="white")
    axes.set_yticks(range(len(rows)), rows)
    axes.invert_yaxis()
    axes.set_xlabel("seconds from the step's first computation")
    axes.set_title(title)
    handles = [matplotlib.patches.Patch(color=c, label=n) for n, c in
               (("forward", colours["F"]), ("backward", colours["B"]), ("update", colours["U"]))]
    axes.legend(handles=handles, loc="upper right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def chrome_step(trace: dict, num_nodes: int, rows: dict[str, str]) -> dict:
    """The Chrome/Perfetto trace cut to the last step's window (the row names kept)."""
    events, _ = _last_run(trace, num_nodes, rows)
    if not events:
        return trace
    begin, end = min(e["ts"] for e in events), max(e["ts"] + e["dur"] for e in events)
    kept = [e for e in trace["traceEvents"] if e.get("ph") == "M" or begin <= e.get("ts", begin) <= end]
    return {**trace, "traceEvents": kept}
