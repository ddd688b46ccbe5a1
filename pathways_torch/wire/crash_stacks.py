"""Every pathways process leaves a stack where it dies: `enable_crash_stacks` at the top of each ``main``.

A native crash (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) writes every thread's Python stack to the process's
stderr, its log (an executor's is ``<log dir>/<id>.log``): without it an executor that died of SIGSEGV left a log
with no stack, and no way to tell which thread or call it was in (issue 47). ``kill -USR1 PID`` writes the same
stacks and the process goes on: for a hang, the first look.

An executor forked from the fork server (`executor.fork_server`) calls this after its stderr became its own log:
faulthandler writes to the file descriptor it was given when enabled, so one enabled before the fork would write
every child's crash to the server's stderr instead.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

__all__ = ["enable_crash_stacks", "enable_in_client", "STACK_SIGNAL"]

STACK_SIGNAL = signal.SIGUSR1   # asks a live process for its stacks


def enable_crash_stacks(stream=None) -> None:
    """Fatal signals and `STACK_SIGNAL` write all threads' stacks to ``stream`` (default: the current
    ``sys.stderr``, whose file descriptor is kept: call again after redirecting it)."""
    stream = _with_a_file_descriptor(stream if stream is not None else sys.stderr)
    faulthandler.enable(file=stream, all_threads=True)
    faulthandler.register(STACK_SIGNAL, file=stream, all_threads=True, chain=False)


def enable_in_client() -> None:
    """In the user's process (a context's client, and its controller where local): fatal signals write every
    thread's stack to stderr, unless the user enabled faulthandler already (theirs is kept). SIGUSR1 stays the
    user's to use."""
    if faulthandler.is_enabled():
        return
    try:
        faulthandler.enable(file=_with_a_file_descriptor(sys.stderr), all_threads=True)
    except (AttributeError, RuntimeError, ValueError):   # no stderr at all (an embedded interpreter)
        pass


def _with_a_file_descriptor(stream):
    try:
        stream.fileno()
        return stream
    except (AttributeError, OSError, ValueError):   # a stream in memory (a notebook's, a test's capture)
        return sys.__stderr__
