"""Collectives on an executor: process groups per mesh axis, bound while a function runs.

Groups are gloo ``ProcessGroupGloo`` objects that meet through the controller's
rendezvous store, reached over this executor's CURVE connection to it
(`executor.rendezvous`; no shared disk, no default world group, no TCPStore listening
on every interface), with a timeout of the heartbeat bound so a dead peer surfaces as an error. A group
knows its members' incarnations (``id@epoch``): when the controller reports one lost
(`abandon`, from the heartbeat thread), the group is retired at once and a collective
blocked on it fails within a fraction of a second, whatever gloo's own timeout; the bindings
that steps cache let go of it then (else each replacement left every survivor a gloo group). The
gloo device binds to the executor's own interface (loopback unless told
otherwise). The ``pathways::`` ops call `CollectiveRuntime.run`; while the compute
thread runs a function, each mesh axis it names is bound to a group. A call with no
binding is an error, except inside `dry_runs()` (the torch_xla route's warm-up
compile), where it returns correctly shaped zeros and communicates nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import threading
import time
import weakref

# The factories live in process_groups; here too, where the benchmarks and tests have always imported them.
from .axis_binding import AbandonedReason, AxisBinding, CollectiveAbandoned
from .process_groups import gloo_group_on, make_gloo_group, make_nccl_group, nccl_group_on
from .shm_group import ShmGroup, form_host_group

__all__ = ["CollectiveRuntime", "CollectiveAbandoned", "make_gloo_group", "make_nccl_group", "gloo_group_on",
           "nccl_group_on", "dry_runs"]

log = logging.getLogger(__name__)

_dry = threading.local()


@contextlib.contextmanager
def dry_runs():
    """On this thread, collectives with no group bound return zeros of their output's shape instead of failing:
    for a warm-up run that must trace a graph through its collectives without communicating."""
    previous = getattr(_dry, "on", False)
    _dry.on = True
    try:
        yield
    finally:
        _dry.on = previous


class CollectiveRuntime:
    """This executor's process groups and the axis bindings of the running computation."""

    def __init__(self, bind_host: str = "127.0.0.1", device: str = "cpu", trace=None, store_factory=None,
                 native=None):
        self.bind_host = bind_host
        # The groups' side in the extension that runs collectives inside XLA executables, where the backend has
        # it (`executor.backends.xla_collectives.NativeGroups`): groups registered there, axes bound there too.
        self.native = native
        # Makes this executor's connection to the controller's rendezvous store (at the first group).
        self._store_factory, self._store = store_factory, None
        self.trace = trace       # a TraceRecorder: each collective is a span inside its computation
        self.device = device     # NCCL groups on CUDA executors, gloo everywhere else
        self._groups: dict[int, _Group] = {}
        self._failures: dict[int, str] = {}
        # Abandoned groups whose ops may still run: kept referenced, since dropping a gloo group joins its worker
        # threads, which a blocked op holds until gloo's own timeout. Released once quiet (`_prune_retired`).
        self._retired: list[_Group] = []
        self._retired_lock = threading.Lock()    # the heartbeat thread retires, the compute thread forms
        self.abandoned: set[str] = set()    # faults reported so far: lost incarnations ("id@epoch"), lost transfers
        self._abandoned_below = 0           # groups with a smaller id were made before a fault: abandoned
        self._abandoned_ids: set[int] = set()
        self._local = threading.local()
        self._ops = {"all_reduce": self._all_reduce, "all_gather": self._all_gather,
                     "reduce_scatter": self._reduce_scatter}

    # ------------------------------------------------------------ groups

    def form(self, group_id: int, rank: int, size: int, store_path: str, timeout_s: float, members=()) -> None:
        """Join group ``group_id`` (blocks until every member has joined, or the timeout)."""
        self._prune_retired()     # on this thread, which may wait: the heartbeat thread's abandon must not
        lost = sorted(self.abandoned.intersection(members))
        try:
            if lost:
                raise RuntimeError(f"member {lost[0]} was lost before the group formed")
            store = self._rendezvous(store_path, size, timeout_s)
            if self.device.startswith("cuda"):
                group = nccl_group_on(store, rank, size, timeout_s, self.device)
            else:   # members of one host share a mapping (`executor.shm_group`); gloo where they span hosts
                group = form_host_group(store, rank, size, timeout_s, store_path, members) or \
                    gloo_group_on(store, rank, size, timeout_s, self.bind_host)
                _mark_formed(store, group_id)
            # NCCL's wait only orders the stream (the host does not block in it): nothing to slice.
            self._groups[group_id] = _Group(group, size, frozenset(members), sliced=not self.device.startswith("cuda"),
                                            timeout_s=timeout_s, native=self.native)
        except Exception as exc:
            self._failures[group_id] = f"{type(exc).__name__}: {exc}"
            raise
        if self.abandoned.intersection(members):   # lost while it formed: abandon it now
            self.abandon(sorted(self.abandoned.intersection(members))[0], "lost while the group formed")
        elif group_id < self._abandoned_below:      # queued before a fault of the island, formed after it
            self._abandon_group(group_id, "made before a fault of its island; abandoned when it formed")

    def transport(self, group_id: int) -> str:
        """How group ``group_id`` communicates here: ``host`` (one host's shared mapping), ``gloo`` or ``nccl``; ``""``
        if it is not formed."""
        group = self._groups.get(group_id)
        if group is None:
            return ""
        return "host" if group.on_host else "nccl" if self.device.startswith("cuda") else "gloo"

    def abandon(self, member: str, reason: str, before_group: int | None = None) -> list[int]:
        """Incarnation ``member`` (``id@epoch``) of this island was lost: retire every group here. A collective
        blocked in one fails now, later ones fail at once; the controller forms new ones. Every group, not only
        those that hold it: the survivors drop the failed calls' work each at its own point in its queue, so the
        members of a group without the lost one may be out of step by an op, and reusing it would pair one
        member's op with another's next (same shapes: wrong sums, no error). Safe from any thread (the heartbeat
        thread calls it). ``before_group``: only groups with a smaller id (those formed before the loss; a
        replacement's are newer). Returns the ids."""
        self.abandoned.add(member)
        if before_group is not None:
            self._abandoned_below = max(self._abandoned_below, before_group)
        retired = []
        # By id, not a list of the groups: that list would hold them all until this returns, so the oldest let go
        # (`_abandon_group`) would drop here, on the heartbeat thread, instead of on their own thread.
        for group_id in list(self._groups):
            group = self._groups.get(group_id)   # another thread's abandon (the compute thread's form) may be first
            if group is None or (before_group is not None and group_id >= before_group):
                continue
            self._abandon_group(group_id, f"member {member} was lost ({reason}); the group was abandoned"
                                if member in group.members else
                                f"{member} was lost ({reason}); every group of this island made before was "
                                f"abandoned")
            retired.append(group_id)
        return retired

    def abandon_groups(self, group_ids, reason: str) -> None:
        """Groups the controller abandoned at a loss (a `Cancel` names them), formed here or not: a formation still
        queued is skipped (`RunQueue.cancel`), so a run that binds the group must fail as abandoned (recovery runs
        its step again on new groups), not as a group "never formed" (a bug, which recovery does not undo)."""
        for group_id in group_ids:
            if group_id not in self._abandoned_ids:
                self._abandon_group(group_id, f"the controller abandoned it ({reason})")

    def _abandon_group(self, group_id: int, failure: str) -> None:
        handle = self._groups.pop(group_id, None)
        self._failures[group_id] = failure
        self._abandoned_ids.add(group_id)
        if handle is None:
            return
        handle.abandon(failure)
        with self._retired_lock:
            self._retired.append(handle)
            excess, self._retired = self._retired[:-_MAX_RETIRED], self._retired[-_MAX_RETIRED:]
        if excess:   # never on this thread (the heartbeat's, often): their ops may still run, and the drop waits
            threading.Thread(target=excess.clear, name="pathways-group-release", daemon=True).start()

    def _prune_retired(self) -> None:
        """Let go of the abandoned groups that are quiet: no op given up on still runs in them (a killed peer's
        connection resets at once), or older than their timeout plus a grace (gloo's own timeout ended them).
        On the compute thread, before it forms a group: it runs no collective then, so dropping a group joins
        idle threads only (the heartbeat thread, which abandons, must never wait for one)."""
        now = time.monotonic()
        with self._retired_lock:
            release = [h for h in self._retired if h.quiet() or now - h.retired_at > h.timeout_s + _GRACE_S]
            self._retired = [h for h in self._retired if h not in release]
        # `release` goes when this returns, outside the lock.

    def _rendezvous(self, prefix: str, size: int, timeout_s: float):
        """The store a group meets through: the controller's, under the group's prefix (``group-G/epoch-E``)."""
        import torch.distributed as dist

        if self._store_factory is None:
            raise RuntimeError("this CollectiveRuntime has no rendezvous store (store_factory): it cannot form "
                               "groups")
        if self._store is None:
            self._store = self._store_factory()
        self._store.set_timeout(datetime.timedelta(seconds=timeout_s))
        return dist.PrefixStore(prefix, self._store)

    def bind(self, axis_groups, seq: int = 0, cache=None):
        """A context manager binding mesh axes to group ids on this thread (for computation ``seq``).

        ``cache``: an object with a ``binding`` slot (a program's step, run again and again)
        that keeps the resolved groups once every one is usable — a group, once formed, is
        never re-formed under the same id.
        """
        binding = getattr(cache, "binding", None)
        if binding is None:
            resolved = self._resolve(axis_groups)
            binding = AxisBinding(self._local, self.native, resolved)
            if cache is not None and not any(isinstance(v, str) for v in resolved.values()):
                cache.binding = binding
                binding.hold()
        return binding

    # ------------------------------------------------------------ the ops

    def _handle(self, name: str, axis: str):
        """The group bound to ``axis`` on this thread; None inside `dry_runs()` with nothing bound."""
        binding = getattr(self._local, "binding", None)
        if binding is None:
            if getattr(_dry, "on", False):
                return None
            raise RuntimeError(f"{name} on axis {axis!r} ran outside a bound computation (no process group on this "
                               f"thread): a bug of the executor; warm-up runs must use executor.collectives.dry_runs()")
        bound = binding.get(axis)
        if bound is None:
            raise RuntimeError(f"{name}: axis {axis!r} has no process group on this executor "
                               f"(bound axes: {sorted(binding)})")
        if isinstance(bound, str):
            raise (CollectiveAbandoned if isinstance(bound, AbandonedReason) else RuntimeError)(f"{name}: {bound}")
        if bound.abandoned:
            raise CollectiveAbandoned(f"{name} on axis {axis!r}: {bound.abandoned}")
        return bound

    def start(self, name: str, x, axis: str, size: int = 1, dim: int = 0):
        """Issue an all-gather now; its `result()` waits for it. Between the two, the computation runs the ops
        before the gather's first reader: the gather of the next unit overlaps the current one's compute. Every
        member issues its collectives in the same graph order, so gloo pairs them as it pairs blocking ones."""
        if name != "all_gather":
            raise ValueError(f"only all_gather is issued ahead, not {name}")
        from pathways_torch.wire.collective_ops import Ready

        handle = self._handle(name, axis)
        if handle is None:
            return Ready(_dry_run(name, x, size=size, dim=dim))
        if handle.on_host:   # a host group's gather runs now, on this thread (memory copies)
            return Ready(self._traced(f"all_gather {axis} {x.nbytes} B (ahead)", _host_op, handle.group, name,
                                      x.contiguous(), dim=dim))
        import torch

        parts = [torch.empty_like(x) for _ in range(handle.size)]
        work = handle.group.allgather([parts], [x.contiguous()])
        return _PendingGather(handle, work, parts, dim, self.trace, f"all_gather {axis} {x.nbytes} B (ahead)")

    def run(self, name: str, x, axis: str, **kwargs):
        handle = self._handle(name, axis)
        if handle is None:
            return _dry_run(name, x, **kwargs)
        kwargs.pop("size", None)  # the traced axis size; the group's own size is authoritative
        label = f"{name} {axis} {x.nbytes} B"
        if handle.on_host:
            return self._traced(label, _host_op, handle.group, name, x.contiguous(), **kwargs)
        return self._traced(label, self._ops[name], handle, handle.size, x.contiguous(), **kwargs)

    def _traced(self, label: str, run_op, *args, **kwargs):
        """``run_op(*args, **kwargs)``, a collective span in the trace around it."""
        trace = self.trace
        if trace is not None:
            trace.record("collective_start", label)
        try:
            return run_op(*args, **kwargs)
        finally:
            if trace is not None:
                trace.record("collective_end", label)

    def _resolve(self, axis_groups) -> dict:
        """Mesh axis -> (group, size), or the reason the axis's group is unusable."""
        resolved = {}
        for axis, group_id in axis_groups.items():
            group = self._groups.get(group_id)
            if group is None:
                # Not formed here, made before a fault of the island: abandoned like those formed (`form`).
                abandoned = group_id in self._abandoned_ids or group_id < self._abandoned_below
                why = self._failures.get(group_id) or (
                    "made before a fault of its island and never formed here" if abandoned else
                    f"it was never formed (groups abandoned below {self._abandoned_below}; faults heard: "
                    f"{len(self.abandoned)})")
                reason = f"process group {group_id} for axis {axis!r} is unusable: {why}"
                resolved[axis] = AbandonedReason(reason) if abandoned else reason
            else:
                resolved[axis] = group
        return resolved

    def _all_reduce(self, handle, size, x, op):
        out = x.clone()
        handle.wait(handle.group.allreduce([out], _reduce_options(op)))
        return _mean(out, size) if op == "mean" else out

    def _all_gather(self, handle, size, x, dim):
        import torch

        parts = [torch.empty_like(x) for _ in range(size)]
        handle.wait(handle.group.allgather([parts], [x]))
        return torch.cat(parts, dim=dim)

    def _reduce_scatter(self, handle, size, x, op, dim):
        import torch

        group = handle.group
        if op == "max" or not (x.device.type == "cuda" or x.dtype in (torch.float32, torch.float64)):
            # gloo's reduce_scatter does not take every dtype on CPU (int64 hung here, measured):
            # all-reduce and keep our slice.
            reduced = self._all_reduce(handle, size, x, op)
            return reduced.chunk(size, dim=dim)[group.rank()].contiguous()
        chunks = [c.contiguous() for c in x.chunk(size, dim=dim)]
        out = torch.empty_like(chunks[group.rank()])
        handle.wait(group.reduce_scatter([out], [chunks], _reduce_scatter_sum()))
        return _mean(out, size) if op == "mean" else out


class _Group:
    """A formed process group, its members' incarnations, and whether it was abandoned (a member lost).

    ``native``: the extension's side of the groups (`CollectiveRuntime.native`), where this executor's backend
    runs collectives inside XLA executables: the group is registered there too (``slot``), abandoned and let go
    with this object."""

    __slots__ = ("group", "size", "members", "abandoned", "timeout_s", "retired_at", "_pending", "_event", "_sliced",
                 "_native", "slot", "_holders", "on_host", "__weakref__")

    def __init__(self, group, size: int, members: frozenset, sliced: bool = True, timeout_s: float = 60.0,
                 native=None):
        self.group, self.size, self.members, self._sliced = group, size, members, sliced
        self.on_host = isinstance(group, ShmGroup)   # its ops run in the library, on the calling thread
        self.abandoned = ""                 # why, once a member was lost
        self.timeout_s, self.retired_at = timeout_s, 0.0
        self._pending: list = []            # ops given up on (abandoned while waited for): they may still run
        self._event = threading.Event()     # set when abandoned: a blocked wait gives up
        # Weak references to the cached bindings that resolved an axis to this group (a program's step, a call
        # site's step: kept as long as the program or the cache of call sites). Abandoning the group takes it out of
        # them, or each would keep it, its gloo threads and sockets, for good: one more per executor replacement.
        self._holders: list = []
        self._native, self.slot = (native, native.register(group)) if native is not None and sliced else (None, -1)
        if self._native is not None:
            weakref.finalize(self, self._native.release, self.slot)

    def abandon(self, reason: str) -> None:
        self.abandoned = reason
        self.retired_at = time.monotonic()
        self._event.set()
        if self.on_host:
            self.group.abandon()
        if self._native is not None:
            self._native.abandon(self.slot, reason)
        for held_by in list(self._holders):    # a copy: the compute thread may add one meanwhile (`held_by`)
            binding = held_by()
            if binding is not None:
                binding.let_go(self)
        self._holders.clear()

    def held_by(self, binding: "AxisBinding") -> None:
        """``binding`` keeps this group (a cached one): let go of it there once abandoned."""
        self._holders.append(weakref.ref(binding))
        if self.abandoned:    # abandoned between its resolution and now (the heartbeat thread): at once
            binding.let_go(self)

    def quiet(self) -> bool:
        """No op given up on still runs here: dropping the group joins idle threads only."""
        return all(work.is_completed() for work in self._pending) and (
            self._native is None or self._native.quiet(self.slot))

    def wait(self, work) -> None:
        """Wait for ``work`` in slices, so that abandoning the group ends the wait within one slice.

        A slice that ends before the op costs nothing but a raised-and-caught timeout (an op longer than
        the slice); an op that completes in time returns at once, as a plain ``wait()`` would.
        """
        if not self._sliced:
            work.wait()
            return
        while True:
            try:
                work.wait(_WAIT_SLICE)
                return
            except RuntimeError:
                if work.is_completed():
                    # Completed meanwhile (or failed: a peer's connection reset, gloo's timeout): its own outcome,
                    # not the slice's timeout.
                    work.wait()
                    return
                if self._event.is_set():
                    self._pending.append(work)
                    raise CollectiveAbandoned(f"collective abandoned: {self.abandoned}") from None


_WAIT_SLICE = datetime.timedelta(milliseconds=200)
# controller.rendezvous.FORMED_KEY (not imported: the executor does not import the controller package).
_FORMED_KEY = "pathways-formed"
# Abandoned groups kept while an op may run in them; a group older than its timeout plus this is let go anyway.
_MAX_RETIRED = 8
_GRACE_S = 5.0


def _mark_formed(store, group_id: int) -> None:
    """The group stands here: tell the store, which forgets its keys once every member has (an NCCL group connects
    at its first collective, reading them then: its keys go when it is abandoned). Best effort: the group is formed
    whatever the store answers, and failing it here alone would put this member out of step with the others."""
    try:
        store.add(_FORMED_KEY, 1)
    except Exception as exc:
        log.warning("group %d formed, but the rendezvous store did not take its mark (%s): its keys stay until the "
                    "group is abandoned", group_id, exc)


@functools.cache
def _reduce_options(op: str):
    """The gloo/NCCL options of a reduction, made once (each costs microseconds per collective)."""
    import torch.distributed as dist

    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
    return options


@functools.cache
def _reduce_scatter_sum():
    import torch.distributed as dist

    options = dist.ReduceScatterOptions()
    options.reduceOp = dist.ReduceOp.SUM
    return options


class _PendingGather:
    """An all-gather in flight: `result` waits for it (abandoning its group ends the wait) and concatenates. The
    trace's collective span is the wait, the time the computation was held up."""

    __slots__ = ("handle", "work", "parts", "dim", "trace", "label")

    def __init__(self, handle, work, parts: list, dim: int, trace, label: str):
        self.handle, self.work, self.parts, self.dim, self.trace, self.label = handle, work, parts, dim, trace, label

    def result(self):
        import torch

        if self.trace is not None:
            self.trace.record("collective_start", self.label)
        try:
            self.handle.wait(self.work)
        finally:
            if self.trace is not None:
                self.trace.record("collective_end", self.label)
        parts, self.parts = self.parts, None
        return torch.cat(parts, dim=self.dim)


def _host_op(group: ShmGroup, name: str, x, op: str = "sum", dim: int = 0):
    """``name`` on a host group (mean: the sum, divided here as for gloo)."""
    reduce = "sum" if op == "mean" else op
    if name == "all_gather":
        return group.all_gather(x, dim)
    out = group.all_reduce(x, reduce) if name == "all_reduce" else group.reduce_scatter(x, reduce, dim)
    return _mean(out, group.size) if op == "mean" else out


def _mean(total, size: int):
    """``total / size``, in place where the dtype allows: a copy would hold the reduced buffer twice (a whole
    gradient bucket, P under DataParallel on XLA, where one bucket per group is reduced at once)."""
    return total.div_(size) if total.is_floating_point() or total.is_complex() else total / size


def _dry_run(name: str, x, size: int = 1, dim: int = 0, **kwargs):
    import torch

    if name == "all_gather":
        return torch.cat([torch.zeros_like(x)] * size, dim=dim)
    if name == "reduce_scatter":
        return torch.zeros_like(x).chunk(size, dim=dim)[0].contiguous()
    return torch.zeros_like(x)
