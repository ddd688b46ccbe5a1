"""Run-ahead is bounded per client (controller/run_ahead.py): one whose calls never end fills its own bound only."""

from __future__ import annotations

import threading

import pytest

from controller.run_ahead import RunAhead

pytestmark = pytest.mark.timeout(30)


def test_a_client_at_its_bound_waits_and_another_does_not():
    lock = threading.Lock()
    bound = RunAhead(lock, limit=4)
    with lock:
        for _ in range(4):
            bound.wait_for_room(1, "stuck", "bob", closed=lambda: False)
            bound.added("bob")                        # bob's four calls never end
        bound.wait_for_room(1, "step", "alice", closed=lambda: False)   # does not wait: alice has none in flight
        bound.added("alice")
    waited = threading.Event()

    def bobs_fifth():
        with lock:
            bound.wait_for_room(1, "stuck", "bob", closed=lambda: False)
        waited.set()

    fifth = threading.Thread(target=bobs_fifth)
    fifth.start()
    assert not waited.wait(0.3)                        # bob waits for his own calls
    with lock:
        bound.ended("alice")                           # alice's ending makes no room for bob
    assert not waited.wait(0.3)
    with lock:
        bound.ended("bob")
        bound.ended("bob")                             # 2 and one more fit under the low-water mark (3 of 4)
    assert waited.wait(5)
    fifth.join(5)
    assert bound.high_water == 5 and [w[3] for w in bound.waits] == ["stuck"]


def test_clearing_ends_every_wait():
    lock = threading.Lock()
    bound = RunAhead(lock, limit=1)
    closed = threading.Event()
    with lock:
        bound.added("bob")
    ended = threading.Event()

    def waits():
        with lock:
            bound.wait_for_room(1, "x", "bob", closed=closed.is_set)
        ended.set()

    threading.Thread(target=waits).start()
    assert not ended.wait(0.2)
    with lock:
        closed.set()
        bound.clear()
    assert ended.wait(5)
