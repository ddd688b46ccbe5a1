"""Our threads carry OS-level names (for top -H, perf and /proc)."""

from __future__ import annotations

import threading

import pytest

from pathways_torch.wire.threads import name_os_thread, os_thread_name

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
