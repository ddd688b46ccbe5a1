"""Host groups (executor/shm_group.py over executor/native/shm_collectives.cpp) as the executor's collective runtime
uses them: formed through a rendezvous store where every member is on this host, gloo where one is not; results equal
gloo's on the same inputs for every dtype gloo takes; a wait ended by abandon within its slice, a missing member named
after the timeout; nothing left in /dev/shm. (The library's own units, every op and dtype under the sanitizers, are
tests/native/shm_collectives_test.cpp.)"""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback

import pytest

from tests.conftest import dev_shm_names

pytestmark = pytest.mark.timeout(180)

MEMBERS = ["exec-0@1", "exec-1@1"]


def _runtime(path: str, size: int):
    import torch.distributed as dist

    from executor.collectives import CollectiveRuntime

    return CollectiveRuntime(store_factory=lambda: dist.FileStore(path, size))


def _ops(runtime, rank: int, group_id: int) -> dict:
    """Every op of the runtime, on every dtype gloo takes, from 0 elements up."""
    import torch

    results = {}
    with runtime.bind({"data": group_id}):
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                      torch.int32, torch.int64):
            for n in (0, 1, 1000, 300_000):
                generator = torch.Generator().manual_seed(n * 10 + rank)
                x = (torch.rand(2, n, generator=generator) * 20).to(dtype)
                for op in ("sum", "max", "mean"):
                    if op == "mean" and not dtype.is_floating_point:
                        continue
                    results[("all_reduce", dtype, n, op)] = runtime.run("all_reduce", x, "data", op=op)
                    results[("reduce_scatter", dtype, n, op)] = runtime.run("reduce_scatter", x, "data", op=op, dim=1
                                                                            if n % 2 == 0 else 0)
                results[("all_gather", dtype, n)] = runtime.run("all_gather", x, "data", size=2, dim=1)
    return results


def _member(rank: int, path: str, out) -> None:
    try:
        import torch

        runtime = _runtime(path, 2)
        runtime.form(1, rank, 2, "group-1/epoch-0", 20.0, members=MEMBERS)
        os.environ["PATHWAYS_SHM_COLLECTIVES"] = "0"          # this member's next group: gloo for all
        runtime.form(2, rank, 2, "group-2/epoch-0", 20.0, members=MEMBERS)
        os.environ.pop("PATHWAYS_SHM_COLLECTIVES")
        transports = (runtime.transport(1), runtime.transport(2))
        host, gloo = _ops(runtime, rank, 1), _ops(runtime, rank, 2)
        differ = [key for key in gloo if not torch.equal(host[key], gloo[key])]
        runtime.form(3, rank, 2, "group-3/epoch-0", 1.0, members=MEMBERS)
        runtime.form(4, rank, 2, "group-4/epoch-0", 20.0, members=MEMBERS)
        failures = []
        if rank == 0:   # member 1 never comes: the timeout names it; abandon ends a wait within its slice
            failures.append(_failure(runtime, 3))
            import threading

            threading.Timer(0.2, runtime.abandon, args=("exec-1@1", "a test")).start()
            failures.append(_failure(runtime, 4))
        out.put((rank, transports, len(gloo), differ, failures))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def _failure(runtime, group_id: int):
    import torch

    start = time.monotonic()
    try:
        with runtime.bind({"data": group_id}):
            runtime.run("all_reduce", torch.ones(3), "data", op="sum")
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None


def test_host_groups_equal_gloo_and_fail_as_gloo_would(tmp_path):
    before = dev_shm_names()
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    members = [context.Process(target=_member, args=(rank, str(tmp_path / "store"), out)) for rank in (0, 1)]
    for member in members:
        member.start()
    results = dict((result[0], result[1:]) for result in (out.get(timeout=150) for _ in members))
    for member in members:
        member.join(30)
    for rank in (0, 1):
        assert len(results[rank]) == 4, results[rank]
        transports, compared, differ, _ = results[rank]
        assert transports == ("host", "gloo"), transports
        assert compared > 150 and differ == [], differ[:5]
    timed_out, abandoned = results[0][3]
    assert timed_out[0] == "HostGroupError" and "member(s) exec-1@1 had not reached step 1" in timed_out[1], timed_out
    assert 0.9 < timed_out[2] < 3, timed_out
    assert abandoned[0] == "CollectiveAbandoned" and "abandoned" in abandoned[1], abandoned
    assert abandoned[2] < 0.2 + 0.5, abandoned
    assert dev_shm_names() <= before


def test_a_member_elsewhere_makes_the_whole_group_gloo(monkeypatch):
    """Member 0 decides for all from the host keys: one key differing (another host, namespace or user, or the
    switch off) and every member gets None, so all of them form gloo."""
    from executor import shm_group

    store = _DictStore({"pathways-host/1": b"another-host/0/1"})
    assert shm_group.form_host_group(store, 0, 2, 5.0, "group-1/epoch-0") is None
    assert store.values["pathways-shm"] == b"gloo"
    assert shm_group.form_host_group(_DictStore({"pathways-shm": b"gloo"}), 1, 2, 5.0, "group-1/epoch-0") is None
    monkeypatch.setenv(shm_group.ENABLE_ENV, "0")
    assert shm_group.host_key() != shm_group.host_key()   # off: a key that matches nobody's, not even its own


def test_a_bad_answer_is_refused():
    from executor import shm_group

    with pytest.raises(shm_group.HostGroupError, match="expected a socket name"):
        shm_group.form_host_group(_DictStore({"pathways-shm": b"/tmp/x"}), 1, 2, 5.0, "group-1/epoch-0")


class _DictStore:
    def __init__(self, values: dict):
        self.values = dict(values)

    def set(self, key: str, value: bytes) -> None:
        self.values[key] = value

    def get(self, key: str) -> bytes:
        return self.values[key]
