"""A picture of one training step from the executors' own timestamps: spans on rows, as data, text, PNG and trace.

The spans come from the executors' Chrome trace (``ctx.trace``, `chrome_trace`). Two kinds
of step are read from it:

- a pipeline step (`pipeline_spans`): every computation of the last run of the step's
  program, named by its node. A node's call id is the run's base call id plus its index in
  the program, and the program lists the schedule's computations first, in the simulation's
  order, so each span is known as ``F``/``B`` of (chunk, microbatch), or the update (``U``);
  one row per executor, the bubble visible (`bubble_fraction`);
- a step across islands (`island_picture`): on each executor the last ``island_update`` and
  the gradient segments (``island_grads[k]``) of the same step just before it, rows grouped
  by island; the link transfers are the trace's flows of category ``link`` sent during that
  step, and `hidden_share` says how much of their time their receiver spent computing.

For either, `describe` prints the spans (and flows) as text (tested), ``*_chrome_step`` keeps
the step's part of the Chrome/Perfetto trace and ``draw_*`` makes the PNG with matplotlib
(``pip install 'pathways-torch[plot]'``).
"""

from __future__ import annotations

import dataclasses

from .span_math import complete_events, link_flows, occupancy, transfer_overlap

__all__ = ["Span", "Flow", "describe", "pipeline_spans", "pipeline_chrome_step", "bubble_fraction", "draw_pipeline",
           "island_picture", "island_chrome_step", "hidden_share", "draw_islands"]

_PIPELINE_PREFIX = "pipeline_"
_SEGMENT, _UPDATE = "island_grads[", "island_update"


@dataclasses.dataclass(frozen=True)
class Span:
    """One computation of the step on one row (times from the step's first start)."""

    row: str            # "rank 0 · data 1 (executor-2)", "island 0 · executor-0 (xla:torchax)"
    kind: str           # "F", "B" (a chunk's forward, backward), "G" (a gradient segment) or "U" (the update)
    index: int          # the chunk (F, B and a pipeline's U) or the segment (G); -1 for an island's U
    microbatch: int     # F and B only; -1 otherwise
    start_s: float
    end_s: float

    @property
    def label(self) -> str:
        """``F0.3``, ``B1.2`` (chunk.microbatch), ``G2`` (segment), ``U1`` (chunk) or ``U``."""
        if self.kind in ("F", "B"):
            return f"{self.kind}{self.index}.{self.microbatch}"
        if self.kind == "U" and self.index < 0:
            return "U"
        return f"{self.kind}{self.index}"


@dataclasses.dataclass(frozen=True)
class Flow:
    """One link transfer, from its send to its receipt (times from the step's first start)."""

    sender: str
    receiver: str
    sent_s: float
    received_s: float


def describe(spans: list[Span], flows: list[Flow] = ()) -> str:
    """Each row's spans in order, as text, then the transfers between each pair of rows:
    ``rank 0 · data 0 (executor-0): F0.0 F0.1 B0.0 … U0``, ``island 0 · executor-0: G0 G1 U``,
    ``island 0 · executor-0 -> island 1 · executor-1: 2 link transfer(s)``."""
    rows: dict[str, list[str]] = {}
    for s in spans:
        rows.setdefault(s.row, []).append(s.label)
    lines = [f"{row}: {' '.join(labels)}" for row, labels in rows.items()]
    pairs: dict[tuple[str, str], int] = {}
    for f in flows:
        pairs[(f.sender, f.receiver)] = pairs.get((f.sender, f.receiver), 0) + 1
    lines += [f"{a} -> {b}: {n} link transfer(s)" for (a, b), n in sorted(pairs.items())]
    return "\n".join(lines)


# ---------------------------------------------------------------- reading the trace


def _process_names(trace: dict) -> dict[int, str]:
    """Each trace pid's row name."""
    return {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
            if e.get("ph") == "M" and e.get("name") == "process_name"}


def _cut_to(trace: dict, events: list[dict]) -> dict:
    """``trace`` cut to the window of ``events`` (the row names kept); all of it when there are none."""
    if not events:
        return trace
    begin, end = min(e["ts"] for e in events), max(e["ts"] + e["dur"] for e in events)
    kept = [e for e in trace["traceEvents"] if e.get("ph") == "M" or begin <= e.get("ts", begin) <= end]
    return {**trace, "traceEvents": kept}


# ---------------------------------------------------------------- a pipeline step


def _last_run(trace: dict, num_nodes: int, rows: dict[str, str]) -> tuple[list, dict]:
    """The compute events of the last run of the step's program, and each trace pid's executor id."""
    names = {pid: name.split(" ")[0] for pid, name in _process_names(trace).items()}
    events = [e for e in complete_events(trace["traceEvents"])
              if str(e.get("name", "")).startswith(_PIPELINE_PREFIX) and names.get(e["pid"]) in rows]
    if not events:
        return [], names
    base = max(e["args"]["call_id"] for e in events) - (num_nodes - 1)
    return [e for e in events if e["args"]["call_id"] >= base], names


def pipeline_spans(trace: dict, actions: list, num_nodes: int, rows: dict[str, str]) -> list[Span]:
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


def pipeline_chrome_step(trace: dict, num_nodes: int, rows: dict[str, str]) -> dict:
    """The Chrome/Perfetto trace cut to the last pipeline step's window (the row names kept)."""
    return _cut_to(trace, _last_run(trace, num_nodes, rows)[0])


def bubble_fraction(spans: list[Span]) -> float:
    """Idle time of the forward/backward rows over the step (from the first start to the last end)."""
    compute = [(s.row, s.start_s, s.end_s) for s in spans if s.kind in ("F", "B")]
    return occupancy(compute).bubble if compute else 0.0


# ---------------------------------------------------------------- a step across islands


def _last_step(trace: dict, segments_per_step: int) -> list[tuple[int, dict]]:
    """(pid, compute event) of the last step: each executor's last update and the segments just before it."""
    compute = complete_events(trace["traceEvents"])
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


def island_chrome_step(trace: dict, segments_per_step: int) -> dict:
    """The Chrome/Perfetto trace cut to the last step's window across islands (the row names kept)."""
    return _cut_to(trace, [e for _, e in _last_step(trace, segments_per_step)])


def island_picture(trace: dict, segments_per_step: int) -> tuple[list[Span], list[Flow]]:
    """The last step's spans and link flows across islands (times from the step's first computation)."""
    rows = _process_names(trace)
    chosen = _last_step(trace, segments_per_step)
    if not chosen:
        return [], []
    origin = min(e["ts"] for _, e in chosen)
    end = max(e["ts"] + e["dur"] for _, e in chosen)
    spans = []
    for pid, e in chosen:
        start = (e["ts"] - origin) / 1e6
        kind, index = ("U", -1) if e["name"] == _UPDATE else ("G", int(e["name"][len(_SEGMENT):-1]))
        spans.append(Span(rows.get(pid, str(pid)), kind, index, -1, start, start + e["dur"] / 1e6))
    flows = [Flow(rows.get(s["pid"], str(s["pid"])), rows.get(f["pid"], str(f["pid"])),
                  (s["ts"] - origin) / 1e6, (f["ts"] - origin) / 1e6)
             for s, f in link_flows(trace["traceEvents"]) if origin <= s["ts"] <= end]
    return (sorted(spans, key=lambda s: (s.row, s.start_s)),
            sorted(flows, key=lambda f: (f.sent_s, f.sender)))


def hidden_share(spans: list[Span], flows: list[Flow]) -> float:
    """The share of the link transfers' time during which their receiver was running a gradient segment."""
    hidden, total = transfer_overlap([(f.receiver, f.sent_s, f.received_s) for f in flows],
                                     [(s.row, s.start_s, s.end_s) for s in spans if s.kind == "G"])
    return hidden / total if total > 0 else 0.0


# ---------------------------------------------------------------- drawing


def draw_pipeline(spans: list[Span], path: str, title: str) -> str:
    """A PNG of a pipeline step: forward and backward in two colours, microbatch numbers on the boxes, updates
    grey."""
    colours = {"F": "#4C72B0", "B": "#DD8452", "U": "#999999"}

    def paint(axes, rows):
        for s in spans:
            y = rows.index(s.row)
            axes.barh(y, s.end_s - s.start_s, left=s.start_s, height=0.8, color=colours[s.kind],
                      edgecolor="white")
            if s.microbatch >= 0:
                axes.text((s.start_s + s.end_s) / 2, y, str(s.microbatch), ha="center", va="center", fontsize=7,
                          color="white")

    legend = (("forward", colours["F"]), ("backward", colours["B"]), ("update", colours["U"]))
    return _plot(spans, path, title, paint, legend, row_height=0.6, margin=1.4,
                 legend_at={"loc": "upper right"})


def draw_islands(spans: list[Span], flows: list[Flow], path: str, title: str) -> str:
    """A PNG of a step across islands: gradient segments in shades of one colour (numbered), updates grey, link
    transfers as arrows."""
    def paint(axes, rows):
        for s in spans:
            y = rows.index(s.row)
            colour = "#999999" if s.kind == "U" else ("#DD8452" if s.index % 2 else "#C44E52")
            axes.barh(y, s.end_s - s.start_s, left=s.start_s, height=0.6, color=colour, edgecolor="white")
            if s.kind == "G":
                axes.text((s.start_s + s.end_s) / 2, y, str(s.index), ha="center", va="center", fontsize=7,
                          color="white")
        for f in flows:
            if f.sender in rows and f.receiver in rows:
                axes.annotate("", xy=(f.received_s, rows.index(f.receiver)),
                              xytext=(f.sent_s, rows.index(f.sender)),
                              arrowprops={"arrowstyle": "->", "color": "#4C72B0", "lw": 1.2})

    legend = (("gradient segment (one per bucket)", "#C44E52"), ("update", "#999999"),
              ("link transfer (send -> receipt)", "#4C72B0"))
    return _plot(spans, path, title, paint, legend, row_height=0.7, margin=2.0,
                 legend_at={"loc": "upper center", "bbox_to_anchor": (0.5, -0.16), "ncol": 3})


def _plot(spans: list[Span], path: str, title: str, paint, legend, *, row_height: float, margin: float,
          legend_at: dict) -> str:
    """The figure both pictures share: one row per span row (sorted), ``paint(axes, rows)`` drawing the boxes,
    seconds on the x axis, the legend ``(label, colour)`` pairs; saved to ``path``."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("trainer.runner.timeline needs matplotlib: pip install 'pathways-torch[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted({s.row for s in spans})
    figure, axes = plt.subplots(figsize=(12, row_height * len(rows) + margin))
    paint(axes, rows)
    axes.set_yticks(range(len(rows)), rows)
    axes.invert_yaxis()
    axes.set_xlabel("seconds from the step's first computation")
    axes.set_title(title)
    handles = [matplotlib.patches.Patch(color=c, label=n) for n, c in legend]
    axes.legend(handles=handles, fontsize=8, **legend_at)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
