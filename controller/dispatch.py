"""The controller's façade: the construction and wiring of its parts, and the routing of executors' messages.

`Controller` reacts to messages from executors and to calls from the client; it
emits messages through an outbox (a socket loop in a real process, a fake in unit
tests). Each idea is a part of its own, which the façade builds and exposes; callers call the part that does the
work (``controller.call_dispatch.call(spec)``, ``controller.members.declare_lost(...)``):

- `Membership` (membership.py, ``members``): registration, incarnations, heartbeats and loss;
- `ProcessGroups` (groups.py, ``groups``): the groups collectives run in, and their abandonment after a fault;
- `CallDispatch` (calls.py, ``call_dispatch``): functions, calls, program runs and the run-ahead bound;
- `Completion` (completion.py, ``completion``): Done reports and lost transfers;
- `CallFailures` (failures.py, ``failures``): the errors of failed calls, kept while their outputs are held;
- `Lifetimes` (arrays.py, ``lifetimes``): puts landing, releases and the frees they send;
- `ExecutorRequests` (requests.py, ``requests``): stats and trace requests to every executor;
- `LaunchTrees` (launch_tree.py, ``launch_trees``): program runs down a tree of an island's executors.

The parts share one lock (a call, a Done and a loss must see one state) and the tables several of them read and
write: `ControllerState` (state.py) holds both, with ``send``, ``drop``, ``config`` and the clock, and each part
gets it. No part holds the façade: each gets, by name, the parts it calls. They are built in the order of those
calls, so none is wired after construction and none calls back into one built later:

    groups, requests, failures → lifetimes → launch_trees → call_dispatch → members → completion

(`CallFailures` is what breaks the circles: a loss and a Done both fail calls there, and a forgotten output
forgets its error there, so neither `Membership` nor `Lifetimes` needs `Completion`; and a part that only refuses
work for a lost executor asks the executors' table, `ResourceManager.check_live`.) ``config`` may be replaced (a
benchmark does): it lives in the state, where the parts read it at each use.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable, Protocol, Sequence

from pathways_torch.errors import ExecutorLostError
from pathways_torch.wire import pb
from pathways_torch.wire.framing import body_name, log_dropped

from .admission import Admission
from .arrays import Lifetimes, shard_refs
from .calls import CallDispatch
from .completion import Completion
from .config import ControllerConfig
from .failures import CallFailures
from .groups import ProcessGroups
from .launch_tree import UNNUMBERED_KINDS, LaunchTrees
from .membership import Membership
from .memory import MemoryBudget
from .rendezvous import RendezvousStore
from .requests import ExecutorRequests
from .resources import ExecutorInfo
from .state import ControllerState

__all__ = ["Controller", "ControllerOutbox"]

log = logging.getLogger(__name__)

# on_message's kinds (and register)
_HANDLED = ("done", "done_batch", "transfer_lost", "stats", "trace_reply", "heartbeat")


class ControllerOutbox(Protocol):
    def to_executor(self, executor_id: str, envelope: pb.Envelope, payload: Sequence = ()) -> None: ...


class Controller:
    """One island's controller state; thread-safe (client threads and the I/O thread)."""

    def __init__(self, outbox: ControllerOutbox, config: ControllerConfig | None = None, clock=time.monotonic):
        config = config or ControllerConfig()
        self.outbox = outbox
        self.clock = clock
        # The lock and the tables every part shares (state.py).
        self.state = ControllerState(send=self.send, drop=self.drop, config=config, clock=clock,
                                     rendezvous=RendezvousStore(config.group_timeout_s))
        self.resources, self.arrays = self.state.resources, self.state.arrays
        self.sequencers, self.rendezvous = self.state.sequencers, self.state.rendezvous
        # Which client's call each island takes next, by proportional share (enabled by a client service).
        self.admission = Admission(window=config.share_window_calls)
        # Each executor's bytes of arrays against --executor-memory-bytes (0: nothing counted; memory.py).
        self.memory = MemoryBudget(config.executor_memory_bytes)
        self.messages_sent: collections.Counter = collections.Counter()
        self.dropped_messages = 0
        self.handled_messages: collections.Counter = collections.Counter()   # by kind, on executors' control
        # Called (under the lock) when an executor is lost, e.g. to fail the client's fetches from it.
        self.loss_listeners: list[Callable[[str, ExecutorLostError], None]] = []
        # Called (under the lock, on the I/O thread) when an executor registers again: a new incarnation took its
        # place (the client talks to it at its new address from then on).
        self.incarnation_listeners: list[Callable[[ExecutorInfo], None]] = []
        # Where each executor runs, for the errors that name it (under pathways-run: "node 1 at 10.0.0.2").
        self.executor_labels: dict[str, str] = {}
        # The parts, each built after the parts it calls (module docstring).
        state = self.state
        self.groups = ProcessGroups(state)
        self.requests = ExecutorRequests(state)
        self.failures = CallFailures()
        self.lifetimes = Lifetimes(state, memory=self.memory, failures=self.failures)
        self.launch_trees = LaunchTrees(state, lifetimes=self.lifetimes, outbox=outbox,
                                        messages_sent=self.messages_sent)
        self.call_dispatch = CallDispatch(state, admission=self.admission, memory=self.memory, groups=self.groups,
                                          launch_trees=self.launch_trees)
        self.members = Membership(state, groups=self.groups, failures=self.failures, dispatch=self.call_dispatch,
                                  lifetimes=self.lifetimes, launch_trees=self.launch_trees,
                                  labels=self.executor_labels, loss_listeners=self.loss_listeners,
                                  incarnation_listeners=self.incarnation_listeners)
        self.completion = Completion(state, groups=self.groups, launch_trees=self.launch_trees,
                                     dispatch=self.call_dispatch, members=self.members, failures=self.failures)

    @property
    def config(self) -> ControllerConfig:
        """The controller's configuration; replaceable while it runs (the parts read it at each use)."""
        return self.state.config

    @config.setter
    def config(self, config: ControllerConfig) -> None:
        self.state.config = config

    # ------------------------------------------------------------ messages from executors

    def on_message(self, executor_id: str, envelope: pb.Envelope, payload: list) -> None:
        """Route a message from an executor's control connection to the part that handles it."""
        kind = body_name(envelope)
        with self.state.lock:
            info = self.resources.executors.get(executor_id)
            if info is not None and envelope.epoch and envelope.epoch != info.epoch:
                self.members.stale_messages += 1
                self.drop(f"{kind} from incarnation {envelope.epoch} of {executor_id}, which was replaced by "
                          f"incarnation {info.epoch}")
                return
            if info is not None:
                info.last_heard = self.clock()
            if kind == "register" or (info is not None and not info.lost and kind in _HANDLED):
                self.handled_messages[kind] += 1   # reached its handler (what bench/fuzz.py reports)
            if kind == "register":
                self.members.on_register(executor_id, envelope.register)
            elif info is None or info.lost:
                self.drop(f"{kind} from unknown or lost executor {executor_id!r}")
            elif kind == "done":
                call = self.state.calls.get(envelope.done.call_id)
                try:
                    self.completion.on_done(executor_id, envelope.done)
                except Exception as exc:   # a bug of ours: the call must still end, with the reason
                    self.completion.fail_done_call(call, exc)
            elif kind == "done_batch":
                self.completion.on_done_batch(executor_id, envelope.done_batch)
            elif kind == "transfer_lost":
                self.completion.on_transfer_lost(executor_id, envelope.transfer_lost)
            elif kind in ("stats", "trace_reply"):
                self.requests.on_reply(executor_id, getattr(envelope, kind).request_id, envelope)
            elif kind != "heartbeat":
                self.drop(f"unexpected {kind!r} from {executor_id}")

    def drop(self, why: str) -> None:
        """Count and log a message dropped as malformed or unexpected."""
        self.dropped_messages += 1
        log_dropped(log, self.dropped_messages, "controller", why)

    def send(self, executor_id: str, envelope: pb.Envelope, payload: Sequence = ()) -> None:
        """Send on the calling thread's order; pending frees for the executor ride along.

        A free rides on a message sent after the release; any Run that reads the array
        was sent before it (a released array cannot be called with), so it is pinned there.
        """
        kind = body_name(envelope)
        if kind in UNNUMBERED_KINDS:
            # Handled on arrival, ahead of commands a launch tree holds back (controller/launch_tree.py): a free on
            # it could pass the Run that reads the array. And one Cancel goes to every survivor: each its own copy.
            copy = pb.Envelope()
            copy.CopyFrom(envelope)
            envelope, frees = copy, None
        else:
            frees = self.lifetimes.take_pending_frees(executor_id)
        if frees and not envelope.HasField("free"):
            envelope.frees.extend(shard_refs(frees))
        elif frees:
            envelope.free.shards.extend(shard_refs(frees))
        self.messages_sent[kind] += 1
        self.launch_trees.stamp(executor_id, envelope)   # set on the envelope just before it is encoded
        self.outbox.to_executor(executor_id, envelope, payload)
