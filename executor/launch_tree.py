"""An executor's part in its island's launch tree (controller/launch_tree.py, docs/scale.md).

A program run on every executor of an island comes down a tree: from the controller to its children, from each to
its own. This executor forwards each launch to its children, runs it, and sends one batch up with its own Dones and
those of its subtree once all are in (a failed Done goes to the controller at once).

Its commands still come straight from the controller, so what it is told arrives in two orders: the commands on
the command connection, the launches from its parent. `TreeIntake` merges them back into the controller's: a
numbered command waits until every launch sent before it has come (``launches_before``), a launch until every
command sent before it has (``commands_before``). An unnumbered message (a Cancel) is handled as it comes; one that
says the tree ended (``launches_before`` set) counts the launches that will never come as come.

Imports no torch (the simulated executor uses it).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
import time
from typing import Callable

from pathways_torch.wire import pb

from .data_roles import executor_of_role

__all__ = ["TreeIntake", "TREE_DATA_KINDS"]

log = logging.getLogger(__name__)

TREE_DATA_KINDS = frozenset({"tree_launch", "done_batch"})   # what a parent or a child sends on the data socket


@dataclasses.dataclass
class _Batch:
    """The Dones of one run in this executor's subtree, until all are in."""

    message: pb.DoneBatch
    children: set[str]          # children whose batch has not come
    own_left: int               # this executor's reporting steps not done yet
    parent: str
    parent_address: str
    parent_key: bytes
    calls: tuple[int, ...] = ()
    groups: dict[int, pb.DoneGroup] = dataclasses.field(default_factory=dict)   # call id → its ok Dones, compact

    def add_ok(self, call_id: int, executor_ids, device_ns: int) -> None:
        """Successes of ``call_id`` with nothing more to report: one group per call, whatever the subtree."""
        group = self.groups.get(call_id)
        if group is None:
            group = self.groups[call_id] = self.message.groups.add(call_id=call_id)
        group.executor_ids.extend(executor_ids)
        group.device_ns += device_ns


class _BatchingOutbox:
    """The run queue's outbox: a Done of a step launched down the tree joins its run's batch."""

    def __init__(self, outbox, intake: "TreeIntake"):
        self._outbox, self._intake = outbox, intake

    def to_controller(self, envelope: pb.Envelope, payload=()) -> None:
        if envelope.HasField("done") and self._intake.batched(envelope.done):
            return
        self._outbox.to_controller(envelope, payload)

    def __getattr__(self, name):
        return getattr(self._outbox, name)


class TreeIntake:
    """Merges this executor's two command orders and plays its part in the launch tree.

    ``handle(envelope, payload)`` handles a command now (the core's routing); ``programs`` is the run queue's table
    of registered programs (its plans say which steps report); ``free_array`` frees an array's shards here."""

    def __init__(self, *, executor_id: str, outbox, handle: Callable, programs: dict,
                 free_array: Callable[[int], None], drop: Callable[[str], None],
                 skip_gang: Callable[[int, int], None] = lambda prev, last: None):
        self.executor_id = executor_id
        self._outbox, self._handle, self._programs = outbox, handle, programs
        self._free_array, self._drop, self._skip_gang = free_array, drop, skip_gang
        self.outbox = _BatchingOutbox(outbox, self)
        self.tree: pb.LaunchTree | None = None
        self.dead_generation = 0     # trees up to this one ended: their launches still coming are dropped
        self.last_command = 0        # the index of the last numbered command handled
        self.launches = 0            # launches handled (or known never to come)
        self._held_commands: collections.deque = collections.deque()
        self._held_launches: list = []   # (commands_before, arrival, launch, sender), in the controller's order
        self._arrivals = 0
        self._batches: dict[int, _Batch] = {}    # run's first call id → its batch
        self._by_call: dict[int, _Batch] = {}    # a reporting step's call id → its run's batch
        self._reports: dict[int, tuple] = {}     # program id → (its plan, the nodes that report here)
        self.forwarded = 0                       # launches sent to children (Stats, tests)
        # This incarnation (the Welcome's): a peer refuses what an incarnation it knows was replaced sends (DataGate).
        self.epoch = 0
        # When the launch being handled came (a simulated executor: the start of the poll turn that read it), and
        # while its run is handled, when its parent had it (`TreeLaunch.sent_at`; None: from the controller).
        self.arrival_time: Callable[[], float] = time.monotonic
        self.launch_sent_at: float | None = None

    # ------------------------------------------------------------ the two orders

    def on_command(self, envelope: pb.Envelope, payload) -> None:
        """A message from the controller that carries numbers, or a launch from it (this executor is a root)."""
        if envelope.HasField("tree_launch"):
            self.on_launch(envelope.tree_launch, "")
            return
        if not envelope.command_index:   # unnumbered: now
            if envelope.launches_before:
                self._end_tree(envelope.launches_before)
                pairs = envelope.cancel.skip_collectives
                for prev, last in zip(pairs[::2], pairs[1::2]):   # before the Cancel is handled: it pumps the queue
                    self._skip_gang(prev, last)
            self._handle(envelope, payload)
        else:
            self._held_commands.append((envelope, payload))
        self._release()

    def on_launch(self, launch: pb.TreeLaunch, sender: str) -> None:
        """A launch from this executor's parent (``sender``: the executor it came from, "" for the controller)."""
        if launch.generation <= self.dead_generation:
            return   # its tree ended with a loss: its run failed with it
        self._arrivals += 1
        bisect.insort(self._held_launches, (launch.commands_before[0], self._arrivals, launch, sender))
        self._release()

    def _release(self) -> None:
        """Handle what is due, in the controller's order."""
        while True:
            if self._held_commands and self._held_commands[0][0].launches_before <= self.launches:
                envelope, payload = self._held_commands.popleft()
                self.last_command = envelope.command_index
                self._handle(envelope, payload)   # a LaunchTree among them sets `tree`
            elif self._held_launches and self._held_launches[0][0] <= self.last_command:
                _, _, launch, sender = self._held_launches.pop(0)
                self._launch(launch, sender)
            else:
                return

    def _end_tree(self, through: int) -> None:
        """The controller ended this executor's tree: launches up to ``through`` will never come."""
        if self.tree is not None:
            self.dead_generation = max(self.dead_generation, self.tree.generation)
            self.tree = None
        self.launches = max(self.launches, through)
        self._held_launches = [item for item in self._held_launches if item[2].generation > self.dead_generation]

    # ------------------------------------------------------------ a launch

    def _launch(self, launch: pb.TreeLaunch, sender: str) -> None:
        tree = self.tree
        if tree is None or launch.generation != tree.generation or launch.position != tree.position:
            self.launches += 1   # counted: the commands after it must not wait for it forever
            self._drop(f"a launch of tree {launch.generation} at position {launch.position}; this executor is at "
                       f"{f'position {tree.position} of tree {tree.generation}' if tree else 'no tree'}")
            return
        if sender != tree.parent:
            self._drop(f"a launch from {sender or 'the controller'}: expected it from "
                       f"{tree.parent or 'the controller'}, this executor's parent in tree {tree.generation} (refused)")
            return
        self.launches += 1
        sent_at = (launch.sent_at or self.arrival_time()) if tree.children else 0.0
        for child in tree.children:   # first: the subtree starts while this executor handles its own part
            part = pb.TreeLaunch(generation=tree.generation, position=child.position,
                                 prev_collective_seqs=launch.prev_collective_seqs[child.position - tree.position:
                                                                                  child.end - tree.position],
                                 commands_before=launch.commands_before[child.position - tree.position:
                                                                        child.end - tree.position],
                                 free_array_ids=launch.free_array_ids, sent_at=sent_at)
            part.run.CopyFrom(launch.run)
            self._outbox.to_peer(child.data_address, pb.Envelope(tree_launch=part, epoch=self.epoch),
                                 public_key=child.public_key)
            self.forwarded += 1
        for array_id in launch.free_array_ids:
            self._free_array(array_id)
        run = launch.run
        self._open_batch(tree, run)
        run.prev_collective_seq = launch.prev_collective_seqs[0]
        self.launch_sent_at = launch.sent_at or None
        try:
            self._handle(pb.Envelope(run_program=run), ())
        finally:
            self.launch_sent_at = None

    # ------------------------------------------------------------ Dones on the way up

    def _open_batch(self, tree: pb.LaunchTree, run: pb.RunProgram) -> None:
        nodes = self._reporting_nodes(run.program_id)
        batch = _Batch(pb.DoneBatch(generation=tree.generation, base_call_id=run.base_call_id),
                       {child.executor_id for child in tree.children}, len(nodes), tree.parent, tree.parent_address,
                       bytes(tree.parent_key), tuple(run.base_call_id + node for node in nodes))
        self._batches[run.base_call_id] = batch
        for call_id in batch.calls:
            self._by_call[call_id] = batch
        self._flush(batch)

    def _reporting_nodes(self, program_id: int) -> tuple[int, ...]:
        registered = self._programs.get(program_id)
        if registered is None:
            return ()   # the run is refused here (a failed Done, straight to the controller)
        plan = registered[0]
        cached = self._reports.get(program_id)
        if cached is None or cached[0] is not plan:
            nodes = tuple(a.run.node for a in plan.actions if a.WhichOneof("kind") == "run" and a.run.report)
            cached = self._reports[program_id] = (plan, nodes)
        return cached[1]

    def forget_program(self, program_id: int) -> None:
        """The program was forgotten here: its plan must not stay alive in this cache."""
        self._reports.pop(program_id, None)

    def batched(self, done: pb.Done) -> bool:
        """Whether ``done`` joins a batch (a failure counts there but still goes to the controller at once)."""
        batch = self._by_call.pop(done.call_id, None)
        if batch is None:
            return False
        batch.own_left -= 1
        if done.ok and not (done.digests or done.output_shapes):
            batch.add_ok(done.call_id, (self.executor_id,), done.device_ns)
        elif done.ok:
            entry = batch.message.dones.add()
            entry.CopyFrom(done)
            entry.executor_id = self.executor_id
        self._flush(batch)
        return done.ok

    def on_done_batch(self, message: pb.DoneBatch, role: str | None) -> None:
        """A child's batch: its subtree's Dones of one run."""
        child = executor_of_role(role)
        batch = self._batches.get(message.base_call_id)
        if batch is None or child not in batch.children:
            self._drop(f"a batch of Dones of run {message.base_call_id} from {role!r}, which this executor does not "
                       f"wait for (its run was cancelled, or it is not a child here)")
            return
        batch.children.discard(child)
        batch.message.dones.extend(message.dones)
        for group in message.groups:
            batch.add_ok(group.call_id, group.executor_ids, group.device_ns)
        self._flush(batch)

    def _flush(self, batch: _Batch) -> None:
        if batch.own_left > 0 or batch.children:
            return
        self._batches.pop(batch.message.base_call_id, None)
        envelope = pb.Envelope(done_batch=batch.message, epoch=self.epoch)
        if batch.parent:
            self._outbox.to_peer(batch.parent_address, envelope, public_key=batch.parent_key)
        else:
            self._outbox.to_controller(envelope)

    def cancel(self, msg: pb.Cancel) -> None:
        """Runs that failed with a lost executor: their batches will never fill (a child may be the lost one)."""
        for call_id in msg.call_ids:
            batch = self._batches.pop(call_id, None)
            if batch is not None:
                for reporting in batch.calls:
                    self._by_call.pop(reporting, None)
