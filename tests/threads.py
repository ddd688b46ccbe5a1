"""A call run on a thread of its own, for tests of code that blocks (a wait for memory, for admission)."""

from __future__ import annotations

import threading
import time

__all__ = ["InThread", "until"]


def until(condition, timeout_s: float) -> None:
    """Wait for ``condition()``; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never came"
        time.sleep(0.002)


class InThread:
    """Run ``fn`` on a thread of its own; ``result()`` its value or raises its error."""

    def __init__(self, fn):
        self.value, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn):
        try:
            self.value = fn()
        except BaseException as exc:   # handed to the test thread
            self.error = exc

    def result(self, timeout_s: float = 10.0):
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "still waiting"
        if self.error is not None:
            raise self.error
        return self.value
