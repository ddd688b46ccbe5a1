"""The messages that cross the client↔controller seam: plain frozen data, the same in-process and on the wire.

What the client asks (`CallSpec`, `ProgramSpec`, and the meshes it names, `MeshAllocation`) and what it hears back
(`ExecutorView`, `ArraySettled`, `ControllerCounters`). They live here, in the wire package every part may import,
because both ends build them: the controller (embedded, or `pathways-controller` serving remote clients through
`seam_codec`) and the client. Nothing here holds a lock, an event or a reference to either end.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

from pathways_torch.errors import PlacementError

from . import pathways_pb2 as pb

__all__ = ["MeshAllocation", "CallSpec", "ProgramSpec", "ExecutorView", "ArraySettled", "ControllerCounters",
           "SeamOp", "OPS", "op_from_wire", "RegisterFunction", "RegisterProgram", "DescribeProgram", "Forget", "Call",
           "RunProgram", "GrantIds", "NewArray", "Landed", "Release", "ReleaseMany", "FlushFrees", "AllocateMesh",
           "IslandOf", "Executors", "Executor", "WaitForExecutors", "CheckpointRoot", "ReplaceExecutor", "Gather",
           "Counters", "RunaheadWaits", "NoteRunaheadWait", "Bye"]


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


@dataclasses.dataclass(frozen=True, slots=True)
class ArraySettled:
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


# ------------------------------------------------------------ the operations a client asks of the controller

_IDS = (list, tuple)
_NUMBER = (int, float)


class SeamOp:
    """One operation a client asks of the controller: a frozen dataclass, handled once (`ClientOps.handle`, by its
    type), the same in-process and on the wire. On the wire it travels as ``{"r": id, "op": NAME, "a": [its fields
    in order]}`` (`seam_codec`); `op_from_wire` builds it back, and checks its fields' types (``FIELD_TYPES``: what
    `isinstance` accepts for each field, in order; `check_types`), since a remote client sends plain data only.
    One built in this process by the client library is not checked again: the check cost 29 µs of an OpByOp call's
    client CPU (6 operations a call), measured by issue 48's A/B."""

    NAME: ClassVar[str] = ""
    FIELD_TYPES: ClassVar[tuple] = ()
    # The client waits for its answer (False: sent and not waited for). A remote client sends a `Call`, and a run of
    # a program it registered, without waiting too: it names their outputs with ids granted before (`GrantIds`).
    ANSWERED: ClassVar[bool] = True
    MAKES_ARRAYS: ClassVar[bool] = False  # its answer is a list of array records the client follows from then on
    OUTPUT_IDS_AT: ClassVar[int | None] = None   # the field naming its outputs' ids, if the client picks them

    def check_types(self) -> None:
        """TypeError unless each field is of its ``FIELD_TYPES`` entry."""
        for field, accepted in zip(dataclasses.fields(self), self.FIELD_TYPES):
            value = getattr(self, field.name)
            if not isinstance(value, accepted):
                raise TypeError(f"request {self.NAME!r}: argument {field.name!r} must be "
                                f"{_type_names(accepted)}, got {type(value).__name__}")

    def wire_args(self) -> list:
        """Its fields in order: the ``"a"`` of its wire message."""
        return [getattr(self, field.name) for field in dataclasses.fields(self)]


def _type_names(accepted) -> str:
    kinds = accepted if isinstance(accepted, tuple) else (accepted,)
    return " or ".join("None" if kind is type(None) else kind.__name__ for kind in kinds)


def _op(name: str, *types, answered: bool = True, makes_arrays: bool = False, output_ids_at: int | None = None):
    """Declare a `SeamOp`: its wire name and its fields' types (the class body names the fields)."""
    def declare(cls):
        cls.NAME, cls.FIELD_TYPES, cls.ANSWERED, cls.MAKES_ARRAYS = name, types, answered, makes_arrays
        cls.OUTPUT_IDS_AT = output_ids_at
        return dataclasses.dataclass(frozen=True)(cls)
    return declare


@_op("register_function", str, pb.Graph, list, _NUMBER)
class RegisterFunction(SeamOp):
    """Register a captured function (a ``pb.Graph`` and its constants); answers its id."""
    name: str
    graph: object
    constants: list
    sim_seconds: float = 0.0


@_op("register_program", ProgramSpec)
class RegisterProgram(SeamOp):
    """Lower and register a program; answers its id."""
    spec: ProgramSpec


@_op("describe_program", int)
class DescribeProgram(SeamOp):
    """A registered program's lowered form, as text."""
    program_id: int


@_op("forget", _IDS, _IDS, answered=False)
class Forget(SeamOp):
    """The client will not call these functions, nor run these programs, again: the controller and executors let
    them go once their calls in flight end."""
    function_ids: Sequence[int]
    program_ids: Sequence[int]


@_op("call", CallSpec, (*_IDS, type(None)), makes_arrays=True, output_ids_at=1)
class Call(SeamOp):
    """Dispatch one call; its outputs' records (``output_ids``: ids this client was granted, in order; None: the
    controller picks). It may wait at the run-ahead bound."""
    spec: CallSpec
    output_ids: Sequence[int] | None = None


@_op("run_program", int, _IDS, (*_IDS, type(None)), makes_arrays=True, output_ids_at=2)
class RunProgram(SeamOp):
    """Run a registered program on these arrays; its outputs' records (``output_ids`` as for `Call`)."""
    program_id: int
    input_ids: Sequence[int]
    output_ids: Sequence[int] | None = None


@_op("grant_ids", int)
class GrantIds(SeamOp):
    """Reserve ``count`` array ids for the client to name its calls' outputs with; answers ``(first, count)``."""
    count: int


@_op("new_array", _IDS, int, int, makes_arrays=True)
class NewArray(SeamOp):
    """An array whose ``landing`` shards the client puts itself, straight to the executors (``shard_bytes`` each,
    for the controller's memory budget: it may wait for room, or raise `OutOfMemoryError`)."""
    executor_ids: Sequence[str]
    landing: int
    shard_bytes: int = 0


@_op("landed", int, (BaseException, type(None)), answered=False)
class Landed(SeamOp):
    """One put shard arrived (or never will: ``error``)."""
    array_id: int
    error: BaseException | None = None


@_op("release", int, answered=False)
class Release(SeamOp):
    """The client dropped the array: free its shards (the Free rides on the next message)."""
    array_id: int


@_op("release_many", _IDS, answered=False)
class ReleaseMany(SeamOp):
    """`Release` several, with one Free per executor."""
    array_ids: Sequence[int]


@_op("flush_frees", answered=False)
class FlushFrees(SeamOp):
    """Send the frees still waiting for a message to ride on."""


@_op("allocate_mesh", dict, (*_IDS, type(None)))
class AllocateMesh(SeamOp):
    """A `MeshAllocation` with these named axes (on these executors, or the first free ones)."""
    axes: dict
    executor_ids: Sequence[str] | None = None


@_op("island_of", str)
class IslandOf(SeamOp):
    """The island of a known executor."""
    executor_id: str


@_op("executors")
class Executors(SeamOp):
    """Every executor (`ExecutorView` s), in `Context.executor_ids` order."""


@_op("executor", str)
class Executor(SeamOp):
    """One executor's `ExecutorView`, or None if unknown."""
    executor_id: str


@_op("wait_for_executors", int, _NUMBER)
class WaitForExecutors(SeamOp):
    """Wait until ``count`` executors registered; raise `PathwaysError` after ``timeout_s``."""
    count: int
    timeout_s: float


@_op("checkpoint_root")
class CheckpointRoot(SeamOp):
    """A service client's own folder of the checkpoint root, ``DIR/<name>`` (its checkpoints live there alone:
    `pathways_torch.wire.checkpoint_paths`); None for the embedded client (its paths are its own)."""


@_op("replace_executor", str, _NUMBER)
class ReplaceExecutor(SeamOp):
    """Have the controller replace a lost executor (it started it; else await the one its operator starts)."""
    executor_id: str
    timeout_s: float


@_op("gather", str)
class Gather(SeamOp):
    """Ask every live executor for ``"stats"`` or ``"trace"``; their reply envelopes, by executor id."""
    kind: str


@_op("counters")
class Counters(SeamOp):
    """The controller's own counts (`ControllerCounters`)."""


@_op("runahead_waits")
class RunaheadWaits(SeamOp):
    """Waits at the run-ahead bound: ``(start ns, end ns, in flight, what)``, the client's and the controller's."""


@_op("note_runahead_wait", int, int, int, str, answered=False)
class NoteRunaheadWait(SeamOp):
    """Keep a wait of the client's at the run-ahead bound, for the trace."""
    start_ns: int
    end_ns: int
    in_flight: int
    what: str


@_op("bye")
class Bye(SeamOp):
    """The client closes its context: the controller frees what it holds (its executors serve the others on)."""


OPS: dict[str, type[SeamOp]] = {cls.NAME: cls for cls in (
    RegisterFunction, RegisterProgram, DescribeProgram, Forget, Call, RunProgram, GrantIds, NewArray, Landed, Release,
    ReleaseMany, FlushFrees, AllocateMesh, IslandOf, Executors, Executor, WaitForExecutors, CheckpointRoot,
    ReplaceExecutor, Gather, Counters, RunaheadWaits, NoteRunaheadWait, Bye)}


def op_from_wire(name, args: list) -> SeamOp:
    """The operation a wire message names, built from its arguments (checked: `SeamOp`); TypeError if it names none
    of `OPS` or its arguments do not fit."""
    cls = OPS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise TypeError(f"request {str(name)[:40]!r}: expected one of the {len(OPS)} operations of "
                        f"pathways_torch/wire/seam.py (OPS)")
    fields = dataclasses.fields(cls)
    if len(args) != len(fields):
        raise TypeError(f"request {name!r} with {len(args)} argument(s): expected {len(fields)} "
                        f"({', '.join(field.name for field in fields) or 'none'})")
    op = cls(*args)
    op.check_types()
    return op
