"""The executor's compute-thread loop on inproc sockets: what runs where, and in what order."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from executor.compute_loop import ComputeLoop

pytestmark = pytest.mark.timeout(30)


class Harness:
    """A ComputeLoop whose handler logs each control message and queues a job for it."""

    def __init__(self):
        self.zmq = zmq.Context()
        commands = self.zmq.socket(zmq.ROUTER)
        commands.bind("inproc://commands")
        self.controller = self.zmq.socket(zmq.DEALER)
        self.controller.connect("inproc://commands")
        replies = self.zmq.socket(zmq.PUSH)
        replies.bind("inproc://replies")
        self.replies = self.zmq.socket(zmq.PULL)
        self.replies.connect("inproc://replies")
        self.log: list[str] = []
        self.threads: set[str] = set()
        self.loop = ComputeLoop("test", self.zmq, commands=commands, replies=replies, on_control=self._on_control)
        self.thread = threading.Thread(target=self.loop.run, name="compute")

    def _on_control(self, frames) -> None:
        name = frames[1].bytes.decode()
        self.log.append(f"read {name}")
        self.threads.add(threading.current_thread().name)
        self.loop.call_soon(lambda: self._job(name))

    def _job(self, name: str) -> None:
        self.log.append(f"run {name}")
        self.threads.add(threading.current_thread().name)
        if name == "slow":
            time.sleep(0.2)   # messages sent meanwhile wait in the socket

    def wait_for(self, entries: int) -> None:
        deadline = time.monotonic() + 10
        while len(self.log) < entries and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        self.loop.stop()
        self.thread.join(5)
        for socket in (self.controller, self.replies):
            socket.close(linger=0)
        self.zmq.term()


@pytest.fixture
def harness():
    h = Harness()
    yield h
    h.close()


def test_messages_waiting_are_read_before_the_next_job_runs(harness):
    for name in ("a", "b"):
        harness.controller.send(name.encode())
    time.sleep(0.05)   # both are queued before the loop starts
    harness.thread.start()
    harness.wait_for(4)
    assert "\n".join(harness.log) == "read a\nread b\nrun a\nrun b"
    assert harness.threads == {"compute"}


def test_a_message_sent_while_a_job_runs_is_read_after_it(harness):
    harness.thread.start()
    harness.controller.send(b"slow")
    harness.wait_for(2)
    harness.controller.send(b"c")
    harness.wait_for(4)
    assert "\n".join(harness.log) == "read slow\nrun slow\nread c\nrun c"


def test_calls_and_sends_from_other_threads_run_on_the_compute_thread(harness):
    harness.thread.start()
    ran_on = []
    harness.loop.call_soon(lambda: ran_on.append(threading.current_thread().name))
    harness.loop.send([b"reply"])
    assert harness.replies.poll(5000)
    assert harness.replies.recv() == b"reply"
    deadline = time.monotonic() + 5
    while not ran_on and time.monotonic() < deadline:
        time.sleep(0.005)
    assert ran_on == ["compute"]


def test_a_failing_handler_is_logged_and_the_loop_keeps_serving(harness, caplog):
    calls = []

    def boom():
        raise RuntimeError("a bug of ours")

    harness.loop.call_soon(boom)
    harness.loop.call_soon(lambda: calls.append("after"))
    harness.thread.start()
    harness.controller.send(b"d")
    harness.wait_for(2)
    assert calls == ["after"] and harness.log == ["read d", "run d"]
    assert "a call on the compute thread failed" in caplog.text
