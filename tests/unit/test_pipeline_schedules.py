"""Pipeline schedules as text in, text out, and the simulator that validates and times them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pathways_torch.pipeline.schedules import (
    ACTION_KINDS, SCHEDULE_NAMES, Action, Schedule, ScheduleError, Simulation, gpipe, interleaved,
    make_schedule, one_f_one_b, simulate, theoretical_bubble, with_communication,
)


def text(s: str) -> str:
    return textwrap.dedent(s).strip()


GPIPE_2_4 = text("""
    schedule gpipe: 2 ranks, 2 chunks, 4 microbatches
    rank 0: 0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3
    rank 1: 1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3
""")

# Rank 0 warms up with S-1-r = 1 forward; rank 1 (the last) alternates from the start.
ONE_F_ONE_B_2_4 = text("""
    schedule 1f1b: 2 ranks, 2 chunks, 4 microbatches
    rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
    rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
""")

# Rank 0 holds chunks 0 and 2, rank 1 chunks 1 and 3; rounds of S = 2 microbatches.
# Warm-up (V-1)*S + 2*(S-1-r): 4 forwards on rank 0, 2 on rank 1.
INTERLEAVED_2_4_2 = text("""
    schedule interleaved: 2 ranks, 4 chunks, 4 microbatches
    rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
    rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3
""")

ONE_F_ONE_B_2_4_WITH_COMMUNICATION = text("""
    schedule 1f1b: 2 ranks, 2 chunks, 4 microbatches
    rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0F3 0SEND_F3 0RECV_B2 0B2 0RECV_B3 0B3
    rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2 1RECV_F3 1F3 1B3 1SEND_B3
""")


def error_of(schedule: Schedule) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        simulate(schedule)
    return info.value


def line_of(message: str, rank: int) -> str:
    return next(line for line in message.splitlines() if line.startswith(f"rank {rank}:"))


# ---------------------------------------------------------------- actions


@pytest.mark.timeout(30)
@pytest.mark.parametrize("word, action", [
    ("0F3", Action(0, "F", 3)), ("1B2", Action(1, "B", 2)), ("0SEND_F3", Action(0, "SEND_F", 3)),
    ("1RECV_F3", Action(1, "RECV_F", 3)), ("1SEND_B2", Action(1, "SEND_B", 2)),
    ("0RECV_B2", Action(0, "RECV_B", 2)), ("12F34", Action(12, "F", 34)),
])
def test_an_action_prints_and_parses_as_chunk_kind_microbatch(word, action):
    assert str(action) == word
    assert Action.parse(word) == action


@pytest.mark.timeout(30)
@pytest.mark.parametrize("word", ["0X3", "F3", "0F", "0f3", "0F3x", "-1F0", "0SEND3", "0 F3", ""])
def test_a_bad_action_token_is_named_with_the_accepted_form(word):
    with pytest.raises(ValueError) as info:
        Action.parse(word)
    assert str(info.value) == (f"bad action {word!r}: expected {{chunk}}{{kind}}{{microbatch}} with kind "
                               f"one of F, B, SEND_F, RECV_F, SEND_B, RECV_B, e.g. 0F3 or 1SEND_B2")


@pytest.mark.timeout(30)
def test_an_action_is_checked_when_built():
    assert ACTION_KINDS == ("F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
    with pytest.raises(ValueError, match="Action.kind: expected one of F, B, .* got 'W'"):
        Action(0, "W", 0)
    with pytest.raises(ValueError, match=r"Action.chunk: expected an int >= 0, got -1"):
        Action(-1, "F", 0)
    assert Action(0, "F", 0).is_compute and not Action(0, "SEND_F", 0).is_compute


# ---------------------------------------------------------------- text form


@pytest.mark.timeout(30)
def test_generators_print_the_hand_worked_schedules():
    assert str(gpipe(2, 4)) == GPIPE_2_4
    assert str(one_f_one_b(2, 4)) == ONE_F_ONE_B_2_4
    assert str(interleaved(2, 4, 2)) == INTERLEAVED_2_4_2
    assert str(with_communication(one_f_one_b(2, 4))) == ONE_F_ONE_B_2_4_WITH_COMMUNICATION
    for worked in (GPIPE_2_4, ONE_F_ONE_B_2_4, INTERLEAVED_2_4_2, ONE_F_ONE_B_2_4_WITH_COMMUNICATION):
        simulate(Schedule.parse(worked))  # each runs: no ScheduleError


@pytest.mark.timeout(30)
def test_the_module_imports_no_torch():
    code = "import sys, pathways_torch.pipeline.schedules; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name, ranks, microbatches, virtual", [
    ("gpipe", 1, 1, 1), ("gpipe", 4, 8, 1), ("1f1b", 4, 2, 1), ("1f1b", 8, 16, 1),
    ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 3), ("interleaved", 1, 3, 2),
])
def test_every_generated_schedule_round_trips_through_text(name, ranks, microbatches, virtual):
    for schedule in (make_schedule(name, ranks, microbatches, virtual),
                     with_communication(make_schedule(name, ranks, microbatches, virtual))):
        printed = str(schedule)
        assert Schedule.parse(printed) == schedule
        assert str(Schedule.parse(printed)) == printed


@pytest.mark.timeout(30)
def test_parse_without_a_header_infers_the_counts():
    body = "\n".join(ONE_F_ONE_B_2_4.splitlines()[1:])
    parsed = Schedule.parse(body)
    assert (parsed.num_ranks, parsed.num_chunks, parsed.num_microbatches, parsed.name) == (2, 2, 4, "")
    assert str(parsed).splitlines()[0] == "schedule: 2 ranks, 2 chunks, 4 microbatches"
    assert Schedule.parse(body, num_microbatches=6, num_chunks=4).num_chunks == 4
    # One rank, chunks 0..2: the chunk count is rounded up to a multiple of the ranks (1 here).
    assert Schedule.parse("rank 0: 0F0 1F0 2F0 2B0 1B0 0B0").num_chunks == 3
    assert str(Schedule.parse("rank 0: 0F0 0B0\nrank 1:")) == text("""
        schedule: 2 ranks, 2 chunks, 1 microbatch
        rank 0: 0F0 0B0
        rank 1:
    """)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad, message", [
    ("rank 0: 0F0 0Q1", "rank 0: bad action '0Q1': expected {chunk}{kind}{microbatch}"),
    ("rank 1: 0F0", "schedule line 'rank 1: 0F0': expected rank 0 here"),
    ("ranks 0: 0F0", "bad schedule line 'ranks 0: 0F0': expected 'rank 0: ACTION ...'"),
    ("schedule x 2 ranks\nrank 0: 0F0", "bad schedule header 'schedule x 2 ranks': expected "
                                        "'schedule NAME: S ranks, C chunks, M microbatches'"),
    ("schedule: 3 ranks, 3 chunks, 1 microbatch\nrank 0: 0F0",
     "schedule header says 3 ranks but the text has 1 rank lines"),
    ("", "schedule text has no 'rank 0: ...' line"),
])
def test_parse_errors_name_the_bad_line(bad, message):
    with pytest.raises(ValueError) as info:
        Schedule.parse(bad)
    assert str(info.value).startswith(message)


@pytest.mark.timeout(30)
def test_parse_refuses_counts_that_contradict_the_header():
    with pytest.raises(ValueError, match="num_microbatches=5 but the header says 4"):
        Schedule.parse(GPIPE_2_4, num_microbatches=5)


@pytest.mark.timeout(30)
def test_a_schedule_checks_its_shape_when_built():
    with pytest.raises(ValueError, match=r"num_chunks \(3\) must be a multiple of num_ranks \(2\)"):
        Schedule(2, 3, 1, ((), ()))
    with pytest.raises(ValueError, match=r"expected one action list per rank \(2\), got 1"):
        Schedule(2, 2, 1, ((),))
    with pytest.raises(ValueError, match="Schedule.name: expected letters"):
        Schedule(1, 1, 1, ((),), name="two words")
    assert Schedule(1, 1, 1, [[Action(0, "F", 0)]]).ranks == ((Action(0, "F", 0),),)


# ---------------------------------------------------------------- communication


@pytest.mark.timeout(30)
def test_communication_is_inserted_next_to_its_compute_and_removed_again():
    with_comm = with_communication(interleaved(2, 4, 2))
    assert with_comm.compute_only() == interleaved(2, 4, 2)
    assert with_communication(with_comm) == with_comm
    rank0 = str(with_comm).splitlines()[1]
    # 2F0's input comes from chunk 1 on rank 1, its output goes to chunk 3 on rank 1.
    assert "0SEND_F1 2RECV_F0 2F0 2SEND_F0 2RECV_F1" in rank0
    # The first chunk receives no input, the last sends no output (3B0 is followed by 3SEND_B0 only).
    assert "0RECV_F" not in str(with_comm) and "3SEND_F" not in str(with_comm)
    assert "3RECV_F0 3F0 3B0 3SEND_B0" in str(with_comm)


@pytest.mark.timeout(30)
def test_one_rank_needs_no_communication():
    # Rounds of S = 1 microbatch: the chunks take turns microbatch by microbatch.
    schedule = interleaved(1, 2, 3)
    assert with_communication(schedule) == schedule
    assert str(schedule).splitlines()[1] == "rank 0: 0F0 1F0 2F0 2B0 0F1 1B0 1F1 0B0 2F1 2B1 1B1 0B1"
    assert simulate(schedule).bubble_fraction == 0.0


# ---------------------------------------------------------------- generators


@pytest.mark.timeout(30)
def test_make_schedule_dispatches_on_the_name():
    assert SCHEDULE_NAMES == ("gpipe", "1f1b", "interleaved")
    assert make_schedule("gpipe", 2, 4) == gpipe(2, 4)
    assert make_schedule("1f1b", 2, 4) == one_f_one_b(2, 4)
    assert make_schedule("interleaved", 2, 4, 2) == interleaved(2, 4, 2)
    with pytest.raises(ValueError, match="unknown schedule 'zb': expected one of gpipe, 1f1b, interleaved"):
        make_schedule("zb", 2, 4)
    with pytest.raises(ValueError, match="got virtual_stages=2; use 'interleaved' for more"):
        make_schedule("1f1b", 2, 4, virtual_stages=2)


@pytest.mark.timeout(30)
def test_generators_refuse_bad_shapes():
    with pytest.raises(ValueError, match=r"num_microbatches \(6\) must be a multiple of num_ranks \(4\), "
                                         r"as torch's ScheduleInterleaved1F1B requires; use 8 microbatches"):
        interleaved(4, 6, 2)
    with pytest.raises(ValueError, match="num_microbatches: expected an int >= 1, got 0"):
        one_f_one_b(2, 0)
    with pytest.raises(ValueError, match="virtual_stages: expected an int >= 1, got 0"):
        interleaved(2, 2, 0)


@pytest.mark.timeout(30)
def test_one_f_one_b_with_fewer_microbatches_than_ranks_caps_the_warm_up():
    # Warm-up is min(S-1-r, M): ranks 0 and 1 run all forwards first, rank 2 one.
    assert str(one_f_one_b(4, 2)) == text("""
        schedule 1f1b: 4 ranks, 4 chunks, 2 microbatches
        rank 0: 0F0 0F1 0B0 0B1
        rank 1: 1F0 1F1 1B0 1B1
        rank 2: 2F0 2F1 2B0 2B1
        rank 3: 3F0 3B0 3F1 3B1
    """)


# ---------------------------------------------------------------- simulation


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("microbatches", [4, 8, 16])
@pytest.mark.parametrize("forward_time, backward_time", [(1.0, 1.0), (1.0, 2.0)])
def test_gpipe_and_1f1b_bubbles_match_theory(name, ranks, microbatches, forward_time, backward_time):
    sim = simulate(make_schedule(name, ranks, microbatches), forward_time, backward_time)
    assert abs(sim.bubble_fraction - theoretical_bubble(ranks, microbatches)) < 1e-9
    assert sim.makespan == pytest.approx((microbatches + ranks - 1) * (forward_time + backward_time))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ranks, microbatches", [(2, 4), (4, 8), (4, 16), (8, 8), (8, 16)])
@pytest.mark.parametrize("virtual", [2, 4])
def test_interleaving_shrinks_the_bubble_as_theory_says(ranks, microbatches, virtual):
    plain = simulate(one_f_one_b(ranks, microbatches), 1.0, 1.0).bubble_fraction
    sim = simulate(interleaved(ranks, microbatches, virtual), 1.0, 1.0)
    assert sim.bubble_fraction < plain
    assert abs(sim.bubble_fraction - theoretical_bubble(ranks, microbatches, virtual)) < 1e-9


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("microbatches", [1, 3, 4, 8, 16])
def test_peak_live_activations(ranks, microbatches):
    one_f = simulate(one_f_one_b(ranks, microbatches)).peak_live_activations
    assert one_f == tuple(min(ranks - r, microbatches) for r in range(ranks))
    assert simulate(gpipe(ranks, microbatches)).peak_live_activations == (microbatches,) * ranks


@pytest.mark.timeout(30)
def test_simulation_of_1f1b_2_4_in_detail():
    sim = simulate(one_f_one_b(2, 4))
    assert isinstance(sim, Simulation)
    assert str(sim.schedule) == ONE_F_ONE_B_2_4_WITH_COMMUNICATION
    assert [f"{start:g}-{end:g} {a}" for start, end, a in sim.intervals[1] if a.is_compute] == [
        "1-2 1F0", "2-4 1B0", "4-5 1F1", "5-7 1B1", "7-8 1F2", "8-10 1B2", "10-11 1F3", "11-13 1B3"]
    assert sim.makespan == 15.0 and sim.bubble_fraction == pytest.approx(0.2)
    # At t=1, 0F1 and 1RECV_F0 both start: the tie goes to rank 0.
    assert " ".join(f"{r}:{a}" for r, a in sim.order[:8]) == (
        "0:0F0 0:0SEND_F0 0:0F1 1:1RECV_F0 1:1F0 0:0SEND_F1 1:1B0 1:1SEND_B0")
    assert sim.describe() == text("""
        schedule 1f1b: 2 ranks, 2 chunks, 4 microbatches (F=1, B=2)
        rank   busy   idle  peak_live
           0     12      3          2
           1     12      3          1
        makespan 15, bubble 20.0%
    """)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("schedule", [gpipe(4, 8), one_f_one_b(4, 3), interleaved(4, 8, 2)])
def test_order_starts_in_time_and_respects_every_dependency(schedule):
    sim = simulate(schedule)
    starts = {a: start for rank in sim.intervals for start, _, a in rank}
    ends = {a: end for rank in sim.intervals for _, end, a in rank}
    order = [a for _, a in sim.order]
    assert sorted(order, key=str) == sorted((a for rank in sim.schedule.ranks for a in rank), key=str)
    assert [starts[a] for a in order] == sorted(starts[a] for a in order)
    position = {a: i for i, a in enumerate(order)}
    for r, a in sim.order:
        needs = []
        if a.kind == "RECV_F":
            needs.append(Action(a.chunk - 1, "SEND_F", a.microbatch))
        if a.kind == "RECV_B":
            needs.append(Action(a.chunk + 1, "SEND_B", a.microbatch))
        if a.kind == "B":
            needs.append(Action(a.chunk, "F", a.microbatch))
        for need in needs:
            assert position[need] < position[a] and ends[need] <= starts[a], (a, need)


# ---------------------------------------------------------------- broken schedules


@pytest.mark.timeout(30)
def test_a_backward_before_its_forward_is_marked():
    # 1f1b(2, 4) with 1F2 and 1B2 swapped on rank 1.
    broken = ONE_F_ONE_B_2_4.replace("1F2 1B2", "1B2 1F2")
    error = error_of(Schedule.parse(broken))
    assert str(error) == text("""
        1B2 comes before 1F2, which it needs, on rank 1; move 1F2 before 1B2
        schedule 1f1b: 2 ranks, 2 chunks, 4 microbatches
        rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
        rank 1: 1F0 1B0 1F1 1B1 >>1B2<< 1F2 1F3 1B3
    """)
    assert error.mark == (1, 4)


@pytest.mark.timeout(30)
def test_a_removed_receive_leaves_its_send_unmatched():
    broken = ONE_F_ONE_B_2_4_WITH_COMMUNICATION.replace(" 1RECV_F2", "")
    error = error_of(Schedule.parse(broken))
    assert error.problem == ("0SEND_F2 has no matching 1RECV_F2 on rank 1; add it there "
                             "(with_communication places both)")
    assert line_of(str(error), 0) == ("rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 >>0SEND_F2<< "
                                      "0RECV_B1 0B1 0F3 0SEND_F3 0RECV_B2 0B2 0RECV_B3 0B3")


@pytest.mark.timeout(30)
def test_a_removed_send_leaves_its_receive_unmatched():
    broken = ONE_F_ONE_B_2_4_WITH_COMMUNICATION.replace(" 1SEND_B3", "")
    error = error_of(Schedule.parse(broken))
    assert error.problem.startswith("0RECV_B3 has no matching 1SEND_B3 on rank 1")
    assert line_of(str(error), 0).endswith("0RECV_B2 0B2 >>0RECV_B3<< 0B3")


@pytest.mark.timeout(30)
def test_a_pair_removed_leaves_its_compute_without_communication():
    broken = ONE_F_ONE_B_2_4_WITH_COMMUNICATION.replace(" 0SEND_F2", "").replace(" 1RECV_F2", "")
    error = error_of(Schedule.parse(broken))
    assert error.problem == ("0F2 on rank 0 has no 0SEND_F2 to send its result; add it "
                             "(with_communication places it)")
    assert " 0RECV_B0 0B0 >>0F2<< 0RECV_B1 " in line_of(str(error), 0)


@pytest.mark.timeout(30)
def test_an_action_on_the_wrong_rank_is_marked():
    broken = GPIPE_2_4.replace(" 1F3", "").replace("0B3", "0B3 1F3")
    error = error_of(Schedule.parse(broken))
    assert error.problem == ("1F3 is on rank 0, but chunk 1 lives on rank 1 (chunk c is on rank c % 2); "
                             "move it there")
    assert line_of(str(error), 0) == "rank 0: 0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3 >>1F3<<"


@pytest.mark.timeout(30)
def test_a_duplicate_forward_is_marked_where_it_repeats():
    error = error_of(Schedule.parse(GPIPE_2_4.replace("1F2", "1F2 1F2")))
    assert error.problem == "duplicate 1F2: it already ran at position 2 of rank 1; each action runs once"
    assert line_of(str(error), 1) == "rank 1: 1F0 1F1 1F2 >>1F2<< 1F3 1B0 1B1 1B2 1B3"


@pytest.mark.timeout(30)
def test_a_missing_forward_is_named_and_its_backward_marked():
    error = error_of(Schedule.parse(GPIPE_2_4.replace(" 0F1", "")))
    assert error.problem == ("missing 0F1: every chunk needs an F and a B of every microbatch; "
                             "add it to rank 0")
    assert line_of(str(error), 0) == "rank 0: 0F0 0F2 0F3 0B0 >>0B1<< 0B2 0B3"


@pytest.mark.timeout(30)
def test_an_action_out_of_range_is_marked():
    error = error_of(Schedule.parse("rank 0: 0F0 0B0 0F1", num_microbatches=1))
    assert error.problem == "0F1 is out of range: the schedule has chunks 0..0 and microbatches 0..0"


@pytest.mark.timeout(30)
def test_a_send_nobody_can_receive_is_refused():
    broken = Schedule.parse("rank 0: 0F0 0SEND_F0 0RECV_B0 0B0 0SEND_B0\n"
                            "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0")
    assert error_of(broken).problem == "0SEND_B0 is not needed: chunk 0 has no previous chunk; remove it"


@pytest.mark.timeout(30)
def test_a_deadlock_reports_every_blocked_rank_and_marks_the_first():
    # Rank 0 waits for the gradient before sending the activation rank 1 needs to make it.
    broken = Schedule.parse(text("""
        rank 0: 0F0 0RECV_B0 0SEND_F0 0B0
        rank 1: 1RECV_F0 1F0 1B0 1SEND_B0
    """))
    error = error_of(broken)
    assert str(error) == text("""
        deadlock: no rank can go on; rank 0 waits at 0RECV_B0 for 1SEND_B0 on rank 1; rank 1 waits at \
1RECV_F0 for 0SEND_F0 on rank 0. Reorder so that each value is sent before its sender waits
        schedule: 2 ranks, 2 chunks, 1 microbatch
        rank 0: 0F0 >>0RECV_B0<< 0SEND_F0 0B0
        rank 1: 1RECV_F0 1F0 1B0 1SEND_B0
    """)


@pytest.mark.timeout(30)
def test_a_compute_only_schedule_that_deadlocks_is_shown_with_its_communication():
    # Rank 0 finishes microbatch 0 before starting 1; rank 1 wants microbatch 1 first.
    broken = Schedule.parse("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F1 1F0 1B0 1B1")
    error = error_of(broken)
    assert error.problem.startswith("deadlock: no rank can go on; rank 0 waits at 0RECV_B0 for 1SEND_B0")
    assert line_of(str(error), 0) == "rank 0: 0F0 0SEND_F0 >>0RECV_B0<< 0B0 0F1 0SEND_F1 0RECV_B1 0B1"
    assert line_of(str(error), 1) == "rank 1: 1RECV_F1 1F1 1RECV_F0 1F0 1B0 1SEND_B0 1B1 1SEND_B1"


@pytest.mark.timeout(30)
def test_simulate_refuses_non_positive_times():
    with pytest.raises(ValueError, match="expected positive forward_time and backward_time, got 0 and 1"):
        simulate(gpipe(2, 2), 0, 1)


@pytest.mark.timeout(30)
def test_theoretical_bubble():
    assert theoretical_bubble(4, 12) == pytest.approx(3 / 15)
    assert theoretical_bubble(4, 12, 2) == pytest.approx(3 / 27)
    assert theoretical_bubble(1, 5) == 0.0
