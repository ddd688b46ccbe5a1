"""The executor's logic, independent of sockets and threads.

`ExecutorCore` reacts to decoded messages and emits messages through an
`Outbox`; computations go to a `submit` callable (the compute thread in a real
process, a synchronous fake in unit tests) and come back through `finish`.
Everything here runs on one thread (the I/O loop).

Computations are queued in the order the controller sent them (the island's
sequence order) and started in that order among those that are *startable*: every
input present and the function compiled. A computation whose function is still
compiling (in the background) lets later ready ones pass, so a long compile does
not stall the executor. None of today's computations waits on another executor
once started, so this cannot deadlock; collective-bearing computations (a later
issue) will keep strict sequence order among themselves.
"""

from __future__ import annotations

import collections
import logging
import traceback
from typing import Callable, Protocol, Sequence

from pathways_torch.wire import pb
from pathways_torch.wire.framing import body_name, log_dropped
from pathways_torch.wire.tensors import dtype_name

from .collectives import CollectiveRuntime
from .compile_cache import CompileCache, graph_key
from .store import ObjectStore
from .trace import TraceRecorder

__all__ = ["ExecutorCore", "Outbox", "ComputeJob"]

log = logging.getLogger(__name__)


class Outbox(Protocol):
    def to_controller(self, envelope: pb.Envelope, payload: Sequence = ()) -> None: ...
    def to_peer(self, address: str, envelope: pb.Envelope, payload: Sequence = (), public_key: bytes = b"") -> None: ...
    def to_client(self, identity: bytes, envelope: pb.Envelope, payload: Sequence = ()) -> None: ...


def _key(ref: pb.ShardRef) -> tuple:
    return (ref.array_id, ref.shard, ref.tag)


class ComputeJob:
    """One computation handed to the compute thread."""

    __slots__ = ("run", "function", "inputs", "outputs", "failure", "digests", "form", "entries", "out_entries",
                 "signature")

    def __init__(self, run: pb.Run, function, inputs: list, form: pb.FormGroup | None = None):
        self.run, self.function, self.inputs, self.form = run, function, inputs, form
        self.entries: list = []       # input entries, read on the compute thread (local chaining)
        self.out_entries: list = []
        self.signature = None
        self.outputs: list | None = None
        self.failure: pb.RemoteFailure | None = None
        self.digests: list[bytes] = []


class _Function:
    """A loaded function: its traced input signature and, once compiled, the callable."""

    __slots__ = ("name", "signature", "compiled", "failure", "ready")

    def __init__(self, name: str, signature: list):
        self.name, self.signature = name, signature
        self.compiled, self.failure, self.ready = None, None, False


class ExecutorCore:
    """Object store, run queue, transfers and fetches of one executor."""

    def __init__(self, *, executor_id: str, backend, outbox: Outbox,
                 submit: Callable[[ComputeJob], None], trace: TraceRecorder | None = None,
                 compiler: CompileCache | None = None, collectives: CollectiveRuntime | None = None,
                 gang_order: bool = True):
        self.executor_id = executor_id
        self.backend = backend
        self.outbox = outbox
        self._submit = submit
        self.trace = trace if trace is not None else TraceRecorder()  # an empty recorder is falsy
        self.store = ObjectStore()
        self.compiler = compiler if compiler is not None else CompileCache(backend, self.trace, background=False)
        self.functions: dict[int, _Function] = {}
        self.programs: dict[int, pb.RegisterProgram] = {}
        self.collectives = collectives if collectives is not None else CollectiveRuntime()
        self._queue: collections.deque = collections.deque()   # pb.Run and pb.FormGroup, in arrival order
        self._last_collective_seq = 0   # the last collective action started here (gang order)
        # Only tests turn this off, to show that without it collectives deadlock.
        self._gang_order = gang_order
        self.hop_bytes: collections.Counter = collections.Counter()
        self.num_computations = 0
        self.num_function_loads = 0
        self.dropped_messages = 0
        self.counters: collections.Counter = collections.Counter()  # reported with Stats (e.g. refused connections)
        self._last_run_call_id = 0      # Runs arrive in call-id order: a transfer tagged at or below it is late
        self._early: set[tuple] = set()  # transfers that arrived before their Run (another connection)
        self.stopped = False

    # ------------------------------------------------------------ control plane

    def on_control(self, envelope: pb.Envelope, payload: list) -> None:
        kind = body_name(envelope)
        if kind == "transfer" and envelope.transfer.failed:
            # The controller fails a copy whose sender was lost: no one else will ever push it.
            self._on_transfer(envelope.transfer, payload)
            return
        handler = getattr(self, f"_on_{kind}", None)
        if handler is None or kind in _DATA_KINDS:
            self._drop(f"control message of type {kind!r} not expected from the controller")
            return
        handler(getattr(envelope, kind), payload)

    def _on_welcome(self, msg: pb.Welcome, payload) -> None:
        self.trace.record("receive", "welcome", detail=f"index {msg.index}")

    def _on_heartbeat(self, msg: pb.Heartbeat, payload) -> None:
        pass  # liveness is tracked by the process wrapper on any message

    def _on_shutdown(self, msg: pb.Shutdown, payload) -> None:
        log.info("%s: shutdown requested (%s)", self.executor_id, msg.reason)
        self.stopped = True

    def _on_load_function(self, msg: pb.LoadFunction, payload) -> None:
        self.trace.record("receive", f"load {msg.name}", function_id=msg.function_id)
        self.num_function_loads += 1
        function = self.functions[msg.function_id] = _Function(msg.name, [])
        try:
            function.signature = [(tuple(m.shape), m.dtype) for m in msg.graph.inputs]
            graph_module, examples = self.backend.prepare(msg, payload)
        except Exception as exc:
            log.warning("%s: function %s refused: %s", self.executor_id, msg.name, exc)
            self._function_ready(function, None, exc)
            return
        # The declared sim time is part of what the function is (two sim steps may share a graph).
        key = graph_key(msg.graph.SerializeToString(deterministic=True) + repr(msg.sim_seconds).encode(),
                        payload_bytes(payload))
        self.compiler.request(key, msg.name, graph_module, examples,
                              lambda compiled, error: self._function_ready(function, compiled, error))

    def _function_ready(self, function: _Function, compiled, error: BaseException | None) -> None:
        function.compiled, function.ready = compiled, True
        if error is not None:
            function.failure = self._failure(error, origin_call_id=0)
        self._pump()

    def _on_run(self, run: pb.Run, payload) -> None:
        self.trace.record("receive", self._name(run.function_id) or "run", seq=run.seq,
                          call_id=run.call_id, function_id=run.function_id)
        for ref in run.inputs:
            self.store.claim(_key(ref), pin=True)
        for ref in run.outputs:
            self.store.claim(_key(ref), owned=True)
        self._last_run_call_id = max(self._last_run_call_id, run.call_id)
        if self._early:
            self._forget_early(run.call_id)
        self._queue.append(run)
        # Wake the queue when a missing input arrives. Only missing ones: a run that
        # starts (and ends) now frees its transient inputs, which must not be re-claimed.
        for ref in run.inputs:
            entry = self.store.get(_key(ref))
            if not entry.ready:
                entry.waiters.append(lambda _entry: self._pump())
        self._pump()

    def _on_form_group(self, msg: pb.FormGroup, payload) -> None:
        self.trace.record("receive", "form group", seq=msg.seq, detail=f"group {msg.group_id} rank {msg.rank}")
        self._queue.append(msg)
        self._pump()

    def _on_register_program(self, msg: pb.RegisterProgram, payload) -> None:
        self.trace.record("receive", f"register program {msg.name}", detail=f"{len(msg.actions)} actions")
        self.programs[msg.program_id] = msg

    def _on_run_program(self, msg: pb.RunProgram, payload) -> None:
        """Expand one run of a registered program into its runs and sends, all enqueued at once."""
        plan = self.programs.get(msg.program_id)
        if plan is None:
            self._drop(f"run of unknown program {msg.program_id}")
            return
        array_id = _value_ids(plan, msg)
        for action in plan.actions:
            if action.WhichOneof("kind") == "run":
                self._on_run(_expand_run(action.run, msg, array_id), ())
            else:
                send = action.send
                request = pb.SendShard(to_address=send.to_address, to_public_key=send.to_public_key,
                                       call_id=msg.base_call_id + send.to_node)
                request.shard.CopyFrom(pb.ShardRef(array_id=array_id(send.value), shard=send.shard))
                request.as_ref.CopyFrom(pb.ShardRef(array_id=array_id(send.value), shard=send.shard,
                                                    tag=msg.base_call_id + send.to_node))
                self._on_send_shard(request, ())
        # Every use is enqueued (and pins its buffer): intermediates can be let go; each is
        # deleted once produced and used.
        for ref in plan.local_intermediates:
            self.store.free((array_id(ref.value), ref.shard, 0))

    def _on_send_shard(self, msg: pb.SendShard, payload) -> None:
        key = _key(msg.shard)
        self.store.claim(key, pin=True)
        self.store.when_ready(key, lambda entry: self._push(msg, key, entry))

    def _on_free(self, msg: pb.Free, payload) -> None:
        for ref in msg.shards:
            self.store.free(_key(ref))

    def _on_stats_request(self, msg: pb.StatsRequest, payload) -> None:
        stats = pb.Stats(request_id=msg.request_id, executor_id=self.executor_id,
                         store_bytes=self.store.bytes, store_buffers=len(self.store),
                         num_computations=self.num_computations, num_function_loads=self.num_function_loads,
                         num_compiles=self.backend.num_compiles())
        for hop, count in self.hop_bytes.items():
            stats.hop_bytes[hop] = count
        # Stats has no fields for these counts yet: they ride in hop_bytes under reserved names.
        stats.hop_bytes["dropped_messages"] = self.dropped_messages
        for name, count in self.counters.items():
            stats.hop_bytes[name] = count
        self.outbox.to_controller(pb.Envelope(stats=stats))

    def _on_trace_request(self, msg: pb.TraceRequest, payload) -> None:
        reply = pb.TraceReply(request_id=msg.request_id, executor_id=self.executor_id)
        self.trace.fill(reply)
        self.outbox.to_controller(pb.Envelope(trace_reply=reply))

    # ------------------------------------------------------------ data plane

    def on_data(self, identity: bytes, envelope: pb.Envelope, payload: list) -> None:
        kind = body_name(envelope)
        if kind == "put":
            self._on_put(identity, envelope.put, payload)
        elif kind == "transfer":
            self._on_transfer(envelope.transfer, payload)
        elif kind == "fetch":
            self._on_fetch(identity, envelope.fetch)
        else:
            self._drop(f"data message of type {kind!r} not expected")

    def _on_put(self, identity: bytes, msg: pb.Put, payload) -> None:
        for item in (msg, *msg.more):
            tensor = self.backend.from_frame(item.tensor, payload)
            self.hop_bytes["client->executor"] += tensor.numel() * tensor.element_size()
            self.store.fill(_key(item.shard), tensor)
        ack = pb.PutAck(request_id=msg.request_id)
        ack.shard.CopyFrom(msg.shard)
        self.outbox.to_client(identity, pb.Envelope(put_ack=ack))

    def _on_transfer(self, msg: pb.Transfer, payload) -> None:
        key = _key(msg.shard)
        if not self._expects_transfer(key):
            self._drop(f"transfer of array {key[0]} shard {key[1]} for call {key[2]}: no run waits for it")
            return
        if msg.failed:
            self.store.fill(key, failure=msg.failure)
            return
        tensor = self.backend.from_frame(msg.tensor, payload)
        self.hop_bytes["executor->executor received"] += tensor.numel() * tensor.element_size()
        self.trace.record("receive", "transfer", call_id=msg.shard.tag, detail=f"array {msg.shard.array_id}")
        self.store.fill(key, tensor)

    def _on_fetch(self, identity: bytes, msg: pb.Fetch) -> None:
        key = _key(msg.shard)
        if key not in self.store:
            reply = pb.FetchReply(request_id=msg.request_id, failed=True)
            reply.failure.CopyFrom(pb.RemoteFailure(
                type="KeyError", executor_id=self.executor_id,
                message=f"executor {self.executor_id} holds no shard {msg.shard.shard} of array {msg.shard.array_id}"))
            self.outbox.to_client(identity, pb.Envelope(fetch_reply=reply))
            return
        self.store.claim(key, pin=True)
        self.store.when_ready(key, lambda entry: self._reply_fetch(identity, msg, key, entry))

    def _reply_fetch(self, identity: bytes, msg: pb.Fetch, key: tuple, entry) -> None:
        reply = pb.FetchReply(request_id=msg.request_id)
        payload = []
        if entry.failure is not None:
            reply.failed = True
            reply.failure.CopyFrom(entry.failure)
        else:
            payload = [self.backend.to_frame(entry.value, reply.tensor, 1)]
            self.hop_bytes["executor->client"] += entry.nbytes
        self.outbox.to_client(identity, pb.Envelope(fetch_reply=reply), payload)
        self.store.unpin(key)

    def _push(self, msg: pb.SendShard, key: tuple, entry) -> None:
        transfer = pb.Transfer()
        transfer.shard.CopyFrom(msg.as_ref)
        payload = []
        if entry.failure is not None:
            transfer.failed = True
            transfer.failure.CopyFrom(entry.failure)
        else:
            payload = [self.backend.to_frame(entry.value, transfer.tensor, 1)]
            self.hop_bytes["executor->executor"] += entry.nbytes
        self.trace.record("send", "transfer", call_id=msg.call_id, detail=f"array {msg.shard.array_id} -> {msg.to_address}")
        self.outbox.to_peer(msg.to_address, pb.Envelope(transfer=transfer), payload, msg.to_public_key)
        self.store.unpin(key)

    def _expects_transfer(self, key: tuple) -> bool:
        """Whether a transfer for ``key`` fills a copy a run waits for (or may soon wait for).

        A copy is tagged with its consuming call. Its Run may arrive after it (the
        copy comes on another connection), but Runs arrive in call-id order: once
        a later Run has come, an unclaimed copy is late or bogus, and is refused
        rather than kept forever.
        """
        entry = self.store.get(key)
        if entry is not None:
            return not entry.ready
        if key[2] <= self._last_run_call_id or len(self._early) >= _MAX_EARLY_TRANSFERS:
            return False
        self._early.add(key)
        return True

    def _forget_early(self, call_id: int) -> None:
        """Release early copies for calls up to ``call_id``: their Run has come and pinned what it needs."""
        for key in [k for k in self._early if k[2] <= call_id]:
            self._early.discard(key)
            self.store.free(key)

    # ------------------------------------------------------------ computations

    def _pump(self) -> None:
        """Start, in queue order, every queued action that can start now.

        Collective actions (group formation, computations with collectives) start
        strictly in the island's order: each names the previous one on this
        executor, and waits for it, however the messages arrived.
        """
        while self._queue and self._pump_once():
            pass  # a collective action started: one held back behind it may start now

    def _pump_once(self) -> bool:
        """One pass over the queue; True if a collective action started (and another may now be due)."""
        waiting, collective_started = collections.deque(), False
        while self._queue:
            item = self._queue.popleft()
            collective = isinstance(item, pb.FormGroup) or item.collective
            if collective and self._gang_order and item.prev_collective_seq != self._last_collective_seq:
                waiting.append(item)   # an earlier collective action has not started here yet
                continue
            if isinstance(item, pb.FormGroup):
                self._last_collective_seq, collective_started = item.seq, True
                self._submit(ComputeJob(pb.Run(seq=item.seq), None, [], form=item))
                continue
            entries = [self.store.get(_key(ref)) for ref in item.inputs]
            function = self.functions.get(item.function_id)
            # An input still being computed here is fine: the compute thread runs jobs in order.
            if (all(e is not None and (e.ready or e.computing) for e in entries)
                    and (function is None or function.ready)):
                if collective:
                    self._last_collective_seq, collective_started = item.seq, True
                self._start(item, function, entries)
            else:
                waiting.append(item)
        self._queue = waiting + self._queue  # a nested pump may have left items behind
        return collective_started

    def _start(self, run: pb.Run, function: _Function | None, entries: list) -> None:
        failure = next((e.failure for e in entries if e.failure is not None), None)
        if failure is None and function is None:
            failure = pb.RemoteFailure(type="ProtocolError", executor_id=self.executor_id,
                                       message=f"function {run.function_id} was never loaded on this executor")
        if failure is None:
            failure = function.failure
        job = ComputeJob(run, function.compiled if function else None, [])
        if failure is not None:
            job.failure = failure if failure.origin_call_id else _with_origin(failure, run.call_id)
            self.finish(job)
            return
        job.entries, job.signature = entries, function
        job.out_entries = [self.store.claim(_key(ref)) for ref in run.outputs]
        for entry in job.out_entries:
            entry.computing = True
        self._submit(job)

    def _take_inputs(self, job: ComputeJob) -> pb.RemoteFailure | None:
        """On the compute thread: the input values (stored, or handed over by a job just run here)."""
        for entry in job.entries:
            # Read order matters: the I/O thread sets value/failure before it clears early.
            failure = entry.failure or entry.early_failure or entry.failure
            if failure is not None:
                return failure if failure.origin_call_id else _with_origin(failure, job.run.call_id)
        job.inputs = [_value_of(e) for e in job.entries]
        return self._check_signature(job.run, job.signature, job.inputs)

    def _check_signature(self, run: pb.Run, function: _Function, values: list) -> pb.RemoteFailure | None:
        """Refuse inputs that do not match the traced signature (a bad put or a hostile peer)."""
        if len(values) != len(function.signature):
            problem = f"expected {len(function.signature)} inputs, got {len(values)}"
        else:
            problem = next((f"input {i}: expected {_spec(shape, dtype)}, got {_spec(tuple(v.shape), v.dtype)}"
                            for i, (v, (shape, dtype)) in enumerate(zip(values, function.signature))
                            if tuple(v.shape) != shape or dtype_name(v.dtype) != dtype), None)
        if problem is None:
            return None
        return pb.RemoteFailure(type="SignatureError", executor_id=self.executor_id, origin_call_id=run.call_id,
                                message=f"function {function.name!r}: {problem}")

    def compute(self, job: ComputeJob) -> ComputeJob:
        """Run a job (called on the compute thread); never raises."""
        if job.form is not None:
            return self._form_group(job)
        name = self._name(job.run.function_id)
        try:
            job.failure = self._take_inputs(job)
        except Exception as exc:  # never let the compute thread die: every later job would hang
            job.failure = self._failure(exc, origin_call_id=job.run.call_id)
        if job.failure is not None:
            self._hand_over(job)
            return job
        self.trace.record("start", name, seq=job.run.seq, call_id=job.run.call_id, function_id=job.run.function_id)
        try:
            with self.collectives.bind(job.run.axis_groups, seq=job.run.seq):
                job.outputs = self.backend.run(job.function, job.inputs)
            if len(job.outputs) != len(job.run.outputs):
                raise RuntimeError(f"function returned {len(job.outputs)} outputs, the call expects "
                                   f"{len(job.run.outputs)}")
            if job.run.digest_outputs:
                job.digests = [self.backend.digest(t) for t in job.outputs]
        except Exception as exc:
            job.outputs = None
            job.failure = self._failure(exc, origin_call_id=job.run.call_id)
        self.trace.record("end", name, seq=job.run.seq, call_id=job.run.call_id, function_id=job.run.function_id)
        self._hand_over(job)
        return job

    def _hand_over(self, job: ComputeJob) -> None:
        """Give the results to jobs queued behind this one, before the I/O thread stores them."""
        for index, entry in enumerate(job.out_entries):
            if job.outputs is not None:
                entry.early = job.outputs[index]
            else:
                entry.early_failure = job.failure
            entry.computing = False

    def _form_group(self, job: ComputeJob) -> ComputeJob:
        form = job.form
        self.trace.record("start", "form group", seq=form.seq, detail=f"group {form.group_id}")
        try:
            self.collectives.form(form.group_id, form.rank, form.size, form.store_path, form.timeout_s)
        except Exception as exc:  # runs that use the group fail with this reason
            log.warning("%s: forming group %s failed: %s", self.executor_id, form.group_id, exc)
        self.trace.record("end", "form group", seq=form.seq, detail=f"group {form.group_id}")
        return job

    def finish(self, job: ComputeJob) -> None:
        """Store a job's outputs (or its failure), release its inputs, tell the controller.

        Runs on the I/O thread: after the compute thread is done with ``job``, or at once for a
        job that failed before it could start.
        """
        if job.form is not None:
            self._pump()
            return
        run = job.run
        if job.outputs is not None:
            # Outputs were claimed (owned) when the Run arrived; a Free since then must stand.
            for ref, value in zip(run.outputs, job.outputs):
                self.store.fill(_key(ref), value.contiguous(), owned=False)
            self.num_computations += 1
        else:
            for ref in run.outputs:
                self.store.fill(_key(ref), failure=job.failure, owned=False)
        for ref in run.inputs:
            key = _key(ref)
            self.store.unpin(key)
            if ref.tag:  # a transient copy made for this call alone
                self.store.free(key)
        if not run.quiet:
            done = pb.Done(call_id=run.call_id, seq=run.seq, ok=job.failure is None, digests=job.digests)
            if job.failure is not None:
                done.failure.CopyFrom(job.failure)
            self.outbox.to_controller(pb.Envelope(done=done))
        self._pump()

    # ------------------------------------------------------------ helpers

    def _name(self, function_id: int) -> str:
        function = self.functions.get(function_id)
        return function.name if function else ""

    def _failure(self, exc: BaseException, *, origin_call_id: int) -> pb.RemoteFailure:
        return pb.RemoteFailure(type=type(exc).__name__, message=str(exc), executor_id=self.executor_id,
                                traceback="".join(traceback.format_exception(exc)), origin_call_id=origin_call_id)

    def _drop(self, why: str) -> None:
        self.dropped_messages += 1
        log_dropped(log, self.dropped_messages, self.executor_id, why)


_DATA_KINDS = {"put", "transfer", "fetch"}
_MAX_EARLY_TRANSFERS = 4096


def _with_origin(failure: pb.RemoteFailure, call_id: int) -> pb.RemoteFailure:
    copy = pb.RemoteFailure()
    copy.CopyFrom(failure)
    copy.origin_call_id = call_id
    return copy


def _value_of(entry):
    """An input's value: stored, or handed over early by the job that computed it here."""
    value = entry.value
    if value is None:
        value = entry.early
    if value is None:
        value = entry.value   # the I/O thread stored it (and cleared early) in between
    return value


def _value_ids(plan: pb.RegisterProgram, run: pb.RunProgram):
    """Map a program value number to the array id it has in this run."""
    fixed = dict(zip(plan.input_values, run.input_array_ids))
    fixed.update(zip(plan.output_values, run.output_array_ids))
    return lambda value: fixed.get(value, run.first_intermediate_id + value)


def _expand_run(node: pb.ProgramNode, run: pb.RunProgram, array_id) -> pb.Run:
    call_id = run.base_call_id + node.node
    expanded = pb.Run(seq=run.base_seq + node.node, call_id=call_id, function_id=node.function_id,
                      collective=node.collective, quiet=not node.report, digest_outputs=node.digest_outputs)
    for ref in node.inputs:
        expanded.inputs.add(array_id=array_id(ref.value), shard=ref.shard, tag=call_id if ref.copy else 0)
    for value in node.outputs:
        expanded.outputs.add(array_id=array_id(value), shard=node.shard)
    if node.collective:
        expanded.prev_collective_seq = (run.base_seq + node.prev_collective_node - 1 if node.prev_collective_node
                                        else run.prev_collective_seq)
        for axis, group in node.axis_groups.items():
            expanded.axis_groups[axis] = group
    return expanded


def _spec(shape, dtype) -> str:
    return f"{dtype_name(dtype)}{list(shape)}"


def payload_bytes(payload: list) -> list:
    """The raw buffers of received frames (for hashing)."""
    return [f.buffer if hasattr(f, "buffer") else f for f in payload]
