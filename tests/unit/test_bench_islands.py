"""bench/islands.py's pure helpers: the groups and their memory (islands_setups), the link byte theory
(islands_link), exchange waits from spans and link transfer times (islands_trace), per-round ratios and the loss
comparison (islands_report)."""

from __future__ import annotations

import pytest

import pathways_torch as pw
from bench.islands_link import expected_link_bytes, modelled_link_s, relay_rate
from bench.islands_report import loss_difference, round_ratios, spread
from bench.islands_setups import (Setup, choose_method, describe_link, make_groups, open_executors, parse_shapes,
                                  shape_key)
from bench.islands_trace import classify, exchange_steps, link_transfer_overlap, link_transfer_times


@pytest.mark.timeout(30)
def test_two_islands_send_2g_per_step_whatever_their_size():
    g = 1000
    assert expected_link_bytes(2, g) == 2 * g          # 1 + 1 and 2 x 2 alike: each slice G/D, D executors each
    assert expected_link_bytes(3, g) == 6 * g
    assert expected_link_bytes(1, g) == 0


@pytest.mark.timeout(30)
def test_setups_map_executors_to_islands_and_describe_their_links():
    setup = Setup(key="x", num_executors=4, islands=(2, 2), link=pw.Link())
    assert [setup.island_of(e) for e in range(4)] == [0, 0, 1, 1]
    assert setup.mesh_axes() == {"island": 2, "data": 2} and setup.num_shards == 2
    assert Setup(key="one", num_executors=2).mesh_axes() == {"data": 2}
    with pytest.raises(ValueError, match="do not make"):
        Setup(key="bad", num_executors=3, islands=(2, 2))
    assert describe_link(None) == "direct (no relay)"
    assert describe_link(pw.Link()) == "relay, unshaped"
    assert describe_link(pw.Link(delay_s=0.005, bandwidth_bytes_per_s=10e6)) == "relay, 10 MB/s, 5 ms"
    assert describe_link(None, islands=False) == "-"


@pytest.mark.timeout(30)
def test_shapes_parse_as_megabytes_per_second_and_milliseconds():
    links = parse_shapes("1000:0, 10:5,inf:1")
    assert links == [pw.Link(delay_s=0.0, bandwidth_bytes_per_s=1e9), pw.Link(delay_s=0.005, bandwidth_bytes_per_s=1e7),
                     pw.Link(delay_s=0.001)]
    assert shape_key(links[1]) == "islands-1+1-10MBps-5ms"
    with pytest.raises(ValueError, match="MB/s:ms"):
        parse_shapes("fast")
    assert modelled_link_s(links[1], 1e6) == pytest.approx(0.005 + 0.1)
    assert modelled_link_s(None, 1e6) == 0.0


@pytest.mark.timeout(30)
def test_groups_share_the_reference_and_count_the_executors_kept_open():
    setups, groups = make_groups(parse_shapes("1000:0,100:0,10:0,1000:1"), with_2x2=True, per_group=3)
    assert [g["name"] for g in groups] == ["gated", "link shapes 1", "link shapes 2", "2 x 2"]
    assert all(g["keys"][0] == g["reference"] for g in groups)
    # gated: 3 contexts; shapes 1: one-2 and the relay kept + 3 shaped; shapes 2: + 1; 2 x 2: 3 contexts of 4.
    assert open_executors(groups, setups) == [6, 10, 6, 12]
    assert choose_method("auto", 12, 100e9)[0] == "open"
    assert choose_method("auto", 12, 4e9)[0] == "alternate"
    assert choose_method("alternate", 2, 100e9)[0] == "alternate"


@pytest.mark.timeout(30)
def test_exchange_waits_split_into_skew_and_after_the_last_grads():
    # Two islands, one executor each; step 0: e0's grads end at 1.0, e1's at 1.5; both updates start at 1.6.
    spans = [(0, "grads", 0.0, 1.0), (0, "update", 1.6, 1.7), (1, "grads", 0.0, 1.5), (1, "update", 1.6, 1.7),
             (0, "grads", 2.0, 3.0), (0, "update", 3.1, 3.2), (1, "grads", 2.0, 3.0), (1, "update", 3.1, 3.2)]
    steps = exchange_steps(spans, island_of=lambda e: e)
    assert len(steps) == 2
    assert steps[0]["wait"] == pytest.approx((0.6 + 0.1) / 2) and steps[0]["max_wait"] == pytest.approx(0.6)
    assert steps[0]["skew"] == pytest.approx(0.5 / 2) and steps[0]["after_last"] == pytest.approx(0.1)
    assert steps[1]["wait"] == pytest.approx(0.1) and steps[1]["skew"] == 0.0
    assert all(s["compute_inside"] == 0.0 for s in steps)
    with pytest.raises(RuntimeError, match="1 grads spans per update span"):
        exchange_steps(spans[:-1], island_of=lambda e: e)
    assert exchange_steps([], island_of=lambda e: e) == []


@pytest.mark.timeout(30)
def test_a_step_cut_in_segments_ends_its_grads_with_the_last_segment():
    # one executor, 3 segments per step: the wait runs from the third segment's end to the update
    spans = [(0, "grads", 0.0, 0.2), (0, "grads", 0.2, 0.5), (0, "grads", 0.5, 1.0), (0, "update", 1.25, 1.3)]
    (step,) = exchange_steps(spans, island_of=lambda e: 0, segments_per_step=3)
    assert step["wait"] == pytest.approx(0.25)
    with pytest.raises(RuntimeError, match="2 grads spans per update span"):
        exchange_steps(spans, island_of=lambda e: 0, segments_per_step=2)


@pytest.mark.timeout(30)
def test_transfer_time_is_hidden_while_its_receiver_computes():
    # transfer 1 (0 -> 1) from 1.0 to 2.0 s while executor 1 computes from 0.5 to 1.5: half hidden;
    # transfer 2 is sent outside the window and not counted
    events = [{"cat": "compute", "ph": "X", "pid": 1, "ts": 0.5e6, "dur": 1.0e6},
              {"cat": "compute", "ph": "X", "pid": 0, "ts": 1.0e6, "dur": 1.0e6},
              {"cat": "link", "ph": "s", "id": 1, "pid": 0, "ts": 1.0e6},
              {"cat": "link", "ph": "f", "id": 1, "pid": 1, "ts": 2.0e6},
              {"cat": "link", "ph": "s", "id": 2, "pid": 0, "ts": 9.0e6},
              {"cat": "link", "ph": "f", "id": 2, "pid": 1, "ts": 9.5e6}]
    hidden, total = link_transfer_overlap(events, [(0.0, 5.0)])
    assert total == pytest.approx(1.0) and hidden == pytest.approx(0.5)


@pytest.mark.timeout(30)
def test_compute_inside_a_wait_is_counted():
    spans = [(0, "grads", 0.0, 1.0), (0, "other", 1.2, 1.3), (0, "update", 1.5, 1.6)]
    (step,) = exchange_steps(spans, island_of=lambda e: 0)
    assert step["compute_inside"] == pytest.approx(0.1)


@pytest.mark.timeout(30)
def test_link_transfers_pair_flow_starts_with_their_ends_inside_the_windows():
    events = [{"cat": "link", "ph": "s", "id": 1, "ts": 1.0e6}, {"cat": "link", "ph": "f", "id": 1, "ts": 1.25e6},
              {"cat": "link", "ph": "s", "id": 2, "ts": 9.0e6}, {"cat": "link", "ph": "f", "id": 2, "ts": 9.5e6},
              {"cat": "compute", "ph": "X", "ts": 1.0e6, "dur": 5}]
    assert link_transfer_times(events, [(0.5, 2.0)]) == [pytest.approx(0.25)]
    assert classify("island_grads[3]") == "grads"
    assert classify("island_update") == "update" and classify("train_step[X]") == "other"


@pytest.mark.timeout(30)
def test_ratios_per_round_and_losses_at_common_steps():
    rounds = [{"one": 100.0, "two": 97.0}, {"one": 50.0, "two": 50.0}, {"one": 10.0}]
    assert round_ratios(rounds, "two", "one") == [0.97, 1.0]
    assert spread([1.0, 3.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert loss_difference({0: 1.0, 4: 2.0, 9: 3.0}, {0: 1.0, 4: 2.5}) == (0.5, 2)
    assert loss_difference({1: 1.0}, {2: 1.0}) == (None, 0)


@pytest.mark.timeout(30)
def test_a_lone_relay_delivers_no_faster_than_its_shape():
    nominal = 10e6
    rate = relay_rate(pw.Link(bandwidth_bytes_per_s=nominal), 2 * 2**20)
    assert 0 < rate <= nominal * 1.1          # the 64 KiB burst, no more
    assert relay_rate(pw.Link(), 2**20) > 0
