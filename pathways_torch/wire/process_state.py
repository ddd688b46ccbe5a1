"""What a local process is doing, from ``/proc`` (Linux): running, stopped, or gone.

One reading for every part that watches processes: the executor (is its parent alive?), the
launcher (is an executor stopped, not dead?), the soak and the tests (did an old incarnation exit?).
A zombie counts as gone: it runs nothing, and its parent has not reaped it yet.
"""

from __future__ import annotations

import os

__all__ = ["process_state", "is_alive", "is_gone", "is_stopped"]

GONE = None
HIDDEN = "?"
_GONE_STATES = ("Z", "X")        # zombie, dead
_STOPPED_STATES = ("T", "t")     # stopped by a signal (SIGSTOP, SIGTSTP), stopped by a tracer


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (``R``, ``S``, ``T`` ...; see proc(5)), ``?`` where /proc hides it, or None
    once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[-1].split()[0]   # the name may hold ")" and spaces: after the last
    except (FileNotFoundError, ProcessLookupError):
        return GONE
    except PermissionError:       # /proc mounted with hidepid: someone else's process, there but not readable
        return HIDDEN
    return GONE if state in _GONE_STATES else state


def is_gone(pid: int) -> bool:
    return process_state(pid) is GONE


def is_alive(pid: int) -> bool:
    """Running or stopped; a zombie is dead for every watcher here (it runs nothing). Someone else's process
    that ``/proc`` hides from us is alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not is_gone(pid)


def is_stopped(pid: int) -> bool:
    return process_state(pid) in _STOPPED_STATES
