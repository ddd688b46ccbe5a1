"""bench/pipeline.py's pure helpers (bench/pipeline_analysis.py): schedule order kept, transfer waits, the replay, and
the bubble (`observe.span_math.occupancy`) of a perfect run. The span arithmetic itself: test_span_math.py."""

from __future__ import annotations

import pytest

from bench.common import rotated
from bench.pipeline_analysis import activation_peaks, kept_order, producer, relative_error, replay, transfer_waits
from pathways_torch.observe.span_math import occupancy
from pathways_torch.pipeline.schedules import Action, make_schedule, simulate, theoretical_bubble

pytestmark = pytest.mark.timeout(30)


def _timed(simulation) -> dict:
    """action → (rank, start, end) as the simulator ran it: what the trace of a perfect run gives."""
    return {a: (r, s, e) for r, rank in enumerate(simulation.intervals) for s, e, a in rank if a.is_compute}


def test_rotated_starts_each_round_with_the_next_item():
    assert [rotated(["a", "b", "c"], i) for i in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


@pytest.mark.parametrize("name,stages,microbatches", [("gpipe", 4, 4), ("1f1b", 4, 16), ("interleaved", 2, 8)])
def test_a_perfect_run_keeps_the_order_has_no_transfer_wait_and_hits_theory(name, stages, microbatches):
    v = 2 if name == "interleaved" else 1
    simulation = simulate(make_schedule(name, stages, microbatches, v), 1.0, 2.0)
    timed = _timed(simulation)
    assert kept_order(timed, simulation.schedule)
    assert all(abs(w) < 1e-12 for w in transfer_waits(timed, simulation.schedule.num_chunks))
    measured = occupancy(list(timed.values()), stages).bubble
    assert measured == pytest.approx(theoretical_bubble(stages, microbatches, v))
    order = [a for _, a in simulation.order if a.is_compute]
    assert replay(order, simulation.schedule.num_chunks, stages, 1.0, 2.0, 0.0).bubble == pytest.approx(
        simulation.bubble_fraction)


def test_kept_order_sees_two_actions_swapped_on_a_rank():
    simulation = simulate(make_schedule("gpipe", 2, 2), 1.0, 2.0)
    timed = _timed(simulation)
    first, second = Action(0, "F", 0), Action(0, "F", 1)
    timed[first], timed[second] = timed[second], timed[first]
    assert not kept_order(timed, simulation.schedule)


def test_transfer_wait_is_measured_only_where_the_input_came_last():
    simulation = simulate(make_schedule("gpipe", 2, 2), 1.0, 2.0)
    timed = _timed(simulation)
    # Delay everything on rank 1 by 0.5: its first forward waited 0.5 for its input; the later ones
    # waited for rank 1 itself (its previous action), so they do not count.
    timed = {a: (r, s + 0.5, e + 0.5) if r == 1 else (r, s, e) for a, (r, s, e) in timed.items()}
    waits = transfer_waits(timed, simulation.schedule.num_chunks)
    assert pytest.approx(0.5) in waits
    assert producer(Action(0, "F", 0), 2) is None and producer(Action(1, "B", 0), 2) is None
    assert producer(Action(1, "F", 3), 2) == Action(0, "F", 3) and producer(Action(0, "B", 3), 2) == Action(1, "B", 3)


def test_replay_with_a_transfer_latency_stretches_the_makespan():
    simulation = simulate(make_schedule("1f1b", 4, 8), 1.0, 2.0)
    order = [a for _, a in simulation.order if a.is_compute]
    free, slow = (replay(order, 4, 4, 1.0, 2.0, latency) for latency in (0.0, 0.1))
    assert free.busy == slow.busy and slow.makespan > free.makespan and slow.bubble > free.bubble


def test_activation_peaks_per_stage_and_none_when_not_reported():
    rest = {"e0": {"store_bytes": 100}, "e1": {"store_bytes": 50}, "e2": {"store_bytes": 10}}
    peak = {"e0": {"store_bytes_high_water": 180}, "e1": {"store_bytes_high_water": 70},
            "e2": {"store_bytes_high_water": 40}}
    assert activation_peaks(rest, peak, [["e0", "e1"], ["e2"]]) == [80, 30]
    zero = {e: {"store_bytes_high_water": 0} for e in peak}
    assert activation_peaks(rest, zero, [["e0", "e1"], ["e2"]]) is None
    assert relative_error(0.11, 0.10) == pytest.approx(0.1)
