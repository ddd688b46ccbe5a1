"""The client socket's I/O thread only measures, spots pings and queues (controller/client_inbox.py, issue 46 C2)."""

from __future__ import annotations

import threading

import pytest

from controller.client_inbox import QueueFull, RefusalPace, RequestQueue, is_ping, message_bytes, peek_request_id
from pathways_torch.wire import seam_codec

pytestmark = pytest.mark.timeout(30)


def test_the_request_id_is_read_from_the_first_bytes_only():
    frames = seam_codec.encode({"r": 4711, "op": "call", "a": [[[]] * 10]})
    assert peek_request_id(frames[0]) == 4711
    assert peek_request_id(memoryview(frames[0])) == 4711
    assert peek_request_id(seam_codec.encode({"r": 0, "op": "ping", "a": []})[0]) == 0
    for junk in (b"", b"[1,2]", b'{"$d":[["op","call"],["r",5]]}', b'{"$d":[["r","5"]]}', b'{"$d":[["r",-5]]}',
                 b'{"$d":[["r",' + b"9" * 30 + b"]]}", b'{"r":5}'):
        assert peek_request_id(junk) == 0, junk


def test_only_the_libraries_short_ping_is_a_ping():
    assert is_ping(seam_codec.encode({"r": 0, "op": "ping", "a": []}))
    assert not is_ping(seam_codec.encode({"r": 1, "op": "call", "a": []}))
    long = seam_codec.encode({"r": 0, "op": "ping", "a": [0] * 100})   # long: decoded on its worker
    assert not is_ping(long)
    assert not is_ping([*seam_codec.encode({"r": 0, "op": "ping", "a": []}), b"extra frame"])


def test_the_queue_is_bounded_by_count_and_by_bytes_and_refuses_without_queueing():
    queue = RequestQueue(max_requests=3, max_bytes=100)
    for _ in range(3):
        queue.put([b"x"], 10)
    with pytest.raises(QueueFull, match=r"3 requests of 30 bytes .*\(the bounds: 3 requests, 100 bytes"):
        queue.put([b"x"], 10)
    assert len(queue) == 3
    queue.take()
    with pytest.raises(QueueFull, match="--max-queued-bytes"):
        queue.put([b"x"], 81)
    queue.put([b"x"], 70)
    assert len(queue) == 3 and queue.high_water == 3


def test_close_wakes_a_waiting_worker_and_drops_what_is_queued():
    queue = RequestQueue(max_requests=10, max_bytes=1000)
    taken = []
    worker = threading.Thread(target=lambda: taken.append(queue.take()))
    worker.start()
    worker.join(0.1)
    assert worker.is_alive()   # waiting for a request
    assert queue.close() == 0
    worker.join(5)
    assert taken == [None]
    queue2 = RequestQueue(max_requests=10, max_bytes=1000)
    queue2.put([b"a"], 1)
    queue2.put([b"b"], 1)
    assert queue2.close() == 2 and queue2.take() is None


def test_message_bytes_counts_every_frame():
    assert message_bytes([b"abc", memoryview(b"defg"), bytearray(5)]) == 12


def test_a_message_of_millions_of_lists_is_refused_before_it_is_built():
    text = b"[" + b"[]," * (seam_codec.MAX_CONTAINERS + 1) + b"[]]"
    with pytest.raises(seam_codec.SeamCodecError, match=f"expected at most {seam_codec.MAX_CONTAINERS}"):
        seam_codec.decode([text])
    assert seam_codec.decode(seam_codec.encode({"r": 1, "a": [[]] * 1000}))["r"] == 1


def test_refusals_past_the_free_budget_of_a_second_cost_their_sender_a_pause():
    now, slept = [0.0], []
    pace = RefusalPace(free_per_s=3, pause_s=0.001, clock=lambda: now[0], sleep=slept.append)
    for _ in range(5):
        pace.pace()
    assert slept == [0.001, 0.001] and pace.paused == 2
    now[0] = 1.5   # a new second: free again
    for _ in range(3):
        pace.pace()
    assert len(slept) == 2
