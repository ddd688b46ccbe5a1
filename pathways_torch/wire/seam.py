"""The messages that cross the client↔controller seam: plain frozen data, the same in-process and on the wire.

What the client asks (`CallSpec`, `ProgramSpec`, and the meshes it names, `MeshAllocation`) and what it hears back
(`ExecutorView`, `ArraySettled`, `ControllerCounters`). They live here, in the wire package every part may import,
because both ends build them: the controller (embedded, or `pathways-controller` serving remote clients through
`seam_codec`) and the client. Nothing here holds a lock, an event or a reference to either end.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from pathways_torch.errors import PlacementError

__all__ = ["MeshAllocation", "CallSpec", "ProgramSpec", "ExecutorView", "ArraySettled", "ControllerCounters"]


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class CallSpec:
    """One call of a captured function on a mesh.

    Called alone, ``inputs`` are array ids and ``num_outputs`` says how many arrays it makes. As a program's
    node, ``inputs`` and ``outputs`` are the program's value ids, and ``num_outputs`` defaults to how many
    ``outputs`` it names.
    """

    function_id: int
    name: str
    mesh: MeshAllocation
    inputs: tuple[int, ...]
    outputs: tuple[int, ...] = ()     # a program's node: the values it makes
    num_outputs: int | None = None    # None: len(outputs)
    replicated_outputs: tuple[bool, ...] = ()   # outputs declared Replicate()
    debug: bool = False               # digest replicated outputs and compare them
    call_site: str = ""
    collective_axes: tuple[str, ...] = ()
    report_shapes: bool = False       # output sizes depend on the data: executors report them
    # Where output i sits among the function's outputs (its Done digests): a program node's
    # call covers only the outputs that are program outputs. Empty: output i is output i.
    output_positions: tuple[int, ...] = ()
    # The bytes of one shard of each output (its block's elements times its dtype's size), for the controller's
    # memory budget (controller/memory.py). Empty, or 0 for an output: unknown (its size depends on the data).
    output_shard_bytes: tuple[int, ...] = ()
    # Input positions the client gives up with this call (it will never name those arrays again): each executor
    # frees its shard as the run arrives, so the run frees it at its last use (a training step's old state).
    donated: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_outputs is None:
            object.__setattr__(self, "num_outputs", len(self.outputs))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgramSpec:
    """A traced program: its input values (on their meshes), its nodes (each a call of a function on a mesh, whose
    inputs and outputs are values), and the values it returns."""

    name: str
    input_values: tuple[int, ...]
    input_meshes: tuple[MeshAllocation, ...]
    nodes: tuple[CallSpec, ...]
    output_values: tuple[int, ...]

    def value_meshes(self) -> dict[int, MeshAllocation]:
        where = dict(zip(self.input_values, self.input_meshes))
        for node in self.nodes:
            for value in node.outputs:
                where[value] = node.mesh
        return where


@dataclasses.dataclass(frozen=True, slots=True)
class ExecutorView:
    """One executor as the controller knows it, at one moment (a snapshot: ask again for news)."""

    executor_id: str
    index: int                 # its place in `Context.executor_ids`
    pid: int
    island: str
    device: str
    backend: str
    lost: bool
    epoch: int                 # its incarnation (1, then one more per replacement)
    data_address: str          # where tensor bytes reach it
    public_key: bytes          # its data socket's CURVE key
    link_address: str = ""     # where other islands' transfers reach it (a shaped link's relay), if not direct
    label: str = ""            # what errors call its node ("node 1 at 10.0.0.2"), if launched
    seconds_since_heartbeat: float = 0.0


class ArraySettled(NamedTuple):
    """Event: an array's state changed (computed, failed, or a holder of one of its shards was lost)."""

    array_id: int
    state: str                                   # READY or FAILED (PENDING: only a holder was lost)
    error: BaseException | None = None
    block_shape: tuple[int, ...] | None = None   # the sizes the data decided, when they depended on it
    lost_holders: tuple[str, ...] = ()
    put_token: bytes = b""                       # what lets its owner put its shards (a service client's put)


@dataclasses.dataclass(frozen=True)
class ControllerCounters:
    """The controller's own counts, for `Context.stats` (copies: they do not change after)."""

    relayed_bytes: int                # payload bytes through the controller's sockets, graph constants aside
    program_constant_bytes: int       # graph constants sent with functions: the only tensor bytes it sends
    messages_sent: dict               # by kind ("run", "run_program", "heartbeat" ...)
    dropped_messages: int
    refused_connections: int
    inflight_high_water: int
    send_backlog_high_water: int
    transfers_lost: int
    calls_failed_by_lost_transfers: int
    handled_messages: dict            # "control:done" ..., "heartbeat", "store": reached their handler
    calls_in_flight: int
    arrays: int                       # arrays the controller keeps a record of
