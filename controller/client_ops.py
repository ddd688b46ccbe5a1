"""What one client may ask of the controller, in the seam's plain terms: `ClientOps`.

Both clients of the controller go through it: the embedded one (`pathways_torch.client.InProcessClient`) and each
remote client of `pathways-controller` (`client_service.ClientService`). It answers with snapshots
(`ExecutorView`, `ControllerCounters`) and array records, never the controller's mutable tables.

It also scopes what a client names to what it owns (DESIGN §10, docs/service.md): the arrays, functions and
programs it was handed, so a client can neither read, free, call nor name another's. An id that is not the
client's is refused exactly like one that never existed: its owner is not revealed either.

When the client leaves, `release_everything` closes it: whatever a request still running then (a call that was
being dispatched, a put's new array waiting for memory) adds afterwards is undone at once, its budget given back,
and the request fails with `ClientGone`; one still waiting for executor memory stops waiting as the client is
disconnected (`stop_waiting`, `MemoryBudget.forget_client`). Its puts still landing are abandoned: their tokens are spent with the
arrays' Free, so a shard that comes later is refused by its executor, never kept.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Sequence

from pathways_torch.wire.limits import Bounds, bounded
from pathways_torch.wire.op_allowlist import check_service_graph
from pathways_torch.wire.seam import (OPS, AllocateMesh, ArraySettled, Bye, Call, CallSpec, CheckpointRoot,
                                     ControllerCounters, Counters, DescribeProgram, Executor, Executors, ExecutorView,
                                     FlushFrees, Forget, Gather, GrantIds, IslandOf, Landed, MeshAllocation, NewArray,
                                     NoteRunaheadWait, RegisterFunction, RegisterProgram, Release, ReleaseMany,
                                     ReplaceExecutor, RunaheadWaits, RunProgram, SeamOp, WaitForExecutors)

from .arrays import ArrayRecord
from .config import ServiceConfig
from .graph_limits import check_graph, check_program
from .shares import ClientGone

_WAIT_S = Bounds(0.0, 600.0)   # how long a request may wait for executors to register
_WHAT_CHARS = 200              # of a run-ahead wait's description a client sends

__all__ = ["ClientOps", "executor_view", "controller_counters", "settled", "NotYoursError"]

# Operation type → its one handler (a `ClientOps` method, declared with `_handles`).
_HANDLERS: dict[type, Callable] = {}


def _handles(op_type: type[SeamOp]):
    def register(method):
        _HANDLERS[op_type] = method
        return method
    return register


class NotYoursError(ValueError):
    """A client named an array, function, program or mesh it does not hold (or that never existed)."""


def executor_view(controller, info) -> ExecutorView:
    """One executor as the client sees it now."""
    return ExecutorView(
        executor_id=info.executor_id, index=info.index, pid=info.pid, island=info.island, device=info.device,
        backend=info.backend, lost=info.lost, epoch=info.epoch, data_address=info.data_address,
        public_key=info.public_key, link_address=info.link_address,
        label=controller.executor_labels.get(info.executor_id, ""),
        seconds_since_heartbeat=max(0.0, controller.clock() - info.last_heard))


def settled(record: ArrayRecord) -> ArraySettled:
    """An array record's state now, as the client hears it."""
    return ArraySettled(record.array_id, record.state, record.error, record.block_shape,
                        tuple(record.lost_holders), record.put_token)


def controller_counters(controller, server) -> ControllerCounters:
    """The controller's counts (its sockets' too), as copies: each read off the part that counts it."""
    payload, dispatch, completion = server.payload_bytes, controller.call_dispatch, controller.completion
    return ControllerCounters(
        relayed_bytes=payload["sent"] + payload["received"] - dispatch.program_constant_bytes,
        program_constant_bytes=dispatch.program_constant_bytes,
        messages_sent=dict(controller.messages_sent),
        dropped_messages=server.dropped_messages + controller.dropped_messages,
        refused_connections=server.refused_connections,
        inflight_high_water=dispatch.run_ahead.high_water,
        send_backlog_high_water=server.loop.backlog_high_water,
        transfers_lost=completion.transfers_lost,
        calls_failed_by_lost_transfers=completion.calls_failed_by_lost_transfers,
        handled_messages={**{f"control:{k}": n for k, n in controller.handled_messages.items()},
                          **server.handled_messages},
        calls_in_flight=dispatch.calls_in_flight, arrays=len(controller.arrays))


class ClientOps:
    """One client's requests over the controller, checked against what it owns (``owner``: its name)."""

    def __init__(self, controller, server, owner: str = "", limits: ServiceConfig | None = None, *,
                 checkpoint_root: str | None = None,
                 replace: Callable[[str, float], ExecutorView] | None = None):
        self.controller, self.server, self.owner = controller, server, owner
        # A service client's own folder of the root (`CheckpointRoot`); None for the embedded client.
        self.checkpoint_root = checkpoint_root
        # Makes or awaits a lost executor's replacement (`ReplaceExecutor`): the service's; the embedded context
        # replaces its executors itself.
        self.replace = replace
        # A remote client's programs and graphs are capped (`graph_limits`); the embedded one's are not.
        self.limits = limits or (ServiceConfig() if owner else None)
        self.arrays: set[int] = set()      # array ids handed to this client and not released
        self.functions: set[int] = set()
        self.programs: dict[int, object] = {}   # program id → its lowered form (describe_program)
        self.meshes: dict[int, MeshAllocation] = {}
        self._grants: collections.deque = collections.deque()   # (next, end) of each block of ids granted
        self._never_made: dict[int, BaseException] = {}   # output ids of calls that failed before dispatch
        # Guards what it holds against `release_everything` (another thread, the client gone): after it, `closed`
        # and nothing more is kept.
        self._held_lock = threading.Lock()
        self.closed = False

    def handle(self, op: SeamOp):
        """Run one operation of this client's: its one handler, by the operation's type."""
        handler = _HANDLERS.get(type(op))
        if handler is None:
            raise TypeError(f"ClientOps.handle: expected one of the operations of pathways_torch/wire/seam.py "
                            f"({', '.join(sorted(OPS))}), got {type(op).__name__}")
        return handler(self, op)

    def follow(self, records: list[ArrayRecord], listener_of: Callable, now: Callable | None = None
               ) -> list[ArraySettled]:
        """Each record's state now (also handed to ``now``, still under the lock: before any later change is
        heard), and ``listener_of(record)(record)`` on each change from then on: attached under the controller's
        lock, where every change happens, so none is missed between the two."""
        with self.controller.state.lock:
            snapshots = []
            for record in records:
                record.listener = listener_of(record)
                snapshots.append(settled(record))
                if now is not None:
                    now(snapshots[-1])
            return snapshots

    # ------------------------------------------------------------ functions, programs, calls

    @_handles(RegisterFunction)
    def register_function(self, op: RegisterFunction) -> int:
        name, graph, constants = op.name, op.graph, op.constants
        if self.limits is not None:   # a service client: bounded, and no op that hurts every tenant
            check_graph(graph, constants, self.limits, name)
            check_service_graph(graph)
        function_id = self.controller.call_dispatch.register_function(name, graph, constants,
                                                                      sim_seconds=float(op.sim_seconds))
        with self._held_lock:
            if not self.closed:
                self.functions.add(function_id)
                return function_id
        self.controller.call_dispatch.forget([function_id], ())
        raise self._gone(f"function {name!r} was being registered")

    @_handles(RegisterProgram)
    def register_program(self, op: RegisterProgram) -> int:
        spec = op.spec
        if self.limits is not None:
            check_program(spec, self.limits)
        for node in spec.nodes:
            self._check_call(node, inputs=False)
        for mesh in spec.input_meshes:
            self._check_mesh(mesh)
        lowered = self.controller.call_dispatch.register_program(spec)
        with self._held_lock:
            if not self.closed:
                self.programs[lowered.program_id] = lowered
                return lowered.program_id
        self.controller.call_dispatch.forget((), [lowered.program_id])
        raise self._gone(f"program {spec.name!r} was being registered")

    @_handles(DescribeProgram)
    def describe_program(self, op: DescribeProgram) -> str:
        return self._program(op.program_id).describe()

    @_handles(Call)
    def call(self, op: Call) -> list[ArrayRecord]:
        """``output_ids``: ids of this client's grants (`GrantIds`), in order; None: the controller picks."""
        spec, output_ids = op.spec, op.output_ids
        if output_ids is not None:   # first: the client moved past these ids whether the call goes or fails
            self._claim(output_ids, spec.num_outputs)
        self._check_call(spec, inputs=True)
        if any(not 0 <= i < len(spec.inputs) for i in spec.donated):
            raise ValueError(f"call of {spec.name!r}: donated input positions {list(spec.donated)} for "
                             f"{len(spec.inputs)} inputs")
        records = self._own(self.controller.call_dispatch.call(spec, self.owner, output_ids))
        # Given up with the call: freed now, so that naming them again is refused here rather than waited for on
        # the executors (which freed their shards as the run arrived).
        self._release(sorted({spec.inputs[i] for i in spec.donated}))
        return records

    @_handles(RunProgram)
    def run_program(self, op: RunProgram) -> list[ArrayRecord]:
        program_id, input_ids, output_ids = op.program_id, op.input_ids, op.output_ids
        lowered = self.programs.get(program_id)
        if output_ids is not None:   # first, as for a call (an unknown program's outputs: as many as named)
            self._claim(output_ids, len(lowered.spec.output_values) if lowered is not None else len(output_ids))
        lowered = self._program(program_id)
        self._check_arrays(input_ids)
        return self._own(self.controller.call_dispatch.run_program(program_id, input_ids, self.owner, output_ids))

    @_handles(GrantIds)
    def grant_ids(self, op: GrantIds) -> tuple[int, int]:
        """Reserve ``count`` array ids for this client to name its calls' outputs with (so it need not wait for
        each call's answer); ``(first, count)``. The client uses them in order."""
        count = op.count
        if not 1 <= count <= 1 << 20:
            raise ValueError(f"grant_ids({count}): expected 1 to {1 << 20} ids")
        with self.controller.state.lock:
            first = self.controller.arrays.reserve(count)
        self._grants.append((first, first + count))
        return first, count

    def _claim(self, output_ids: Sequence[int], expected: int) -> None:
        """The next ``expected`` ids of this client's grants must be ``output_ids``, in order."""
        if len(output_ids) != expected:
            raise ValueError(f"{len(output_ids)} output ids for a call with {expected} outputs")
        for array_id in output_ids:
            while self._grants and self._grants[0][0] >= self._grants[0][1]:
                self._grants.popleft()
            if not self._grants or array_id != self._grants[0][0]:
                raise NotYoursError(f"output id {array_id}: expected the next id this client was granted "
                                    f"({self._grants[0][0] if self._grants else 'none left: ask grant_ids'})")
            start, end = self._grants[0]
            self._grants[0] = (start + 1, end)

    # ------------------------------------------------------------ arrays

    @_handles(NewArray)
    def new_array(self, op: NewArray) -> list[ArrayRecord]:
        executor_ids = tuple(op.executor_ids)
        unknown = [e for e in executor_ids if e not in self.controller.resources.executors]
        if unknown:
            raise NotYoursError(f"new_array on executors {unknown}: expected known executors "
                                f"({sorted(self.controller.resources.executors)})")
        return self._own([self.controller.lifetimes.new_array(executor_ids, landing=op.landing, owner=self.owner,
                                                    shard_bytes=op.shard_bytes)])

    @_handles(Landed)
    def landed(self, op: Landed) -> None:
        array_id = op.array_id
        # Also for an array released while its put was landing (its record stays until the put lands).
        record = self.controller.arrays.get(array_id)
        if record is not None and record.owner != self.owner:
            raise NotYoursError(f"array {array_id} is not one this client holds; use the arrays your own puts made")
        self.controller.lifetimes.landed(array_id, op.error)

    @_handles(Release)
    def release(self, op: Release) -> None:
        array_id = op.array_id
        with self._held_lock:
            self._never_made.pop(array_id, None)
            if array_id not in self.arrays:   # twice, or never ours: nothing to free (a finalizer must not raise)
                return
            self.arrays.discard(array_id)
        self.controller.lifetimes.release(array_id)

    @_handles(ReleaseMany)
    def release_many(self, op: ReleaseMany) -> None:
        self._release(op.array_ids)

    def _release(self, array_ids: Sequence[int]) -> None:
        with self._held_lock:
            for array_id in array_ids:
                self._never_made.pop(array_id, None)
            ours = [a for a in array_ids if a in self.arrays]
            self.arrays.difference_update(ours)
        self.controller.lifetimes.release_many(ours)

    def stop_waiting(self) -> None:
        """A request of this client still waiting for executor memory ends now (ClientGone), not in 30 s. Called as
        the client is disconnected, before a new connection under its name may wait for memory of its own."""
        if self.owner:
            self.controller.memory.forget_client(self.owner)

    def release_everything(self) -> int:
        """The client is gone: close (nothing made for it from now on is kept) and free every array it holds, its
        puts still landing too (`Lifetimes.abandon_puts`); how many. Call it once its requests are stopped: one
        still running is undone where it adds its records (`_own`)."""
        with self._held_lock:
            self.closed = True
            held = sorted(self.arrays)
            self.arrays.clear()
            self._never_made.clear()
        self._free_for_good(held, self._gone("its puts were landing"))
        return len(held)

    def _free_for_good(self, array_ids: list[int], error: BaseException) -> None:
        """Free ``array_ids`` now, those still landing included, and send the frees (and spent put tokens) at once."""
        self.controller.lifetimes.abandon_puts(array_ids, error)
        self.controller.lifetimes.release_many(array_ids)
        self.controller.lifetimes.flush_frees()

    def _gone(self, what: str) -> ClientGone:
        who = f"client {self.owner!r}" if self.owner else "the client"
        return ClientGone(f"{who} left while {what}: nothing is kept for it (its arrays, budget and functions are "
                          f"freed); connect again to go on")

    @_handles(Forget)
    def forget(self, op: Forget) -> None:
        """The client will not call these functions nor run these programs again (their captured versions and
        traced graphs are gone): they leave the controller and the executors, once their calls in flight end.
        Another client's ids are ignored."""
        with self._held_lock:
            functions = [function_id for function_id in op.function_ids if function_id in self.functions]
            self.functions.difference_update(functions)
            programs = [program_id for program_id in op.program_ids
                        if self.programs.pop(program_id, None) is not None]
        if functions or programs:
            self.controller.call_dispatch.forget(functions, programs)

    def forget_everything(self) -> int:
        """The client is gone: its functions and programs leave the controller's tables and every executor that
        loaded them (one ``Forget`` each); how many."""
        self.controller.call_dispatch.forget(sorted(self.functions), sorted(self.programs))
        forgotten = len(self.functions) + len(self.programs)
        self.functions.clear()
        self.programs.clear()
        return forgotten

    @_handles(FlushFrees)
    def flush_frees(self, op: FlushFrees) -> None:
        self.controller.lifetimes.flush_frees()

    # ------------------------------------------------------------ executors

    @_handles(AllocateMesh)
    def allocate_mesh(self, op: AllocateMesh) -> MeshAllocation:
        executor_ids = None if op.executor_ids is None else list(op.executor_ids)
        mesh = self.controller.resources.allocate(dict(op.axes), executor_ids)
        self.meshes[mesh.mesh_id] = mesh
        return mesh

    @_handles(IslandOf)
    def island_of(self, op: IslandOf) -> str:
        return self.controller.resources.island_of(op.executor_id)

    @_handles(Executors)
    def executors(self, op: Executors) -> tuple[ExecutorView, ...]:
        return tuple(executor_view(self.controller, info) for info in self.controller.resources.ordered())

    @_handles(Executor)
    def executor(self, op: Executor) -> ExecutorView | None:
        info = self.controller.resources.executors.get(op.executor_id)
        return None if info is None else executor_view(self.controller, info)

    @_handles(WaitForExecutors)
    def wait_for_executors(self, op: WaitForExecutors) -> None:
        timeout_s = op.timeout_s
        if self.owner:   # a service client's worker parked here is its own, but not for a time the client picks
            timeout_s = bounded(timeout_s, "wait_for_executors: timeout_s", _WAIT_S)
        self.controller.members.wait_for_executors(op.count, timeout_s)

    @_handles(CheckpointRoot)
    def checkpoint_root_of_client(self, op: CheckpointRoot) -> str | None:
        return self.checkpoint_root

    @_handles(ReplaceExecutor)
    def replace_executor(self, op: ReplaceExecutor) -> ExecutorView:
        if self.replace is None:
            raise ValueError(f"replace_executor({op.executor_id!r}): this controller replaces no executor for its "
                             f"client (an embedded context starts its replacements itself)")
        return self.replace(op.executor_id, op.timeout_s)

    @_handles(Bye)
    def bye(self, op: Bye) -> None:
        """Nothing here: the service ends the client's session once this is answered."""

    # ------------------------------------------------------------ observability

    @_handles(Gather)
    def gather(self, op: Gather) -> dict:
        if op.kind not in ("stats", "trace"):
            raise ValueError(f"gather({op.kind!r}): expected 'stats' or 'trace'")
        return self.controller.requests.gather(op.kind)

    @_handles(Counters)
    def counters(self, op: Counters) -> ControllerCounters:
        return controller_counters(self.controller, self.server)

    @_handles(RunaheadWaits)
    def runahead_waits(self, op: RunaheadWaits) -> tuple[tuple[int, int, int, str], ...]:
        return tuple(self.controller.call_dispatch.run_ahead.waits)

    @_handles(NoteRunaheadWait)
    def note_runahead_wait(self, op: NoteRunaheadWait) -> None:
        # 10,000 are kept for every client's trace: each a line, not whatever a client sends (up to 8 MiB)
        waits = self.controller.call_dispatch.run_ahead.waits
        waits.append((op.start_ns, op.end_ns, op.in_flight, op.what[:_WHAT_CHARS]))

    # ------------------------------------------------------------ what the client owns

    def _own(self, records: list[ArrayRecord]) -> list[ArrayRecord]:
        """Hold ``records`` for this client; once it left (`closed`), free them at once and fail the request."""
        with self._held_lock:
            if not self.closed:
                self.arrays.update(record.array_id for record in records)
                return records
        self._free_for_good([record.array_id for record in records], self._gone("a request was making arrays"))
        raise self._gone("a request was making arrays")

    def never_made(self, output_ids: Sequence[int], error: BaseException) -> None:
        """A call sent without waiting failed before it made ``output_ids``: the client holds them as failed
        arrays, and a later call that reads one fails with the same ``error`` (an executor lost, say, which its
        trainer recovers from), not as a stranger's id."""
        for array_id in output_ids:
            if isinstance(array_id, int) and array_id not in self.arrays:
                self._never_made[array_id] = error

    def _check_arrays(self, array_ids: Sequence[int]) -> None:
        for array_id in array_ids:
            if array_id not in self.arrays:
                if array_id in self._never_made:
                    raise self._never_made[array_id]
                raise NotYoursError(f"array {array_id} is not one this client holds (never made, already "
                                    f"freed, or another client's); use the arrays your own calls returned")

    def _check_call(self, spec: CallSpec, *, inputs: bool) -> None:
        if spec.function_id not in self.functions:
            raise NotYoursError(f"function {spec.function_id} ({spec.name!r}) is not one this client "
                                f"registered; register it first")
        self._check_mesh(spec.mesh)
        if inputs:
            self._check_arrays(spec.inputs)

    def _check_mesh(self, mesh: MeshAllocation) -> None:
        if self.meshes.get(mesh.mesh_id) != mesh:
            raise NotYoursError(f"mesh {mesh.mesh_id} is not one this client allocated, or not as it was "
                                f"allocated; use ctx.mesh(...)")

    def _program(self, program_id: int):
        """A program this client registered (its lowered form)."""
        lowered = self.programs.get(program_id)
        if lowered is None:
            raise NotYoursError(f"program {program_id} is not one this client registered; register it first")
        return lowered
