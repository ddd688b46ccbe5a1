"""The resource manager: executors, their devices and islands, and mesh allocation."""

from __future__ import annotations

import dataclasses
import math
import time

from pathways_torch.errors import PlacementError

__all__ = ["ExecutorInfo", "MeshAllocation", "ResourceManager"]


@dataclasses.dataclass
class ExecutorInfo:
    executor_id: str
    index: int
    data_address: str
    device: str
    backend: str
    pid: int
    island: int = 0
    last_heard: float = dataclasses.field(default_factory=time.monotonic)
    lost: bool = False
    public_key: bytes = b""       # CURVE public key (Z85) of its data socket, checked by the server
    command_address: str = ""     # its command ROUTER, where control messages go


@dataclasses.dataclass(frozen=True)
class MeshAllocation:
    """Executors laid out on named axes, row-major (the last axis varies fastest)."""

    mesh_id: int
    axes: tuple[tuple[str, int], ...]
    executor_ids: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.executor_ids)

    def axis_members(self, axis: str, position: int) -> tuple[str, ...]:
        """The executors that share every coordinate with ``position`` except along ``axis``."""
        names = [name for name, _ in self.axes]
        sizes = [size for _, size in self.axes]
        if axis not in names:
            raise PlacementError(f"the mesh has axes {names}, not {axis!r}")
        coords, rest = [], position
        for size in reversed(sizes):
            coords.append(rest % size)
            rest //= size
        coords.reverse()
        members = []
        which = names.index(axis)
        for i in range(sizes[which]):
            coords[which] = i
            flat = 0
            for coord, size in zip(coords, sizes):
                flat = flat * size + coord
            members.append(self.executor_ids[flat])
        return tuple(members)

    def describe(self) -> str:
        axes = ", ".join(f"{name}={size}" for name, size in self.axes)
        return f"mesh {self.mesh_id} ({axes}) on {', '.join(self.executor_ids)}"


class ResourceManager:
    """Knows every executor (one island for now) and hands out meshes."""

    def __init__(self):
        self.executors: dict[str, ExecutorInfo] = {}
        self._next_mesh_id = 1

    def register(self, executor_id: str, **info) -> ExecutorInfo:
        existing = self.executors.get(executor_id)
        index = existing.index if existing else len(self.executors)
        record = ExecutorInfo(executor_id=executor_id, index=index, **info)
        self.executors[executor_id] = record
        return record

    def ordered(self) -> list[ExecutorInfo]:
        return sorted(self.executors.values(), key=lambda e: e.index)

    def allocate(self, axes: dict[str, int], executor_ids: list[str] | None = None) -> MeshAllocation:
        """A mesh over ``executor_ids`` (default: the first executors) with the given named axes."""
        if not axes:
            raise PlacementError("a mesh needs at least one named axis, e.g. {'data': 4}")
        for name, size in axes.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise PlacementError(f"mesh axis names must be identifiers, got {name!r}")
            if not isinstance(size, int) or size < 1:
                raise PlacementError(f"mesh axis {name!r}: expected a positive size, got {size!r}")
        needed = math.prod(axes.values())
        if executor_ids is None:
            available = [e.executor_id for e in self.ordered() if not e.lost]
            if needed > len(available):
                raise PlacementError(f"mesh {axes} needs {needed} executors, the cluster has {len(available)} live; "
                                     f"start more executors or use smaller axes")
            executor_ids = available[:needed]
        if len(executor_ids) != needed:
            raise PlacementError(f"mesh {axes} needs {needed} executors, got {len(executor_ids)}")
        if len(set(executor_ids)) != len(executor_ids):
            raise PlacementError(f"a mesh may use each executor once, got {executor_ids}")
        unknown = [e for e in executor_ids if e not in self.executors]
        if unknown:
            raise PlacementError(f"unknown executors {unknown}; known: {sorted(self.executors)}")
        mesh = MeshAllocation(self._next_mesh_id, tuple(axes.items()), tuple(executor_ids))
        self._next_mesh_id += 1
        return mesh
