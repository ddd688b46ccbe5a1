"""Calls and program runs on their way out: functions, sequence numbers, input routes and the run-ahead bound.

Every computation gets its island's next sequence number. A call is sent to every executor of its mesh at once;
inputs that live on other executors are pushed there executor→executor (`SendShard`), never through the
controller. A program is lowered once and then run with one ``RunProgram`` per executor. A client thread past
``max_inflight_calls`` unfinished calls waits here (bounded run-ahead) until enough have ended.

No lock is held across a client's work: a program is lowered (seconds, for a large one on many executors) holding
neither the controller's lock nor a sequencer, and a call waits for executor memory before its turn on the
islands (admission), so a call waiting for memory holds no admission slot.
"""

from __future__ import annotations

import itertools
import logging
from typing import Sequence

from pathways_torch.errors import ContextClosedError, ExecutorLostError
from pathways_torch.wire import pb
from pathways_torch.wire.security import owner_role

from .admission import ClientGone
from .arrays import FAILED, PENDING, ArrayRecord
from .call_spec import CallSpec, InFlightCall, RegisteredFunction
from .forgetting import Forgetting
from .graph_limits import check_sim_seconds
from .lowering import ProgramInstaller
from .memory import demand_of
from .program import LoweredProgram, ProgramSpec
from .resources import MeshAllocation
from .run_ahead import RunAhead

__all__ = ["CallDispatch"]

log = logging.getLogger(__name__)


class CallDispatch:
    """The `Controller`'s dispatch of calls and program runs.

    Its public methods take the island sequencers they need, then the controller's lock, as the client's threads
    call them; `end` and `sequencer_of` expect the lock held. A call is admitted on its islands (``admission``)
    after its outputs found room (``memory``); its mesh's collectives run in ``groups``; a program run on a whole
    island goes down its launch tree (``launch_trees``).
    """

    def __init__(self, state, *, admission, memory, groups, launch_trees):
        self._state = state
        self._lock, self._calls, self._functions = state.lock, state.calls, state.functions
        self._programs, self._stale_programs = state.programs, state.stale_programs
        self.resources, self.arrays, self.sequencers = state.resources, state.arrays, state.sequencers
        self._send = state.send
        self._admission = admission
        self._memory = memory     # bytes per executor under --executor-memory-bytes (memory.py)
        self._groups, self._launch_trees = groups, launch_trees
        self.closing_reason = ""             # set by fail_pending: a waiting call must not dispatch after it
        # Each client's calls in flight, bounded (a client thread past the bound waits for its own to end)
        self.run_ahead = RunAhead(self._lock, state.config.max_inflight_calls)
        self._next_function_id = itertools.count(1)
        self.last_call_id = 0
        self._mesh_islands: dict[int, tuple[str, ...]] = {}   # mesh id → its islands (cached per mesh)
        self._next_program_id = itertools.count(1)
        self.program_constant_bytes = 0   # graph constants are the only tensor bytes we ever send
        self.forgetting = Forgetting(calls=self._calls, functions=self._functions, programs=self._programs,
                                     stale_programs=self._stale_programs, resources=self.resources, send=self._send)
        self.refused_costs = 0   # functions refused for a simulated time out of bounds (logged, rate-limited)
        self.installer = ProgramInstaller(state, groups=groups, ensure_loaded=self._ensure_loaded)

    # ------------------------------------------------------------ functions and calls

    def register_function(self, name: str, graph: pb.Graph, constants: list, *, sim_seconds: float = 0.0) -> int:
        sim_seconds = self._checked_sim_seconds(name, sim_seconds)
        with self._lock:
            function_id = next(self._next_function_id)
            self._functions[function_id] = RegisteredFunction(name, graph, list(constants), sim_seconds=sim_seconds)
            return function_id

    def _checked_sim_seconds(self, name: str, sim_seconds) -> float:
        """0 or within COST_SECONDS (`graph_limits`: the scheduler's estimate too); a refusal is counted and logged."""
        try:
            return check_sim_seconds(name, sim_seconds)
        except ValueError as refused:
            self.refused_costs += 1
            if self.refused_costs <= 10 or self.refused_costs % 1000 == 0:   # a client must not flood the log
                log.warning("controller: refused (%d so far): %s", self.refused_costs, refused)
            raise

    def call(self, spec: CallSpec, owner: str = "", output_ids: Sequence[int] | None = None) -> list[ArrayRecord]:
        """Dispatch one call to every executor of its mesh; return its output records at once
        (after waiting, if ``max_inflight_calls`` are unfinished, for one to finish)."""
        mesh = spec.mesh
        islands = self._islands_of(mesh)
        admitted = reservation = None
        try:
            if self._memory.limit_bytes:   # room for its outputs first (waits for frees, or raises), holding no slot
                sizes = _output_bytes(spec.output_shard_bytes[:spec.num_outputs])
                demand = {}
                for shard_bytes in sizes:
                    demand_of(mesh.executor_ids, shard_bytes, demand)
                reservation = self._reserve(owner, demand, f"call {spec.name!r}")
            admitted = self._admission.admit(owner, islands, ("function", spec.function_id),
                                             self._function_cost(spec.function_id, mesh.size))
            return self._dispatch_call(spec, owner, islands, admitted, output_ids, reservation)
        except BaseException:
            if admitted is not None and not admitted.dispatched:   # never in flight: its slots go back uncharged
                self._admission.release(admitted)
            self._memory.cancel(reservation)
            raise

    def _reserve(self, owner: str, demand: dict, what: str):
        """Room on each executor for the bytes of ``demand``: waits (holding no lock) up to ``memory_wait_s``."""
        reservation = self._memory.reserve(owner, demand, self._state.config.memory_wait_s, what=what)
        if owner and self._admission.enabled and owner not in self._admission.weights:
            self._memory.cancel(reservation)   # the client disconnected while it waited: nothing may be made for it
            raise ClientGone(f"client {owner} disconnected while {what} waited for executor memory")
        return reservation

    @staticmethod
    def _hold(reservation, records: list[ArrayRecord], sizes) -> None:
        """The records made for ``reservation`` hold its bytes from now on (each its own, given back when it is
        forgotten)."""
        reservation.claimed = True
        for record, shard_bytes in zip(records, sizes):
            record.held_bytes = shard_bytes

    def _dispatch_call(self, spec: CallSpec, owner: str, islands, admitted, output_ids,
                       reservation=None) -> list[ArrayRecord]:
        mesh = spec.mesh
        with self._lock:   # before the islands' sequencers: a client waiting for room holds up no other client
            self._wait_for_room(1, spec.name, owner)
        with self.sequencers.taking(islands), self._lock:
            self.resources.check_live(mesh.executor_ids)
            inputs = [self._input_record(array_id) for array_id in spec.inputs]
            axis_groups = self._groups.axis_groups(mesh, spec.collective_axes)
            call_id = self._take_call_ids(1)
            seqs = {island: self.sequencers.of(island).take(1) for island in islands}
            ids = output_ids if output_ids is not None else [None] * spec.num_outputs
            outputs = [self.arrays.new(mesh.executor_ids, producer_call=call_id, array_id=i) for i in ids]
            for record in outputs:
                record.owner = owner
            for record, replicated in zip(outputs, spec.replicated_outputs):
                record.replicated = replicated
            if reservation is not None:
                self._hold(reservation, outputs, _output_bytes(spec.output_shard_bytes[:spec.num_outputs]))
            call = InFlightCall(spec, call_id, seqs[islands[0]], outputs, waiting=set(mesh.executor_ids),
                                admitted=admitted, owner=owner)
            self._calls[call_id] = call
            self.run_ahead.added(owner)
            if admitted is not None:
                admitted.dispatched = True
            runs = []
            budgets = _run_budgets(spec) if self._memory.enabled else ()   # the executors store no more (memory.py)
            for position, executor_id in enumerate(mesh.executor_ids):
                self._ensure_loaded(spec.function_id, executor_id)
                sequencer = self.sequencer_of(executor_id)
                seq = seqs[sequencer.island]
                run = pb.Run(seq=seq, call_id=call_id, function_id=spec.function_id,
                             digest_outputs=spec.debug and any(spec.replicated_outputs),
                             report_shapes=spec.report_shapes, owner=owner_role(owner), output_budget_bytes=budgets)
                if spec.collective_axes:
                    run.collective = True
                    run.prev_collective_seq = sequencer.chain(executor_id, seq)
                    for axis in spec.collective_axes:
                        run.axis_groups[axis] = axis_groups[axis][position]
                for record in inputs:
                    run.inputs.append(self._route_input(record, position, executor_id, call_id))
                # Only shards stored where the run is: a copy pushed for it is freed after it anyway.
                run.donated_inputs.extend(i for i in spec.donated if not run.inputs[i].tag)
                for record in outputs:
                    run.outputs.add(array_id=record.array_id, shard=position)
                runs.append((executor_id, run))
            # Only now the runs: every push this call's inputs need was requested first. An
            # executor may start a run (a collective blocks there) as soon as it reads it,
            # before it reads what the controller sent after it (executor/compute_loop.py).
            for executor_id, run in runs:
                self._send(executor_id, pb.Envelope(run=run))
            return outputs

    def _wait_for_room(self, count: int, name: str, owner: str = "") -> None:
        """Wait (the lock released) until ``count`` more calls of ``owner`` fit its run-ahead (`RunAhead`)."""
        self.run_ahead.wait_for_room(count, name, owner, closed=lambda: self.closing_reason != "")
        if self.closing_reason:
            raise ContextClosedError(f"{self.closing_reason} while {name!r} waited to be dispatched")

    @property
    def calls_in_flight(self) -> int:
        """How many calls (and program runs' reporting nodes) are unfinished."""
        return len(self._calls)

    def end(self, call: InFlightCall) -> None:
        """The call is no longer in flight (finished, failed or its executors lost): make room for another."""
        if self._calls.pop(call.call_id, None) is None:
            return
        if call.admitted is not None:
            self._admission.node_ended(call.admitted, call.device_s, self._admission.costs)
            call.admitted = None
        self.forgetting.call_ended(call)
        self.run_ahead.ended(call.owner)

    def sequencer_of(self, executor_id: str):
        """The sequencer of the executor's island."""
        return self.sequencers.of(self.resources.island_of(executor_id))

    def _islands_of(self, mesh: MeshAllocation) -> tuple[str, ...]:
        """The islands of a mesh's executors, in name order (cached: a mesh's executors never change)."""
        islands = self._mesh_islands.get(mesh.mesh_id)
        if islands is None:
            islands = self._mesh_islands[mesh.mesh_id] = tuple(sorted(
                {self.resources.island_of(e) for e in mesh.executor_ids}))
        return islands

    def _take_call_ids(self, count: int) -> int:
        first = self.last_call_id + 1
        self.last_call_id += count
        return first

    def _function_cost(self, function_id: int, executors: int) -> float:
        """A call's device seconds before any was measured: its simulated time, else 1 ms, on each executor."""
        function = self._functions.get(function_id)
        per_run = function.sim_seconds if function is not None and function.sim_seconds > 0 else 0.001
        return per_run * executors

    def _program_cost(self, spec: ProgramSpec) -> float:
        return sum(self._function_cost(node.function_id, node.mesh.size) for node in spec.nodes)

    # ------------------------------------------------------------ programs

    def forget(self, function_ids, program_ids) -> None:
        """Functions and programs no client uses again leave here and the executors (`forgetting.py`)."""
        with self._lock:
            self.forgetting.forget(function_ids, program_ids)

    def register_program(self, spec: ProgramSpec) -> LoweredProgram:
        """Lower ``spec`` (holding no lock: `lowering`) and register it on every executor it uses (once)."""
        islands = {island for node in spec.nodes for island in self._islands_of(node.mesh)}
        return self.installer.lower_outside_lock(spec, next(self._next_program_id), islands)

    def run_program(self, program_id: int, input_ids: Sequence[int], owner: str = "",
                    output_ids: Sequence[int] | None = None) -> list[ArrayRecord]:
        """One run: one ``RunProgram`` per executor; every node gets its own sequence number (of its island's)."""
        with self._lock:
            lowered = self._programs[program_id]
            if (stale := program_id in self._stale_programs):
                self.resources.check_live(list(lowered.plans))
        islands = {self.resources.island_of(e) for e in lowered.plans}
        if stale:   # lowered again for a replaced executor or new groups: holding no lock, as at its registration
            lowered = self.installer.lower_outside_lock(lowered.spec, program_id, islands, again=True)
        nodes = len(lowered.reporting_nodes)
        admitted = reservation = None
        try:
            if self._memory.limit_bytes:   # room for its outputs first (not its intermediates: memory.py), no slot held
                spec, meshes = lowered.spec, lowered.spec.value_meshes()
                demand = {}
                for value, shard_bytes in zip(spec.output_values, _program_output_bytes(spec)):
                    demand_of(meshes[value].executor_ids, shard_bytes, demand)
                reservation = self._reserve(owner, demand, f"program {spec.name!r}")
            admitted = self._admission.admit(owner, islands, ("program", program_id),
                                             self._program_cost(lowered.spec), nodes=nodes)
            return self._dispatch_run(program_id, input_ids, owner, islands, admitted, output_ids, reservation)
        except BaseException:
            if admitted is not None and not admitted.dispatched:
                self._admission.release(admitted)
            self._memory.cancel(reservation)
            raise

    def _dispatch_run(self, program_id: int, input_ids: Sequence[int], owner: str, islands, admitted, output_ids,
                      reservation=None):
        with self._lock:   # before the islands' sequencers, as for a call
            lowered = self._programs[program_id]
            self._wait_for_room(len(lowered.reporting_nodes), lowered.spec.name, owner)
        with self.sequencers.taking(islands), self._lock:
            lowered = self._programs[program_id]
            spec = lowered.spec
            self.resources.check_live(list(lowered.plans))
            if program_id in self._stale_programs:   # one of its executors was replaced: new address and groups
                lowered = self.installer.lower_under_lock(spec, program_id)
            for array_id in input_ids:
                self._input_record(array_id)
            num_nodes = len(spec.nodes)
            base_seqs = {island: self.sequencers.of(island).take(num_nodes) for island in sorted(islands)}
            base_seq, base_call = base_seqs[min(islands)], self._take_call_ids(num_nodes)
            meshes = spec.value_meshes()
            producer = {v: index for index, node in enumerate(spec.nodes) for v in node.outputs}
            ids = output_ids if output_ids is not None else [None] * len(spec.output_values)
            outputs = [self.arrays.new(meshes[v].executor_ids, producer_call=base_call + producer[v], array_id=i)
                       for v, i in zip(spec.output_values, ids)]
            for record in outputs:
                record.owner = owner
            if reservation is not None:
                self._hold(reservation, outputs, _program_output_bytes(spec))
            by_value = dict(zip(spec.output_values, outputs))
            first_intermediate = self.arrays.reserve(1 + max(producer))
            for index in lowered.reporting_nodes:
                node = spec.nodes[index]
                positions = [i for i, v in enumerate(node.outputs) if v in by_value]
                records = [by_value[node.outputs[i]] for i in positions]
                # As for a call: a replicated output (a pipeline's loss) stays readable after losing a replica.
                for i, record in zip(positions, records):
                    record.replicated = bool(node.replicated_outputs) and node.replicated_outputs[i]
                # The node's call covers its outputs that are program outputs: the arrays it reports.
                call_spec = CallSpec(function_id=node.function_id, name=node.name, mesh=node.mesh, inputs=(),
                                     num_outputs=len(records), call_site=node.call_site,
                                     replicated_outputs=tuple(node.replicated_outputs[i] for i in positions)
                                     if node.replicated_outputs else (), debug=node.debug,
                                     output_positions=tuple(positions))
                self._calls[base_call + index] = InFlightCall(
                    call_spec, base_call + index, base_seq + index, records, waiting=set(node.mesh.executor_ids),
                    depends_on=frozenset(lowered.plans), run_base=base_call, run_nodes=num_nodes,
                    program_id=program_id, admitted=admitted, owner=owner)
                self.run_ahead.added(owner)
            if admitted is not None:
                admitted.dispatched = True
            run = pb.RunProgram(program_id=program_id, base_call_id=base_call, input_array_ids=list(input_ids),
                                output_array_ids=[r.array_id for r in outputs],
                                first_intermediate_id=first_intermediate, owner=owner_role(owner),
                                output_budget_bytes=_program_output_bytes(spec) if self._memory.enabled else ())
            tree = self._launch_trees.tree_for(lowered.plans) if len(islands) == 1 else None
            if tree is None:
                for executor_id in lowered.plans:
                    sequencer = self.sequencer_of(executor_id)
                    run.base_seq = island_base = base_seqs[sequencer.island]
                    last = lowered.last_collective_node.get(executor_id, 0)
                    run.prev_collective_seq = sequencer.chain(executor_id, island_base + last - 1) if last else \
                        sequencer.last_collective[executor_id]
                    self._send(executor_id, pb.Envelope(run_program=run))
                return outputs
            # One island, one base sequence number; each member's previous collective rides in the launch's table.
            sequencer = self.sequencers.of(next(iter(islands)))
            run.base_seq = island_base = base_seqs[sequencer.island]
            last_collective = sequencer.last_collective
            prev_collective = {executor_id: last_collective[executor_id] for executor_id in lowered.plans}
            gang = {}
            for executor_id, last in lowered.last_collective_node.items():
                if last:
                    sequencer.chain(executor_id, island_base + last - 1)
                    gang[executor_id] = (prev_collective[executor_id], island_base + last - 1)
            self._launch_trees.launch(tree, run, prev_collective, gang)
            return outputs

    # ------------------------------------------------------------ inputs and functions on executors

    def _input_record(self, array_id: int) -> ArrayRecord:
        record = self.arrays.get(array_id)
        if record is None or record.released:
            raise ValueError(f"array {array_id} was freed; it cannot be used as an input")
        for executor_id in record.executor_ids:
            if self.resources.executors[executor_id].lost or executor_id in record.lost_holders:
                raise ExecutorLostError(f"array {array_id} has a shard on executor {executor_id}, which was lost"
                                        f"{f': {record.error}' if record.error else ''}; recompute it (or restore a "
                                        f"checkpoint) on live executors", executor_id=executor_id)
        return record

    def _route_input(self, record: ArrayRecord, position: int, executor_id: str, call_id: int) -> pb.ShardRef:
        """Where executor ``executor_id`` finds shard ``position`` of ``record`` for this call."""
        source = record.executor_ids[position]
        if source == executor_id:
            return pb.ShardRef(array_id=record.array_id, shard=position)
        # The shard lives elsewhere: its owner pushes a copy tagged with this call.
        copy = pb.ShardRef(array_id=record.array_id, shard=position, tag=call_id)
        routes = self._calls[call_id].routes
        if (source, executor_id, copy) in routes:
            return copy   # the same array passed twice: one copy serves both
        routes.append((source, executor_id, copy))
        destination = self.resources.executors[executor_id]
        address, to_inbox = self.resources.route(source, executor_id)
        request = pb.SendShard(to_address=address, to_public_key=destination.public_key, call_id=call_id,
                               to_inbox=to_inbox)
        request.shard.CopyFrom(pb.ShardRef(array_id=record.array_id, shard=position))
        request.as_ref.CopyFrom(copy)
        self._send(source, pb.Envelope(send_shard=request))
        return copy

    def _ensure_loaded(self, function_id: int, executor_id: str) -> None:
        function = self._functions[function_id]
        if executor_id in function.loaded_on:
            return
        load = pb.LoadFunction(function_id=function_id, name=function.name, sim_seconds=function.sim_seconds)
        load.graph.CopyFrom(function.graph)
        self._send(executor_id, pb.Envelope(load_function=load), function.constants)
        self.program_constant_bytes += sum(memoryview(c).nbytes for c in function.constants)
        function.loaded_on.add(executor_id)

    # ------------------------------------------------------------ closing

    def fail_pending(self, reason: str) -> int:
        """Fail every array still pending with `ContextClosedError` naming the call that would have made it
        (the client is closing: nothing will complete them). Returns how many were failed."""
        failed = 0
        with self._lock:
            for call in list(self._calls.values()):
                error = ContextClosedError(f"{reason} before {call.spec.name!r} finished; it was called from:\n"
                                           f"{call.spec.call_site.rstrip() or '(unknown)'}")
                for record in call.outputs:
                    if record.state == PENDING:
                        record.settle(FAILED, error)
                        failed += 1
            self._calls.clear()
            self.closing_reason = reason
            self._admission.close(reason)
            self._memory.close(reason)
            self.run_ahead.clear()   # every wait for room ends (it sees the closing reason)
            for record in self.arrays.records():   # puts not yet acknowledged, a program's inputs
                if record.state == PENDING:
                    record.settle(FAILED, ContextClosedError(f"{reason} before array {record.array_id} was ready"))
                    failed += 1
        return failed


def _output_bytes(sizes) -> tuple[int, ...]:
    """A client's ``output_shard_bytes``, each a count of bytes (anything else, or below 0, counts 0: unknown)."""
    return tuple(b if type(b) is int and b > 0 else 0 for b in sizes)


def _run_budgets(spec: CallSpec) -> tuple[int, ...]:
    """Under a limit, the bytes counted per shard of each of a call's outputs, sent with its runs: the executors
    store no more (executor/output_budget.py). An output the client gave no size for counts 0, and may store 0."""
    sizes = _output_bytes(spec.output_shard_bytes[:spec.num_outputs])
    return sizes + (0,) * (spec.num_outputs - len(sizes))


def _program_output_bytes(spec: ProgramSpec) -> tuple[int, ...]:
    """The bytes of one shard of each of a program's outputs (its nodes' ``output_shard_bytes``; 0: unknown)."""
    sizes = {v: b for node in spec.nodes for v, b in zip(node.outputs, _output_bytes(node.output_shard_bytes))}
    return tuple(sizes.get(v, 0) for v in spec.output_values)
