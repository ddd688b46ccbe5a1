"""The compile cache with a fake backend: one compile per key, background thread, errors delivered."""

from __future__ import annotations

import threading
import time

import pytest

from executor.compile_cache import CompileCache, graph_key
from executor.trace import TraceRecorder

pytestmark = pytest.mark.timeout(30)


class SlowBackend:
    name = "fake"
    compiles_in_background = True

    def __init__(self, seconds: float = 0.0, fail: bool = False, release: threading.Event | None = None):
        self.seconds, self.fail = seconds, fail
        self.release = release     # when given, a compile waits for it (no timing in the test)
        self.compiled = []
        self.threads = set()

    def compile(self, graph_module, example_inputs):
        self.threads.add(threading.current_thread().name)
        if self.release is not None:
            assert self.release.wait(10)
        time.sleep(self.seconds)
        if self.fail:
            raise RuntimeError("the compiler refused")
        self.compiled.append(graph_module)
        return f"compiled:{graph_module}"


def test_same_key_compiles_once_and_every_waiter_is_told():
    release = threading.Event()
    backend = SlowBackend(release=release)
    cache = CompileCache(backend, TraceRecorder())
    results, done = [], threading.Event()

    def waiter(compiled, error):
        results.append((compiled, error))
        if len(results) == 3:
            done.set()

    for _ in range(3):
        cache.request("k1", "f", "graph-a", [], waiter)
    assert results == []                              # the requests returned while the compile waits
    release.set()
    assert done.wait(5)
    assert results == [("compiled:graph-a", None)] * 3
    assert backend.compiled == ["graph-a"] and cache.misses == 1 and cache.hits == 2
    assert backend.threads == {"pathways-compile"}
    cache.request("k1", "f", "graph-a", [], lambda c, e: results.append((c, e)))  # done: answered at once
    assert results[-1] == ("compiled:graph-a", None) and backend.compiled == ["graph-a"]
    cache.stop()


def test_compile_error_reaches_the_waiter_and_the_trace_has_the_span():
    trace = TraceRecorder()
    cache = CompileCache(SlowBackend(fail=True), trace, background=False)
    seen = []
    cache.request("k", "bad", "graph", [], lambda c, e: seen.append((c, e)))
    assert seen[0][0] is None and "refused" in str(seen[0][1])
    kinds = [event[0] for event in trace._events]
    assert kinds == ["compile_start", "compile_end"]


def test_graph_key_depends_on_graph_and_constants():
    assert graph_key(b"g", []) == graph_key(b"g", [])
    assert graph_key(b"g", []) != graph_key(b"h", [])
    assert graph_key(b"g", [b"\x00\x01"]) != graph_key(b"g", [b"\x00\x02"])


@pytest.mark.timeout(10)
def test_an_executable_cache_others_can_write_to_is_refused(tmp_path):
    from executor.backends.torchax_route import cache_dir_refusal

    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    assert cache_dir_refusal(str(mine)) is None
    assert cache_dir_refusal(str(mine / "jax" / "new")) is None          # made by us later, 0700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert "writable by others" in cache_dir_refusal(str(shared))
    assert "writable by others" in cache_dir_refusal(str(shared / "jax"))  # someone else could make it first
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    assert cache_dir_refusal(str(sticky / "jax")) is None                  # like /tmp: nobody can swap ours
