"""The resource manager: executors, their devices and islands, and mesh allocation."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

from pathways_torch.errors import ExecutorLostError, PlacementError
from pathways_torch.wire.seam import MeshAllocation

__all__ = ["ExecutorInfo", "MeshAllocation", "ResourceManager", "DEFAULT_ISLAND", "ISLAND_AXIS"]

DEFAULT_ISLAND = "0"     # the island of an executor that names none
ISLAND_AXIS = "island"   # the one mesh axis that may span islands: it must be the outermost


@dataclasses.dataclass
class ExecutorInfo:
    executor_id: str
    index: int
    data_address: str
    device: str
    backend: str
    pid: int
    island: str = DEFAULT_ISLAND
    last_heard: float = dataclasses.field(default_factory=time.monotonic)
    lost: bool = False
    pinged: bool = False          # a heartbeat of this incarnation arrived (until then it may still be connecting)
    public_key: bytes = b""       # CURVE public key (Z85) of its data socket, checked by the server
    command_address: str = ""     # its command ROUTER, where control messages go
    link_address: str = ""        # where other islands send it transfers (a shaped link's relay), if not direct
    transfer_address: str = ""    # where its island's peers send it transfers (read by its compute thread), if any
    epoch: int = 1                # registrations of this id so far (a restarted executor registers again)
    draining: bool = False        # the operator drains it: no new work, removed once idle (controller/admin.py)


class ResourceManager:
    """Knows every executor and its island, and hands out meshes (island by island)."""

    def __init__(self):
        self.executors: dict[str, ExecutorInfo] = {}
        # Mesh ids: next() of a count is one step under the GIL, so two clients' workers never share an id.
        self._mesh_ids = itertools.count(1)

    def register(self, executor_id: str, **info) -> ExecutorInfo:
        existing = self.executors.get(executor_id)
        index = existing.index if existing else len(self.executors)
        epoch = existing.epoch + 1 if existing else 1
        record = ExecutorInfo(executor_id=executor_id, index=index, epoch=epoch, **info)
        self.executors[executor_id] = record
        return record

    def ordered(self) -> list[ExecutorInfo]:
        return sorted(self.executors.values(), key=lambda e: e.index)

    def islands(self) -> dict[str, list[ExecutorInfo]]:
        """Every island's executors, in registration order; islands by name ("2" before "10")."""
        out: dict[str, list[ExecutorInfo]] = {}
        for info in self.ordered():
            out.setdefault(info.island, []).append(info)
        return {name: out[name] for name in sorted(out, key=lambda n: (not n.isdigit(), int(n) if n.isdigit()
                                                                       else 0, n))}

    def island_of(self, executor_id: str) -> str:
        return self.executors[executor_id].island

    def check_live(self, executor_ids) -> None:
        """Refuse work for a mesh with a lost executor, or one the operator drains."""
        for executor_id in executor_ids:
            info = self.executors.get(executor_id)
            if info is not None and info.lost:
                raise ExecutorLostError(f"executor {executor_id} was lost; a mesh that includes it cannot run",
                                        executor_id=executor_id)
            if info is not None and info.draining:
                raise ExecutorLostError(f"executor {executor_id} is being drained by the operator: it takes no new "
                                        f"work; use a mesh without it", executor_id=executor_id)

    def route(self, source: str, destination: str) -> tuple[str, bool]:
        """Where ``source`` sends a transfer to ``destination``, and whether that is its transfer inbox: through the
        link between islands when they differ and a link is set up, else straight to its transfer inbox (its
        compute thread reads it, and the sender's compute thread sends there), or its data socket where it has none
        (a simulated executor)."""
        target = self.executors[destination]
        if target.link_address and self.executors[source].island != target.island:
            return target.link_address, False
        if target.transfer_address:
            return target.transfer_address, True
        return target.data_address, False

    def allocate(self, axes: dict[str, int], executor_ids: list[str] | None = None) -> MeshAllocation:
        """A mesh over ``executor_ids`` (default: chosen island by island) with the given named axes.

        A mesh lies inside one island, or spans islands only on an outer ``"island"`` axis: its
        position i on that axis is the i-th island with room, and the inner axes map to that
        island's executors (each island keeps its own collectives and gang order).
        """
        _check_axes(axes)
        needed = math.prod(axes.values())
        spans = ISLAND_AXIS in axes
        if spans and next(iter(axes)) != ISLAND_AXIS:
            raise PlacementError(f"mesh {axes}: the {ISLAND_AXIS!r} axis must be the first (outermost) axis: a "
                                 f"mesh may span islands only there; write {{{ISLAND_AXIS!r}: "
                                 f"{axes[ISLAND_AXIS]}, ...}}")
        if executor_ids is None:
            executor_ids = self._choose(axes, needed)
        if len(executor_ids) != needed:
            raise PlacementError(f"mesh {axes} needs {needed} executors, got {len(executor_ids)}")
        if len(set(executor_ids)) != len(executor_ids):
            raise PlacementError(f"a mesh may use each executor once, got {executor_ids}")
        unknown = [e for e in executor_ids if e not in self.executors]
        if unknown:
            raise PlacementError(f"unknown executors {unknown}; known: {sorted(self.executors)}")
        self._check_islands(axes, list(executor_ids))
        return MeshAllocation(next(self._mesh_ids), tuple(axes.items()), tuple(executor_ids))

    def _choose(self, axes: dict[str, int], needed: int) -> list[str]:
        """The first live executors that fit: of one island, or of the first ``axes["island"]`` islands."""
        live = {name: [e.executor_id for e in members if not e.lost and not e.draining]
                for name, members in self.islands().items()}
        counts = {name: len(ids) for name, ids in live.items()}
        if ISLAND_AXIS in axes:
            count, per = axes[ISLAND_AXIS], needed // axes[ISLAND_AXIS]
            fitting = [name for name, ids in live.items() if len(ids) >= per]
            if len(fitting) < count:
                raise PlacementError(f"mesh {axes} asks for {count} islands of {per} live executors; the cluster "
                                     f"has islands {counts} (live executors per island); use fewer islands or "
                                     f"smaller inner axes")
            return [e for name in fitting[:count] for e in live[name][:per]]
        for ids in live.values():
            if len(ids) >= needed:
                return ids[:needed]
        total = sum(counts.values())
        if needed <= total and len(counts) > 1:
            raise PlacementError(f"mesh {axes} needs {needed} executors in one island, and no island has that many "
                                 f"(live executors per island: {counts}); a mesh spans islands only on an outer "
                                 f"{ISLAND_AXIS!r} axis, e.g. {{{ISLAND_AXIS!r}: {len(counts)}, ...}}")
        raise PlacementError(f"mesh {axes} needs {needed} executors, the cluster has {total} live; "
                             f"start more executors or use smaller axes")

    def _check_islands(self, axes: dict[str, int], executor_ids: list[str]) -> None:
        """Refuse a mesh whose inner axes would split an island's work across islands."""
        islands = [self.executors[e].island for e in executor_ids]
        count = axes.get(ISLAND_AXIS, 1)
        per = len(executor_ids) // count
        blocks = [islands[i * per:(i + 1) * per] for i in range(count)]
        mixed = [b for b in blocks if len(set(b)) > 1]
        firsts = [b[0] for b in blocks]
        if mixed or len(set(firsts)) != len(firsts):
            raise PlacementError(
                f"mesh {axes} on executors {executor_ids} (islands {islands}) splits an island on an inner axis: "
                f"every position of the {ISLAND_AXIS!r} axis must be one island, each a different one"
                + ("" if ISLAND_AXIS in axes else f"; add an outer {ISLAND_AXIS!r} axis or pick executors of one "
                                                  f"island"))


def _check_axes(axes: dict[str, int]) -> None:
    if not axes:
        raise PlacementError("a mesh needs at least one named axis, e.g. {'data': 4}")
    for name, size in axes.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise PlacementError(f"mesh axis names must be identifiers, got {name!r}")
        if not isinstance(size, int) or size < 1:
            raise PlacementError(f"mesh axis {name!r}: expected a positive size, got {size!r}")
