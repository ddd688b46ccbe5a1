"""Our threads carry OS-level names (for top -H, perf and /proc) and leave Ctrl-C to the main thread."""

from __future__ import annotations

import signal
import threading

import pytest

from pathways_torch.wire.threads import (leave_signals_to_the_main_thread, name_os_thread, os_thread_name,
                                         threads_leave_signals)

pytestmark = pytest.mark.timeout(10)


def test_os_names_are_short_forms_of_the_python_names():
    assert os_thread_name("pathways-compute") == "pw-compute"
    assert os_thread_name("pathways-io-controller") == "pw-controller"   # 16 bytes with io-: dropped
    assert os_thread_name("pathways-io-client-data") == "pw-client-data"
    assert os_thread_name("pathways-heartbeat") == "pw-heartbeat"
    assert os_thread_name("a-very-long-thread-name") == "a-very-long-thr"   # 15 bytes, the kernel's limit


def test_a_thread_gets_its_name_at_the_os_level_and_the_main_thread_keeps_its_own():
    names = {}

    def run():
        name_os_thread()
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            names["thread"] = f.read().strip()

    thread = threading.Thread(target=run, name="pathways-compute")
    thread.start()
    thread.join()
    assert names["thread"] == "pw-compute"
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        before = f.read()
    name_os_thread()   # the main thread: left alone (it names the process in ps)
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        assert f.read() == before


def _blocks_sigint(native_id: int) -> bool:
    with open(f"/proc/self/task/{native_id}/status") as f:
        blocked = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
    return bool(blocked >> (signal.SIGINT - 1) & 1)


def test_background_threads_leave_ctrl_c_to_the_main_thread():
    seen = {}

    def ours():
        leave_signals_to_the_main_thread()
        seen["ours"] = _blocks_sigint(threading.get_native_id())

    def a_librarys():
        seen["library's"] = _blocks_sigint(threading.get_native_id())

    def plain():
        seen["plain"] = _blocks_sigint(threading.get_native_id())

    threads = [threading.Thread(target=ours)]
    with threads_leave_signals():
        threads.append(threading.Thread(target=a_librarys))
        threads[-1].start()
    threads.append(threading.Thread(target=plain))
    for thread in (threads[0], threads[2]):
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {"ours": True, "library's": True, "plain": False}
    assert not _blocks_sigint(threading.get_native_id())   # the main thread's mask is back as it was
