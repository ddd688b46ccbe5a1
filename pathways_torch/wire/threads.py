"""OS-level names for our threads, so `top -H`, `perf` and ``/proc/PID/task/*/comm`` show
which thread of a process is busy (Python's thread names live only inside Python)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import signal
import sys
import threading

__all__ = ["name_os_thread", "os_thread_name", "leave_signals_to_the_main_thread", "threads_leave_signals"]

# The kernel hands a process-directed signal to any thread that does not block it. Python runs its handlers
# on the main thread only, and a main thread asleep in `time.sleep` or a lock wait wakes only when the signal
# lands on it: Ctrl-C taken by an I/O thread waits out the sleep (seen as a client ignoring SIGINT under load).
_MAIN_THREAD_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2})

_PR_SET_NAME = 15   # prctl option (linux/prctl.h)
_MAX_NAME_BYTES = 15


def os_thread_name(python_name: str) -> str:
    """The OS name a thread called ``python_name`` gets (15 bytes at most): ``pathways-`` becomes
    ``pw-``, and ``io-`` is dropped where the name is still too long (``pw-controller``)."""
    short = python_name.replace("pathways-", "pw-", 1) if python_name.startswith("pathways-") else python_name
    if len(short.encode()) > _MAX_NAME_BYTES:
        short = short.replace("-io-", "-", 1)
    return short.encode()[:_MAX_NAME_BYTES].decode(errors="ignore")


def name_os_thread() -> None:
    """Give the calling thread its Python name at the OS level (Linux; elsewhere nothing happens).

    The main thread is left alone: its OS name is the process's name in ``ps``.
    """
    thread = threading.current_thread()
    if thread is threading.main_thread() or not sys.platform.startswith("linux"):
        return
    try:
        _libc().prctl(_PR_SET_NAME, ctypes.c_char_p(os_thread_name(thread.name).encode()), 0, 0, 0)
    except (OSError, AttributeError):
        pass   # a name is a convenience for tools, never worth failing a thread for


@functools.cache
def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def leave_signals_to_the_main_thread() -> None:
    """Block the process-directed signals in the calling background thread, so they reach the main thread."""
    if threading.current_thread() is not threading.main_thread():
        signal.pthread_sigmask(signal.SIG_BLOCK, _MAIN_THREAD_SIGNALS)


@contextlib.contextmanager
def threads_leave_signals():
    """Threads started inside (a library's: ZeroMQ's authenticator, gRPC's servers) inherit a mask that leaves
    the process-directed signals to the main thread. One arriving meanwhile waits, pending, until the end."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _MAIN_THREAD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
