"""Executor processes that exited, declared lost at once: the controller's watch over executors it can see die.

The host of a controller that started its executors as local processes (the embedded client, `pathways-controller
--num-executors`) asks ``newly_exited()`` (``[(executor id, why)]``) every interval and whenever the controller
suspects a loss (`Completion.liveness_probe`); the heartbeat timeout catches the hung and the remote.
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["watch_exits"]


def watch_exits(controller, loop, newly_exited: Callable[[], list], interval_s: float) -> None:
    """Declare lost every executor ``newly_exited`` names, every ``interval_s`` and when a loss is suspected."""

    def reap(patience_s: float = 0.0, then=None) -> None:
        """With ``patience_s``: look again every 20 ms until one has exited or the time is up, then call ``then()``.
        Looked at later on the controller's I/O thread, never slept for: the caller holds the controller's lock
        there, and heartbeats would go unanswered meanwhile."""
        deadline = time.monotonic() + patience_s

        def look() -> None:
            exited = newly_exited()
            if exited:   # together: a process of many simulated executors is one exit, one Cancel per survivor
                controller.members.declare_lost_many(exited)
            if not exited and time.monotonic() < deadline:
                loop.call_later(0.02, look)
            elif then is not None:
                then()

        look()

    loop.every(interval_s, reap)
    controller.completion.liveness_probe = reap
