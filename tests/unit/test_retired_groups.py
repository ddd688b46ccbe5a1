"""Abandoned process groups do not pile up on a survivor: each is let go at the next formation once no op given
up on still runs in it, or once it is older than its timeout plus a grace; at most a few are kept, the oldest
beyond that dropped on a thread of their own (never the heartbeat thread that abandons them)."""

from __future__ import annotations

import threading
import time
import weakref

import pytest

from executor import collectives
from executor.axis_binding import AxisBinding
from executor.collectives import CollectiveRuntime, _Group

pytestmark = pytest.mark.timeout(30)


class _FakeProcessGroup:
    """Stands for a gloo group: its drop is what lets its threads go."""


class _Work:
    def __init__(self, done: bool):
        self.done = done

    def is_completed(self) -> bool:
        return self.done


def _runtime_with(groups: dict[int, _Group]) -> CollectiveRuntime:
    runtime = CollectiveRuntime()
    runtime._groups.update(groups)
    return runtime


def _form_nothing(runtime: CollectiveRuntime) -> None:
    """A formation that fails at once (no store): enough to run its pruning on this thread."""
    with pytest.raises(RuntimeError):
        runtime.form(99, rank=0, size=2, store_path="group-99/epoch-0", timeout_s=1, members=("a@1", "b@1"))


def test_a_quiet_abandoned_group_is_let_go_at_the_next_formation_and_a_busy_one_is_kept():
    quiet_pg, busy_pg = _FakeProcessGroup(), _FakeProcessGroup()
    quiet, busy = weakref.ref(quiet_pg), weakref.ref(busy_pg)
    running = _Work(done=False)
    runtime = _runtime_with({1: _Group(quiet_pg, 2, frozenset({"a@1", "b@1"}), timeout_s=20),
                             2: _Group(busy_pg, 2, frozenset({"a@1", "c@1"}), timeout_s=20)})
    runtime._groups[2]._pending.append(running)          # an op given up on, still running in gloo
    del quiet_pg, busy_pg
    runtime.abandon("b@1", "declared lost")
    assert quiet() is not None and busy() is not None      # the heartbeat thread lets nothing go
    _form_nothing(runtime)
    assert quiet() is None and busy() is not None
    running.done = True                                    # its op ended (a reset connection, gloo's timeout)
    _form_nothing(runtime)
    assert busy() is None and runtime._retired == []


def test_an_abandoned_group_older_than_its_timeout_and_the_grace_is_let_go_whatever_runs(monkeypatch):
    pg = _FakeProcessGroup()
    ref = weakref.ref(pg)
    runtime = _runtime_with({1: _Group(pg, 2, frozenset({"a@1", "b@1"}), timeout_s=2)})
    runtime._groups[1]._pending.append(_Work(done=False))
    del pg
    runtime.abandon("b@1", "declared lost")
    _form_nothing(runtime)
    assert ref() is not None
    later = time.monotonic() + 2 + collectives._GRACE_S + 1
    monkeypatch.setattr(collectives.time, "monotonic", lambda: later)
    _form_nothing(runtime)
    assert ref() is None


def test_at_most_a_few_abandoned_groups_are_kept_the_oldest_dropped_off_the_abandoning_thread():
    limit = collectives._MAX_RETIRED
    groups, refs, dropped_on = {}, [], []
    for group_id in range(1, limit + 4):
        pg = _FakeProcessGroup()
        refs.append(weakref.ref(pg))
        weakref.finalize(pg, lambda: dropped_on.append(threading.current_thread().name))
        groups[group_id] = _Group(pg, 2, frozenset({"a@1", f"x{group_id}@1"}), timeout_s=20)
        groups[group_id]._pending.append(_Work(done=False))
        del pg
    runtime = _runtime_with(groups)
    del groups
    runtime.abandon("a@1", "declared lost")
    assert len(runtime._retired) == limit
    deadline = time.monotonic() + 5
    while sum(r() is None for r in refs) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r() is None for r in refs] == [True] * 3 + [False] * limit      # the oldest three
    assert dropped_on == ["pathways-group-release"] * 3


class _CachedStep:
    """Stands for a program's step or a call site's step, which keeps its resolved groups (`bind`'s cache)."""

    binding = None


def test_a_step_that_cached_its_binding_lets_go_of_the_group_once_it_is_abandoned():
    # Each executor replacement used to leave every survivor the old group (a gloo device thread, two worker
    # threads, a listening socket, a connection, a pipe and an epoll): a call site's cached step held it for good.
    pg = _FakeProcessGroup()
    ref = weakref.ref(pg)
    runtime = _runtime_with({1: _Group(pg, 2, frozenset({"a@1", "b@1"}), timeout_s=20)})
    del pg
    step = _CachedStep()
    with runtime.bind({"data": 1}, cache=step):
        assert runtime._handle("all_reduce", "data").size == 2
    assert step.binding is not None                        # kept: the next run of the step resolves nothing
    runtime.abandon("b@1", "declared lost")
    _form_nothing(runtime)
    assert ref() is None, "the step's cached binding still holds the abandoned group"
    with runtime.bind({"data": 1}, cache=step):             # the step run again: fails as one of an abandoned group
        with pytest.raises(collectives.CollectiveAbandoned, match="axis 'data' is unusable: member b@1 was lost"):
            runtime._handle("all_reduce", "data")


def test_a_binding_cached_after_its_group_was_abandoned_keeps_it_no_more():
    # The heartbeat thread may abandon the group between the step's resolution and its caching.
    pg = _FakeProcessGroup()
    ref = weakref.ref(pg)
    group = _Group(pg, 2, frozenset({"a@1", "b@1"}), timeout_s=20)
    del pg
    runtime = _runtime_with({})
    binding = AxisBinding(runtime._local, runtime.native, {"data": group})
    group.abandon("member b@1 was lost")
    binding.hold()
    del group
    assert ref() is None
    with binding:
        with pytest.raises(collectives.CollectiveAbandoned, match="unusable: member b@1 was lost"):
            runtime._handle("all_reduce", "data")


class _FakeNative:
    """Stands for the extension's side of the groups (`NativeGroups`): slots, and the axes bound before each run."""

    def __init__(self):
        self.bound, self.released = [], []

    def register(self, group) -> int:
        return 7

    def axis_id(self, axis: str) -> int:
        return {"data": 0, "model": 1}[axis]

    def abandon(self, slot, reason):
        pass

    def quiet(self, slot) -> bool:
        return True

    def release(self, slot):
        self.released.append(slot)

    def bind(self, axes):
        self.bound.append(list(axes))


def test_a_cached_binding_of_an_abandoned_group_binds_the_extensions_axis_to_why_not_to_its_released_slot():
    native = _FakeNative()
    runtime = CollectiveRuntime(native=native)
    runtime._groups[1] = _Group(_FakeProcessGroup(), 2, frozenset({"a@1", "b@1"}), timeout_s=20, native=native)
    step = _CachedStep()
    with runtime.bind({"data": 1}, cache=step):
        pass
    runtime.abandon("b@1", "declared lost")
    _form_nothing(runtime)
    assert native.released == [7]                           # the group went, its slot with it
    with runtime.bind({"data": 1}, cache=step):
        pass
    assert native.bound[0] == [(0, 7, False, "")]
    (axis, slot, abandoned, why), = native.bound[1]
    assert (axis, slot, abandoned) == (0, -1, True) and "member b@1 was lost" in why
