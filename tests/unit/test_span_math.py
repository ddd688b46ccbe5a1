"""The arithmetic on a trace's spans (`pathways_torch.observe.span_math`), shared by the step pictures and bench/:
the bubble, the transfer time hidden behind its receiver's compute, the busy share of timed windows, and the two
readers of raw trace events."""

from __future__ import annotations

import pytest

from pathways_torch.observe.span_math import (Occupancy, busy_in_windows, complete_events, link_flows, occupancy,
                                              transfer_overlap)
from pathways_torch.observe.timeline import Flow, Span, bubble_fraction, hidden_share

pytestmark = pytest.mark.timeout(30)


def test_occupancy_counts_idle_time_of_every_row_over_the_whole_makespan():
    # rank 0 busy 0-2, rank 1 busy 1-3: makespan 3, busy 4 of 6
    assert occupancy([(0, 0.0, 2.0), (1, 1.0, 3.0)], 2) == Occupancy(busy=4.0, makespan=3.0, bubble=1 - 4 / 6)
    # a row that ran nothing is idle the whole makespan, when it is counted
    assert occupancy([(0, 0.0, 2.0), (1, 1.0, 3.0)], 3).bubble == pytest.approx(1 - 4 / 9)
    assert occupancy([("a", 1.0, 1.0)]).bubble == 0.0          # no makespan: nothing idle
    with pytest.raises(ValueError, match="at least one span"):
        occupancy([], 2)


def test_the_pictures_bubble_is_the_occupancy_of_its_forward_and_backward_spans():
    spans = [Span("r0", "F", 0, 0, 0.0, 1.0), Span("r0", "B", 0, 0, 2.0, 4.0), Span("r1", "F", 1, 0, 1.0, 2.0),
             Span("r1", "U", 1, -1, 4.0, 9.0)]                     # the update is not part of the bubble
    assert bubble_fraction(spans) == occupancy([("r0", 0.0, 1.0), ("r0", 2.0, 4.0), ("r1", 1.0, 2.0)]).bubble
    assert bubble_fraction(spans) == pytest.approx(1 - 4 / 8)
    assert bubble_fraction([]) == 0.0


def test_transfer_time_is_hidden_only_while_its_receiver_is_inside_a_span():
    # 0 -> b from 1 to 3 while b computes 0.5-1.5 and 2.5-5: 0.5 + 0.5 of 2 hidden; a's spans do not count for it
    spans = [("b", 0.5, 1.5), ("a", 0.0, 9.0), ("b", 2.5, 5.0)]
    assert transfer_overlap([("b", 1.0, 3.0)], spans) == (pytest.approx(1.0), pytest.approx(2.0))
    assert transfer_overlap([("c", 1.0, 3.0)], spans) == (0.0, pytest.approx(2.0))
    assert transfer_overlap([], spans) == (0.0, 0.0)


def test_the_pictures_hidden_share_counts_the_receivers_gradient_segments_only():
    spans = [Span("b", "G", 0, -1, 0.0, 1.5), Span("b", "U", -1, -1, 1.5, 3.0)]
    flows = [Flow("a", "b", 1.0, 2.0)]
    assert hidden_share(spans, flows) == pytest.approx(0.5)
    assert hidden_share(spans, []) == 0.0


def test_busy_in_windows_counts_only_time_inside_the_windows():
    spans = [(0, 0.0, 1.0), (0, 1.5, 2.5), (1, 2.0, 3.0)]
    result = busy_in_windows(spans, [(0.5, 2.0), (2.2, 2.4)])   # 1.7 s of windows
    assert list(result) == [0, 1]
    assert result[0].busy_fraction == pytest.approx((0.5 + 0.5 + 0.2) / 1.7)
    assert result[0].durations_started_inside == (1.0,)          # the span from 1.5 started inside; 0.0 did not
    assert result[1].busy_fraction == pytest.approx(0.2 / 1.7) and result[1].durations_started_inside == ()
    assert busy_in_windows(spans, [])[0].busy_fraction == 0.0


def test_trace_readers_keep_complete_events_and_pair_received_link_flows_in_send_order():
    events = [{"ph": "X", "cat": "compute", "ts": 1, "dur": 2}, {"ph": "X", "cat": "collective", "ts": 1, "dur": 2},
              {"ph": "i", "cat": "compute", "ts": 1},
              {"cat": "link", "ph": "s", "id": 7, "ts": 5.0}, {"cat": "link", "ph": "s", "id": 3, "ts": 6.0},
              {"cat": "link", "ph": "f", "id": 3, "ts": 8.0}, {"cat": "link", "ph": "f", "id": 7, "ts": 9.0},
              {"cat": "link", "ph": "s", "id": 4, "ts": 9.5}]                 # never received: left out
    assert complete_events(events) == events[:1]
    assert complete_events(events, "compute", "collective") == events[:2]
    assert [(s["id"], s["ts"], f["ts"]) for s, f in link_flows(events)] == [(7, 5.0, 9.0), (3, 6.0, 8.0)]
