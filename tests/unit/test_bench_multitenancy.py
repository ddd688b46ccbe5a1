"""bench/multitenancy.py's pure helpers: events by client, the window where all clients ran, device time and shares
from synthetic executor traces, utilisation, the timeline's rows and the verdicts' text."""

from __future__ import annotations

import pytest

from bench.multitenancy import (EXECUTORS, activity_spans, analyse_shares, client_of, compute_events, device_time,
                                intersect, timeline, utilisation, verdicts)


def _x(name: str, ts: float, dur: float, pid: int = 0, cat: str = "compute") -> dict:
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": 0, "ts": ts, "dur": dur, "args": {}}


def _backlogged(weights: dict[str, int], rounds: int, program_us: float = 100.0) -> list[dict]:
    """Every executor runs, round after round, ``weight`` programs of each client back to back."""
    events, t = [], 0.0
    for _ in range(rounds):
        for client, weight in weights.items():
            for _ in range(weight):
                events += [_x(f"work_{client}", t, program_us, pid) for pid in range(EXECUTORS)]
                t += program_us
    return events


@pytest.mark.timeout(30)
def test_events_are_attributed_to_clients_by_name():
    assert client_of("work_c3") == "c3" and client_of("work_c12") == "c12"
    assert client_of("step") is None and client_of("chain_work_c1") is None
    trace = {"traceEvents": [_x("work_c0", 0, 1), _x("work_c0", 0, 1, cat="compile"), _x("other", 0, 1),
                             {"ph": "i", "name": "receive work_c0", "ts": 0, "pid": 0},
                             {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "executor-0 (sim)"}}]}
    assert compute_events(trace) == [_x("work_c0", 0, 1)]


@pytest.mark.timeout(30)
def test_the_window_is_where_every_client_ran():
    events = [_x("work_a", 0, 10), _x("work_a", 90, 10), _x("work_b", 20, 5), _x("work_b", 70, 10, pid=3)]
    spans = activity_spans(events)
    assert spans == {"a": (0, 100), "b": (20, 80)}
    assert intersect(spans.values()) == (20, 80)
    assert intersect([*spans.values(), (50, 1000)]) == (50, 80)       # and the measured window
    assert intersect([(0, 10), (10, 20)]) is None and intersect([(0, 10), (20, 30)]) is None
    assert intersect([]) is None


@pytest.mark.timeout(30)
def test_device_time_clips_events_to_the_window_and_sums_executors():
    events = [_x("work_a", 0, 10), _x("work_a", 0, 10, pid=1), _x("work_b", 8, 10), _x("work_b", 30, 5)]
    assert device_time(events, (5, 15)) == {"a": 10.0, "b": 7.0}      # 5 + 5 of a; 7 of b's first, none of its second
    assert device_time(events, (100, 200)) == {"a": 0.0, "b": 0.0}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("weights", [{"c0": 1, "c1": 1, "c2": 1, "c3": 1}, {"c0": 1, "c1": 2, "c2": 4, "c3": 8}])
def test_shares_follow_the_weights_of_a_proportional_schedule(weights):
    events, total = _backlogged(weights, rounds=40), sum(weights.values())
    float_weights = {c: float(w) for c, w in weights.items()}
    whole = analyse_shares(events, float_weights, (0, 40 * total * 100.0))     # whole rounds: exact
    for row in whole["rows"]:
        assert row["weight_share"] == pytest.approx(weights[row["client"]] / total)
        assert row["measured_share"] == pytest.approx(row["weight_share"]) and abs(row["diff_points"]) < 1e-9
        assert row["runs"] == 40 * weights[row["client"]] and row["run_ms"] == pytest.approx(0.1)
        assert row["device_time_ms"] == pytest.approx(row["runs"] * 0.1 * EXECUTORS)
    assert whole["utilisation"] == pytest.approx(1.0)              # back to back on every executor
    window = intersect(activity_spans(events).values())           # cut inside the first and last rounds
    result = analyse_shares(events, float_weights, window)
    for row in result["rows"]:
        assert abs(row["diff_points"]) < 1.0
        assert row["diff_points"] == pytest.approx(100 * (row["measured_share"] - row["weight_share"]))
    assert sum(r["measured_share"] for r in result["rows"]) == pytest.approx(1.0)
    assert result["window_s"] == pytest.approx((window[1] - window[0]) / 1e6)


@pytest.mark.timeout(30)
def test_equal_service_at_unequal_weights_misses_by_the_difference():
    events = _backlogged({"c0": 1, "c1": 1}, rounds=10)
    rows = analyse_shares(events, {"c0": 1.0, "c1": 3.0}, (0, 2000))["rows"]
    assert [round(r["diff_points"], 6) for r in rows] == [25.0, -25.0]    # 50 % each against 25 % and 75 %
    half = analyse_shares(events, {"c0": 1.0, "c1": 1.0}, (0, 4000))
    assert half["utilisation"] == pytest.approx(0.5)                # 2000 µs busy of 4000 on each executor
    late = analyse_shares(events, {"c0": 1.0, "c1": 1.0}, (150, 2000))   # runs counted where they start
    assert [r["runs"] for r in late["rows"]] == [9, 9]           # c1 also ran 50 µs of its run at 100 µs
    assert [r["device_time_ms"] for r in late["rows"]] == pytest.approx([7.2, 7.6])


@pytest.mark.timeout(30)
def test_utilisation_is_calls_per_second_times_the_program():
    assert utilisation(3000, 0.33) == pytest.approx(0.99)
    assert utilisation(500, 2.4) == pytest.approx(1.2)              # more than the devices hold: a counting error
    assert utilisation(0, 1) == 0


@pytest.mark.timeout(30)
def test_timeline_rows_are_per_executor_in_milliseconds_from_the_window():
    events = [_x("work_b", 2000, 3000, pid=1), _x("work_a", 500, 1000, pid=0), _x("work_a", 9000, 5000, pid=0)]
    rows = timeline(events, (1000, 11000))
    assert rows == {0: [(0.0, 0.5, "a"), (8.0, 2.0, "a")], 1: [(1.0, 3.0, "b")]}


@pytest.mark.timeout(30)
def test_verdicts_name_each_target_and_its_numbers():
    shares = [{"weights": "1:2:4:8", "program_ms": 2.4,
               "rows": [{"client": "c0", "diff_points": -0.5}, {"client": "c3", "diff_points": 3.4}]}]
    throughput = [{"clients": n, "program_ms": ms, "per_s": per_s, "utilisation": utilisation(per_s, ms)}
                  for n, ms, per_s in [(1, 0.33, 500), (4, 0.33, 2800), (16, 0.33, 400), (1, 2.4, 300), (16, 2.4, 400),
                                       (2, 0.33, 900)]]
    lines = verdicts(throughput, shares)
    assert lines == [
        "target shares within 3 points at 1:2:4:8, 2.4 ms: MISSED (worst c3: +3.4 points)",
        "target utilisation >= 90%, 4 clients of 0.33 ms: met (92.4%)",
        "target utilisation >= 90%, 16 clients of 0.33 ms: MISSED (13.2%)",
        "target 16 clients >= 1 client at 0.33 ms: MISSED (400/s vs 500/s, x0.80)",
        "target 16 clients >= 1 client at 2.4 ms: met (400/s vs 300/s, x1.33)"]
    assert verdicts([r for r in throughput if r["clients"] != 16], []) == lines[1:2]
