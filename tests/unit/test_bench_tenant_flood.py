"""bench.tenant_flood's pure parts: bob's floods, which of alice's calls a flood disturbed, ratios, losses, verdicts."""

from __future__ import annotations

import math
import types

import pytest

from bench.tenant_flood import (compare, counted_since_last, cpu_rates, executors_lost, latencies_ms, overlaps, summary,
                                verdicts)
from bench.tenant_flood_bob import FIRST_JUNK_ID, answer_label, big_message, junk_messages
from controller.client_inbox import message_bytes, peek_request_id
from pathways_torch.wire import seam_codec

pytestmark = pytest.mark.timeout(30)


def test_junk_is_four_kinds_in_turn_and_the_answerable_ones_carry_distinct_ids():
    junk = junk_messages(8)
    assert junk[0] == junk[4] == [b"not json"]
    with pytest.raises(seam_codec.SeamCodecError):
        seam_codec.decode(junk[0])
    assert seam_codec.decode(junk[1])["op"] == "nope"
    assert seam_codec.decode(junk[2]) == {"r": FIRST_JUNK_ID + 2, "op": "call", "a": [1]}
    assert len(junk[3]) == 2 and seam_codec.decode(junk[3][:1])["op"] == "executors"
    ids = [peek_request_id(m[0]) for m in junk if m != [b"not json"]]
    assert ids == [FIRST_JUNK_ID + i for i in (1, 2, 3, 5, 6, 7)]


def test_the_big_message_is_its_size_and_a_request_the_controller_can_name():
    message = big_message(3_000_000, request_id=7)
    assert message_bytes(message) == 3_000_000
    assert peek_request_id(message[0]) == 7
    assert seam_codec.decode(message)["a"][0] == b"\0" * len(message[1])


def test_a_call_is_disturbed_if_it_overlaps_bobs_window_at_all():
    window = (10.0, 11.0)
    assert overlaps((9.5, 10.1), window) and overlaps((10.9, 12.0), window) and overlaps((9.0, 12.0), window)
    assert not overlaps((8.0, 9.99), window) and not overlaps((11.01, 11.5), window)
    call, step = "awaited call", "training step"
    samples = [{"kind": call, "start": 9.0, "end": 9.004}, {"kind": call, "start": 9.99, "end": 10.02},
               {"kind": step, "start": 10.5, "end": 10.6}, {"kind": call, "start": 11.5, "end": 11.503}]
    assert latencies_ms(samples, "awaited call", window) == pytest.approx([30.0])
    assert latencies_ms(samples, "awaited call") == pytest.approx([4.0, 30.0, 3.0])
    assert latencies_ms(samples, "awaited call", after=11.0) == pytest.approx([3.0])


def test_ratios_compare_medians_and_say_nan_where_a_window_had_no_call():
    got = compare([1.0, 2.0, 100.0], [4.0, 6.0])
    assert (got["quiet_ms"], got["disturbed_ms"], got["ratio"], got["disturbed_max_ms"]) == (2.0, 5.0, 2.5, 6.0)
    assert math.isnan(compare([2.0], [])["ratio"]) and math.isnan(compare([], [2.0])["ratio"])


def _row(flood, kind, quiet, disturbed):
    return {"flood": flood, "kind": kind, **compare(quiet, disturbed), "quiet": quiet, "disturbed": disturbed}


def test_the_verdict_is_on_the_median_rounds_ratio_ignoring_rounds_without_a_call():
    rows = [_row("junk", "awaited call", [2.0], [3.0]), _row("junk", "awaited call", [2.0], [9.0]),
            _row("junk", "awaited call", [2.0], [3.8]), _row("junk", "awaited call", [2.0], []),
            _row("junk", "training step", [10.0], [30.0]), _row("junk", "training step", [10.0], [25.0])]
    calls, steps = summary(rows)
    assert calls["median_round_ratio"] == pytest.approx(1.9) and steps["median_round_ratio"] == pytest.approx(2.75)
    assert calls["quiet_n"] == 4 and calls["disturbed_n"] == 3 and calls["disturbed_ms"] == 3.8
    lines = verdicts(rows, lost=[], failures=0)
    assert lines[0].startswith("target 0 executors lost: met") and lines[1].startswith("target 0 of alice's")
    assert ": met (" in lines[2] and "awaited call" in lines[2]
    assert ": MISSED (" in lines[3] and "training step" in lines[3]
    assert ": MISSED (executor-1" in verdicts(rows, ["executor-1 (lost, epoch 1)"], 0)[0]


def test_an_executor_is_lost_if_not_alive_or_registered_again():
    executors = [types.SimpleNamespace(executor_id=f"executor-{i}", state=state, epoch=epoch)
                 for i, (state, epoch) in enumerate([("alive", 1), ("lost", 1), ("alive", 2)])]
    assert executors_lost(executors) == ["executor-1 (lost, epoch 1)", "executor-2 (alive, epoch 2)"]


def test_cpu_rates_are_cores_over_the_windows():
    assert cpu_rates({"quiet": {"bob": 0.5, "(window s)": 2.0}}) == {"quiet": {"bob": 0.25}}


def test_answers_to_bob_are_labelled_by_kind():
    assert answer_label({"r": 3, "ok": None}) == "ok"
    assert answer_label({"r": 3, "err": TypeError("request 'nope' with []: expected one of a b c d")}) == \
        "TypeError: request 'nope' with []: expected one"
    assert answer_label({"ev": "disconnected", "why": "it sent faster"}) == "event disconnected: it sent faster"


def test_each_flood_gets_the_controller_counts_since_the_flood_before():
    reports = [{"dropped_client_messages": 1, "refused_client_requests": 0},
               {"dropped_client_messages": 18_001, "refused_client_requests": 400},
               {"dropped_client_messages": 18_002, "refused_client_requests": 400}]
    assert counted_since_last(reports) == [(1, 0), (18_000, 400), (1, 0)]
