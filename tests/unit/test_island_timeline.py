"""The picture of a step across islands, from a trace: the last step's segments and update on each row, the link
transfers sent during it, and the share of their time their receiver spent in its backward."""

from __future__ import annotations

import pytest

from pathways_torch.observe.timeline import describe, hidden_share
from pathways_torch.observe.timeline import island_chrome_step as chrome_step, island_picture as step_picture

pytestmark = pytest.mark.timeout(30)


def _x(pid, name, ts, dur):
    return {"ph": "X", "cat": "compute", "pid": pid, "name": name, "ts": ts, "dur": dur}


def _trace():
    rows = [{"ph": "M", "name": "process_name", "pid": p, "args": {"name": f"island {p} · executor-{p}"}}
            for p in (0, 1)]
    events = []
    for pid in (0, 1):
        for step, origin in enumerate((0, 1000)):       # two steps of two segments and an update, in us
            events += [_x(pid, "island_grads[0]", origin + 0, 100), _x(pid, "island_grads[1]", origin + 100, 100),
                       _x(pid, "island_update", origin + 300, 20)]
    # in the second step each island sends bucket 0 at 100 us (received at 150, inside the receiver's segment 1)
    # and bucket 1 at 200 us (received at 280, after the receiver's backward)
    flows = []
    for flow, (sender, sent, received) in enumerate([(0, 1100, 1150), (1, 1100, 1150), (0, 1200, 1280),
                                                     (1, 1200, 1280), (0, 100, 150)]):
        flows += [{"ph": "s", "cat": "link", "id": flow, "pid": sender, "ts": sent},
                  {"ph": "f", "cat": "link", "id": flow, "pid": 1 - sender, "ts": received}]
    return {"traceEvents": rows + events + flows}


def test_the_last_step_rows_grouped_by_island_with_its_transfers_as_text():
    spans, flows = step_picture(_trace(), segments_per_step=2)
    assert describe(spans, flows) == "\n".join([
        "island 0 · executor-0: G0 G1 U",
        "island 1 · executor-1: G0 G1 U",
        "island 0 · executor-0 -> island 1 · executor-1: 2 link transfer(s)",
        "island 1 · executor-1 -> island 0 · executor-0: 2 link transfer(s)"])
    assert [round(s.start_s * 1e6) for s in spans[:3]] == [0, 100, 300]     # from the step's first start
    # 50 us of each first transfer inside the receiver's segment 1; none of the second (after the backward)
    assert hidden_share(spans, flows) == pytest.approx(2 * 50 / (2 * 50 + 2 * 80))


def test_the_chrome_trace_is_cut_to_the_last_step():
    cut = chrome_step(_trace(), segments_per_step=2)
    timed = [e for e in cut["traceEvents"] if e.get("ph") != "M"]
    assert min(e["ts"] for e in timed) == 1000 and all(e["ts"] <= 1320 for e in timed)
    assert sum(e.get("ph") == "M" for e in cut["traceEvents"]) == 2
