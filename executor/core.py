"""The executor's logic, independent of sockets and threads: a façade that routes messages to its parts.

`ExecutorCore` reacts to decoded messages and emits messages through an `Outbox`; work goes to a
`submit` callable (the compute thread in a real process, a synchronous fake in unit tests) and comes
back through `finish`. The core is single-threaded: in a process, the I/O thread (messages) and the
compute thread (`finish`) take turns under one lock; `compute` runs outside it.

It owns three collaborators, one idea each, and routes each control message to one of them through
a table (`_handlers`):

- `RunQueue` (`executor/run_queue.py`): the run queue and gang order, cancellation, completion;
- `StepInterpreter` (`executor/interpreter.py`): what the compute thread does with a job, by kind;
- `DataPlane` (`executor/data_plane.py`): puts, transfers, fetches and saves of the store.

What is left here: the routing itself, the executor's identity and settings (Welcome, admitted keys,
shutdown), loading functions, and the reports (Stats, trace).
"""

from __future__ import annotations

import collections
import logging
from typing import Callable

from pathways_torch.wire import pb
from pathways_torch.wire.framing import body_name, log_dropped

from .collectives import CollectiveRuntime
from .compile_cache import CompileCache, graph_key
from .data_roles import executor_of_role
from .data_plane import DataPlane
from .fusion import fusion_text
from .backends.mutated_inputs import mutated_inputs
from .interpreter import StepInterpreter
from .jobs import ComputeJob, LoadedFunction
from .launch_tree import TREE_DATA_KINDS, TreeIntake
from .messages import Outbox, program_run_refused, remote_failure, shard_key
from .run_queue import RunQueue
from .store import ObjectStore
from .trace import TraceRecorder

__all__ = ["ExecutorCore"]

log = logging.getLogger(__name__)


def _forwarded(part: str, name: str, doc: str) -> property:
    """A name read (and set) on the core that lives on one of its parts."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value), doc=doc)


class ExecutorCore:
    """Object store, run queue, transfers and fetches of one executor."""

    def __init__(self, *, executor_id: str, backend, outbox: Outbox,
                 submit: Callable[[ComputeJob], None], trace: TraceRecorder | None = None,
                 compiler: CompileCache | None = None, collectives: CollectiveRuntime | None = None,
                 gang_order: bool = True, program_order: bool = True):
        self.executor_id = executor_id
        self.backend = backend
        self.outbox = outbox
        self.trace = trace if trace is not None else TraceRecorder()  # an empty recorder is falsy
        self.store = ObjectStore()
        self.compiler = compiler if compiler is not None else CompileCache(backend, self.trace, background=False)
        self.functions: dict[int, LoadedFunction] = {}
        self.collectives = collectives if collectives is not None else CollectiveRuntime()
        self.num_function_loads = 0
        self.dropped_messages = 0
        self.counters: collections.Counter = collections.Counter()  # reported with Stats (e.g. refused connections)
        self.stopped = False
        self.heartbeat_settings: tuple[float, float] | None = None   # (interval, timeout) from Welcome
        self.asked_heartbeat_interval_s = 0.0   # the controller's last heartbeat answer asked for it (0: none yet)
        # Admits a replacement's fresh key on this process's sockets (set by ExecutorProcess; None in tests).
        self.admit_key: Callable[[str, bytes], None] | None = None

        self.data = DataPlane(executor_id=executor_id, backend=backend, store=self.store, outbox=outbox,
                              trace=self.trace, counters=self.counters, drop=self.drop)
        programs: dict = {}
        # Its place in a launch tree, and the merge of the orders its commands come in (executor/launch_tree.py).
        self.tree = TreeIntake(executor_id=executor_id, outbox=outbox, handle=self._handle_control, programs=programs,
                               free_array=self.store.free_array, drop=self.drop,
                               skip_gang=lambda prev, last: self.run_queue.skip_gang(prev, last))
        self.run_queue = RunQueue(executor_id=executor_id, store=self.store, functions=self.functions,
                                  outbox=self.tree.outbox, programs=programs, trace=self.trace, data=self.data,
                                  submit=submit, drop=self.drop,
                                  gang_order=gang_order, program_order=program_order)
        self.interpreter = StepInterpreter(executor_id=executor_id, backend=backend,
                                           collectives=self.collectives, trace=self.trace,
                                           hand_over=self.store.hand_over)
        self.programs = self.run_queue.programs
        # Bound here rather than forwarded: the compute thread calls them once per job.
        self.compute = self.interpreter.compute
        self.fail = self.interpreter.fail
        self.finish = self.run_queue.finish
        self.on_peer_reply = self.data.on_peer_reply
        self.check_transfers = self.data.check_transfers
        self._pump = self.run_queue.pump

        # Control messages by kind. Data kinds (put, transfer, fetch, save_shards) are not here: they come on
        # the data socket (`on_data`), and from the controller only as a failed transfer (`on_control`).
        self._handlers: dict[str, Callable] = {
            "welcome": self._on_welcome,
            "admit_key": self._on_admit_key,
            "heartbeat": self._on_heartbeat,
            "shutdown": self._on_shutdown,
            "load_function": self._on_load_function,
            "register_program": self.run_queue.on_register_program,
            "launch_tree": self._on_launch_tree,
            "run": self.run_queue.on_run,
            "run_program": self.run_queue.on_run_program,
            "form_group": self.run_queue.on_form_group,
            "cancel": self._on_cancel,
            "send_shard": self.data.on_send_shard,
            "free": self._on_free,
            "forget": self._on_forget,
            "stats_request": self._on_stats_request,
            "trace_request": self._on_trace_request,
        }

    # What the process wrapper, Stats and the tests read on the core; each lives on the part that keeps it.
    data_gate = _forwarded("data", "data_gate", "Who may send what on the data socket (`DataGate`).")
    hop_bytes = _forwarded("data", "hop_bytes", "Tensor bytes moved, by hop.")
    transfers_lost = _forwarded("data", "transfers_lost", "Transfers sent here and never acknowledged in time.")
    transfer_timeout_s = _forwarded("data", "transfer_timeout_s", "How long a transfer may go unacknowledged.")
    num_computations = _forwarded("run_queue", "num_computations", "Steps run here.")
    queue_high_water = _forwarded("run_queue", "queue_high_water", "The most work ever waiting here at once.")
    cancelled = _forwarded("run_queue", "cancelled", "Queued segments and formations dropped by Cancel.")
    # Private names the unit tests read or replace on the core (to drive gang order, or to plant a bug in
    # handling a Run); they live on the run queue and the data plane.
    _queue = _forwarded("run_queue", "queued", "Queued segments and formations, in sequence order.")
    _last_collective_seq = _forwarded("run_queue", "last_collective_seq", "The last collective action started.")
    _submit = _forwarded("run_queue", "submit", "Hands a job to the compute thread.")
    _start_now = _forwarded("run_queue", "_start_now", "Starts a plain Run at once if it can.")
    _unacked = _forwarded("data", "unacked", "Transfers sent and not yet acknowledged.")

    # ------------------------------------------------------------ control plane

    def on_control(self, envelope: pb.Envelope, payload: list) -> None:
        if envelope.command_index or envelope.launches_before or envelope.HasField("tree_launch"):
            self.tree.on_command(envelope, payload)   # in a launch tree: the controller's order, merged back
            return
        self._handle_control(envelope, payload)

    def on_data(self, identity: bytes, envelope: pb.Envelope, payload: list, *, role: str | None,
                key: bytes | None = None, reply=None) -> None:
        """A message on the data socket: a launch from this executor's parent, a batch of Dones from a child, or
        the data plane's (`DataPlane.on_data`). ``reply(identity, envelope)``: how a transfer's acknowledgement
        goes back (the transfer inbox's), if not on the data socket."""
        kind = body_name(envelope)
        if kind not in TREE_DATA_KINDS:
            self.data.on_data(identity, envelope, payload, role=role, key=key, reply=reply)
            return
        if self.data.refuses(role, envelope, key):
            return
        self.counters[f"handled:data:{kind}"] += 1
        if kind == "tree_launch":
            self.tree.on_launch(envelope.tree_launch, executor_of_role(role) or "")
        else:
            self.tree.on_done_batch(envelope.done_batch, role)

    def _handle_control(self, envelope: pb.Envelope, payload: list) -> None:
        for ref in envelope.frees:   # frees ride on the next message; they come before its body
            self.store.free(shard_key(ref))
        kind = body_name(envelope)
        if kind == "transfer" and envelope.transfer.failed:
            # The controller fails a copy whose sender was lost: no one else will ever push it.
            self.counters["handled:command:transfer"] += 1
            self.data.on_transfer(envelope.transfer, payload)
            return
        handler = self._handlers.get(kind)
        if handler is None:
            self.drop(f"control message of type {kind!r} not expected from the controller")
            return
        self.counters[f"handled:command:{kind}"] += 1   # reached its handler (Stats reports it; bench/fuzz.py)
        try:
            handler(getattr(envelope, kind), payload)
        except Exception as exc:
            if kind == "run":
                self.run_queue.refuse_run(envelope.run, exc)
            elif kind == "run_program":
                log.exception("%s: handling a run of program %d failed", self.executor_id,
                              envelope.run_program.program_id)
                self.outbox.to_controller(program_run_refused(
                    self.executor_id, envelope.run_program,
                    remote_failure(exc, self.executor_id, origin_call_id=0).traceback))
            else:
                raise    # the compute loop logs it; these kinds name no call

    def heartbeat_timing(self, interval_s: float, timeout_s: float) -> tuple[float, float]:
        """(interval, timeout) of the next ping: the Welcome's pair (else the given one), with the interval the
        controller's answers ask for (it spreads the pings of many executors out)."""
        interval_s, timeout_s = self.heartbeat_settings or (interval_s, timeout_s)
        asked = self.asked_heartbeat_interval_s
        return (asked if 0 < asked < timeout_s else interval_s), timeout_s

    def _on_welcome(self, msg: pb.Welcome, payload) -> None:
        self.trace.record("receive", "welcome", detail=f"index {msg.index}")
        # The controller's heartbeat settings rule (an executor that joined from another host was started
        # without them): the liveness thread reads this pair on its next beat.
        if 0 < msg.heartbeat_interval_s < msg.heartbeat_timeout_s:
            self.heartbeat_settings = (msg.heartbeat_interval_s, msg.heartbeat_timeout_s)
        if msg.transfer_timeout_s > 0:
            self.data.transfer_timeout_s = msg.transfer_timeout_s
        self.data.epoch = self.tree.epoch = msg.epoch
        if msg.put_secret:   # service clients' puts are checked with it (executor/data_roles.py, OwnerCheck)
            self.data.owners.put_secret = bytes(msg.put_secret)
            self.data.welcomed()

    def _on_admit_key(self, msg: pb.AdmitKey, payload) -> None:
        self.trace.record("receive", "admit key", detail=msg.role)
        if self.admit_key is None:
            self.drop(f"admit_key for {msg.role}: no gatekeeper here")
            return
        self.admit_key(msg.role, bytes(msg.public_key))

    def _on_cancel(self, msg: pb.Cancel, payload) -> None:
        """An executor of this island was lost: refuse what it still sends, drop the work of the calls that failed
        with it (`RunQueue.cancel`)."""
        for lost in msg.lost_executors or [msg.lost_executor]:
            self.data.data_gate.retire(lost)   # its transfers still on their way are refused from now on
        self.collectives.abandon_groups(msg.group_ids, msg.reason)   # before the queue skips their formations
        self.run_queue.cancel(msg)
        self.tree.cancel(msg)

    def _on_launch_tree(self, msg: pb.LaunchTree, payload) -> None:
        self.trace.record("receive", "launch tree", detail=f"generation {msg.generation}, position {msg.position}, "
                                                            f"{len(msg.children)} children")
        self.tree.tree = msg

    def _on_heartbeat(self, msg: pb.Heartbeat, payload) -> None:
        pass  # liveness is tracked by the process wrapper on any message

    def _on_shutdown(self, msg: pb.Shutdown, payload) -> None:
        log.info("%s: shutdown requested (%s)", self.executor_id, msg.reason)
        self.stopped = True

    def _on_forget(self, msg: pb.Forget, payload) -> None:
        """A client left, or dropped these functions and programs: they go (a compiled executable stays in the
        compile cache, keyed by its graph, bounded as that cache is)."""
        for function_id in msg.function_ids:
            self.functions.pop(function_id, None)
        for program_id in msg.program_ids:
            self.run_queue.programs.pop(program_id, None)
            self.tree.forget_program(program_id)

    def _on_load_function(self, msg: pb.LoadFunction, payload) -> None:
        self.trace.record("receive", f"load {msg.name}", function_id=msg.function_id)
        self.num_function_loads += 1
        function = self.functions[msg.function_id] = LoadedFunction(msg.name, [])
        try:
            function.signature = [(tuple(m.shape), m.dtype) for m in msg.graph.inputs]
            graph_module, examples = self.backend.prepare(msg, payload)
            if getattr(self.backend, "mutable_values", False):
                function.mutates = mutated_inputs(graph_module)
        except Exception as exc:
            log.warning("%s: function %s refused: %s", self.executor_id, msg.name, exc)
            self._function_ready(function, None, exc)
            return
        # The declared sim time is part of what the function is (two sim steps may share a graph).
        key = graph_key(msg.graph.SerializeToString(deterministic=True) + repr(msg.sim_seconds).encode(),
                        _payload_bytes(payload))
        self.compiler.request(key, msg.name, graph_module, examples,
                              lambda compiled, error: self._function_ready(function, compiled, error))

    def _function_ready(self, function: LoadedFunction, compiled, error: BaseException | None) -> None:
        function.compiled, function.ready = compiled, True
        # XLA consumes the inputs it was given (buffer donation): the executor passes copies of shared ones.
        function.mutates = getattr(compiled, "donated_inputs", function.mutates)
        if error is not None:
            function.failure = remote_failure(error, self.executor_id, origin_call_id=0)
        self._pump()

    def _on_free(self, msg: pb.Free, payload) -> None:
        # A Free with spent puts names put arrays' shards only (controller/arrays.py): a shard not put by now
        # never will be, and the runs that wait for it fail
        if msg.spent_puts:
            for ref in msg.shards:
                self.store.give_up(shard_key(ref), pb.RemoteFailure(
                    type="PutAbandoned", executor_id=self.executor_id,
                    message=f"array {ref.array_id} shard {ref.shard} was freed before its put came (its client left, "
                            f"or said it landed without putting it): a run that reads it cannot run"))
        for ref in msg.shards:
            self.store.free(shard_key(ref))
        if msg.spent_puts:   # a put that comes after its array was freed is refused, never kept
            self.data.spend_puts(msg.spent_puts)

    def _on_stats_request(self, msg: pb.StatsRequest, payload) -> None:
        stats = pb.Stats(request_id=msg.request_id, executor_id=self.executor_id,
                         store_bytes=self.store.bytes, store_buffers=len(self.store),
                         num_computations=self.num_computations, num_function_loads=self.num_function_loads,
                         num_compiles=self.backend.num_compiles(), backend=self.backend.name,
                         queue_high_water=self.queue_high_water,
                         store_bytes_high_water=self.store.take_high_water(), transfers_lost=self.transfers_lost,
                         programs_held=len(self.run_queue.programs), functions_held=len(self.functions))
        for name, count in self.backend.counters().items():
            stats.backend_counters[name] = count
        stats.fusion.extend(fusion_text(self.run_queue.programs))
        for hop, count in self.hop_bytes.items():
            stats.hop_bytes[hop] = count
        # Stats has no fields for these counts yet: they ride in hop_bytes under reserved names.
        stats.hop_bytes["dropped_messages"] = self.dropped_messages
        stats.hop_bytes["handed_over"] = self.store.handed_over
        for name, count in self.counters.items():
            stats.hop_bytes[name] = count
        self.outbox.to_controller(pb.Envelope(stats=stats))

    def _on_trace_request(self, msg: pb.TraceRequest, payload) -> None:
        reply = pb.TraceReply(request_id=msg.request_id, executor_id=self.executor_id)
        self.trace.fill(reply)
        self.outbox.to_controller(pb.Envelope(trace_reply=reply))

    def drop(self, why: str) -> None:
        """Count and log a message that is not handled (malformed, unexpected, from a stranger)."""
        self.dropped_messages += 1
        log_dropped(log, self.dropped_messages, self.executor_id, why)


def _payload_bytes(payload: list) -> list:
    """The raw buffers of received frames (for hashing)."""
    return [f.buffer if hasattr(f, "buffer") else f for f in payload]
