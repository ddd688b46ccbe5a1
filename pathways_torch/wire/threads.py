"""OS-level names for our threads, so `top -H`, `perf` and ``/proc/PID/task/*/comm`` show
which thread of a process is busy (Python's thread names live only inside Python)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
import threading

__all__ = ["name_os_thread", "os_thread_name"]

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
