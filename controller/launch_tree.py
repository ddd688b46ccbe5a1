"""Launch trees: a program run on every executor of an island goes down a tree, not to each executor.

The controller sends one run of a program to its ``fanout`` children in the island's tree; each executor forwards
it to its own children (`executor/launch_tree.py`) and sends the Dones of its subtree up in one batch. The
controller sends and receives ``fanout`` messages per run, not one per executor (docs/scale.md).

An executor then hears from the controller in two orders: its commands, on the command connection, and the
launches, from its parent. Both are numbered here so that it can merge them back into the controller's order
(`stamp`): every command carries its index and the count of launches sent to the executor before it, and every
launch the index of the last command before it. A lost executor ends its island's tree: the launches still on
their way belong to runs that failed with it, and the next unnumbered message to each survivor (the Cancel) says
how many launches it will never get.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Sequence

from pathways_torch.wire import pb
from pathways_torch.wire.framing import body_name

__all__ = ["IslandTree", "LaunchTrees", "build_tree", "UNNUMBERED_KINDS"]

# Handled as they come, not in the command order: a Cancel is how a survivor learns that launches will never come,
# and a Shutdown must not wait behind them either.
UNNUMBERED_KINDS = frozenset({"cancel", "shutdown"})
_KEPT_GENERATIONS = 8   # trees kept after they end, for the Dones of their runs still on the way up


@dataclasses.dataclass(frozen=True)
class IslandTree:
    """One generation of an island's tree. ``members`` in pre-order: the subtree of position p is the positions
    [p, ends[p]); ``parents[p]`` is the position of its parent, -1 for the controller's children."""

    island: str
    generation: int
    members: tuple[str, ...]
    ends: tuple[int, ...]
    parents: tuple[int, ...]
    registered: int = 0   # executors the controller knew when it was made (one more: see whether it still spans)

    @functools.cached_property
    def member_set(self) -> frozenset:
        return frozenset(self.members)

    @functools.cached_property
    def _positions(self) -> dict[str, int]:
        return {executor_id: position for position, executor_id in enumerate(self.members)}

    @functools.cached_property
    def roots(self) -> tuple[int, ...]:
        return tuple(p for p, parent in enumerate(self.parents) if parent < 0)

    def children(self, position: int) -> list[int]:
        return [p for p in range(position + 1, self.ends[position]) if self.parents[p] == position]

    def position(self, executor_id: str) -> int:
        return self._positions[executor_id]

    def describe(self) -> str:
        """The tree as text: one line per executor, indented by depth."""
        lines = [f"launch tree of island {self.island}, generation {self.generation}: {len(self.members)} executors, "
                 f"{len(self.roots)} sent to by the controller"]
        depth = [0] * len(self.members)
        for p, parent in enumerate(self.parents):
            depth[p] = 0 if parent < 0 else depth[parent] + 1
            kids = len(self.children(p))
            lines.append(f"{'  ' * (depth[p] + 1)}{self.members[p]} [{p}, {self.ends[p]})"
                         f"{f' -> {kids} children' if kids else ''}")
        return "\n".join(lines)


def build_tree(island: str, generation: int, members: Sequence[str], fanout: int, registered: int = 0) -> IslandTree:
    """A tree of ``members`` where the controller and every executor send to at most ``fanout`` children, each
    subtree a contiguous run of positions (so a launch carries its subtree's part of a table as one slice)."""
    if fanout < 2:
        raise ValueError(f"launch tree fanout: expected 2 or more children per executor, got {fanout}")
    n = len(members)
    ends, parents = [0] * n, [0] * n

    def place(lo: int, hi: int, parent: int) -> None:
        """Split [lo, hi) into at most ``fanout`` contiguous subtrees under ``parent``."""
        count = min(fanout, hi - lo)
        start = lo
        for k in range(count):
            size = (hi - lo) // count + (1 if k < (hi - lo) % count else 0)
            ends[start], parents[start] = start + size, parent
            if size > 1:
                place(start + 1, start + size, start)
            start += size

    if n:
        place(0, n, -1)
    return IslandTree(island, generation, tuple(members), tuple(ends), tuple(parents), registered)


class LaunchTrees:
    """The controller's launch trees, one per island, and the numbering of what it sends to their executors.

    Used under the controller's lock. A program run takes a tree only when it runs on every live executor of one
    island and there are at least ``launch_tree_min_executors`` of them (`tree_for`). A launch goes to ``outbox``
    as it is (counted in ``messages_sent``), not through `Controller.send`, with the frees pending for the tree's
    members (``lifetimes``)."""

    def __init__(self, state, *, lifetimes, outbox, messages_sent):
        self._state = state
        self.resources, self._calls, self._send = state.resources, state.calls, state.send
        self._lifetimes, self._outbox, self._messages_sent = lifetimes, outbox, messages_sent
        self._trees: dict[str, IslandTree] = {}
        self._ended: collections.OrderedDict[int, IslandTree] = collections.OrderedDict()
        self._generations = 0
        self.commands_sent: collections.Counter = collections.Counter()   # numbered commands, per executor
        self.launches_sent: collections.Counter = collections.Counter()   # tree launches, per executor
        self._numbered: set[str] = set()      # executors that were ever in a tree: their commands stay numbered
        self._tree_ended: dict[str, int] = {}  # their tree ended (its generation): the next unnumbered message says so
        # Runs launched down a tree whose collectives hold gang places: first call id → (generation, executor →
        # (its collective before the run, the run's last one there)), while a call of theirs may be in flight.
        self._gang_runs: dict[int, tuple[int, dict]] = {}

    # ------------------------------------------------------------ numbering

    def stamp(self, executor_id: str, envelope: pb.Envelope) -> None:
        """Number ``envelope`` (about to be encoded for ``executor_id``) if that executor was ever in a tree."""
        if executor_id not in self._numbered:
            return
        kind = body_name(envelope)
        if kind in UNNUMBERED_KINDS:
            envelope.command_index = 0
            ended = self._tree_ended.pop(executor_id, None)
            envelope.launches_before = self.launches_sent[executor_id] if ended is not None else 0
            if ended is not None and kind == "cancel":   # a copy of its own (Controller.send)
                for generation, gang in self._gang_runs.values():
                    if generation == ended and executor_id in gang:
                        envelope.cancel.skip_collectives.extend(gang[executor_id])
            return
        self.commands_sent[executor_id] += 1
        envelope.command_index = self.commands_sent[executor_id]
        envelope.launches_before = self.launches_sent[executor_id]

    # ------------------------------------------------------------ trees

    def tree_for(self, executor_ids) -> IslandTree | None:
        """The tree a run on ``executor_ids`` goes down, made (and told to its members) if the island has none; None
        when the run is sent to each executor."""
        config = self._state.config
        if config.launch_fanout < 2 or len(executor_ids) < max(2, config.launch_tree_min_executors):
            return None
        executors = self.resources.executors
        island = executors[next(iter(executor_ids))].island
        tree = self._trees.get(island)
        wanted = frozenset(executor_ids)
        if tree is not None and tree.registered == len(executors) and tree.member_set == wanted:
            return tree   # nothing registered since it was made, and a loss would have ended it
        live = [info.executor_id for info in self.resources.ordered() if info.island == island and not info.lost]
        if len(live) != len(wanted) or set(live) != wanted:
            return None
        if tree is not None:
            self._retire(tree)
        self._generations += 1
        tree = build_tree(island, self._generations, live, config.launch_fanout, registered=len(executors))
        self._trees[island] = tree
        self._numbered.update(live)
        for position, executor_id in enumerate(tree.members):
            self._send(executor_id, pb.Envelope(launch_tree=self._place(tree, position)))
        return tree

    def _place(self, tree: IslandTree, position: int) -> pb.LaunchTree:
        executors = self.resources.executors
        parent = tree.parents[position]
        msg = pb.LaunchTree(generation=tree.generation, position=position, end=tree.ends[position])
        if parent >= 0:
            info = executors[tree.members[parent]]
            msg.parent, msg.parent_address, msg.parent_key = info.executor_id, info.data_address, info.public_key
        for child in tree.children(position):
            info = executors[tree.members[child]]
            msg.children.add(executor_id=info.executor_id, data_address=info.data_address,
                             public_key=info.public_key, position=child, end=tree.ends[child])
        return msg

    def launch(self, tree: IslandTree, run: pb.RunProgram, prev_collective_seqs: dict[str, int],
               gang: dict[str, tuple[int, int]] | None = None) -> None:
        """Send ``run`` to the tree's roots, with each member's own part by position, and every free waiting for a
        member (as array ids: each member frees its shards of them). ``gang``: the gang places its collectives take
        per executor, kept while it may be in flight (a loss must let the survivors skip those of a launch that
        never reached them)."""
        if gang:
            oldest = min(self._calls, default=run.base_call_id)
            for base in [b for b in self._gang_runs if b < oldest]:
                del self._gang_runs[base]
            self._gang_runs[run.base_call_id] = (tree.generation, gang)
        # Each member frees its own shards of these arrays: one list of ids for all, not a ShardRef per shard.
        members, take, pending = tree.members, self._lifetimes.take_pending_frees, []
        for frees in [take(executor_id) for executor_id in members]:
            if frees:
                pending.extend(frees)
        free_ids = {array_id for array_id, _ in pending}
        prev = [prev_collective_seqs[executor_id] for executor_id in members]
        commands = [self.commands_sent[executor_id] for executor_id in members]
        self.launches_sent.update(members)
        ids = sorted(free_ids)
        for root in tree.roots:
            end = tree.ends[root]
            msg = pb.TreeLaunch(generation=tree.generation, position=root, prev_collective_seqs=prev[root:end],
                                commands_before=commands[root:end], free_array_ids=ids)
            msg.run.CopyFrom(run)
            self._messages_sent["tree_launch"] += 1
            self._outbox.to_executor(tree.members[root], pb.Envelope(tree_launch=msg))

    def covers(self, sender: str, batch: pb.DoneBatch) -> str | None:
        """Why ``sender`` may not report ``batch``'s Dones (each must be of its subtree in the batch's tree); None
        when it may."""
        tree = self._tree_of_generation(batch.generation)
        if tree is None:
            return f"a batch of Dones of launch tree {batch.generation}, which this controller never made"
        if sender not in tree.member_set or tree.parents[tree.position(sender)] >= 0:
            return f"a batch of Dones from {sender}, which is not sent launches by the controller in tree " \
                   f"{batch.generation}"
        position = tree.position(sender)
        subtree = set(tree.members[position:tree.ends[position]])
        named = {d.executor_id for d in batch.dones}.union(*(group.executor_ids for group in batch.groups))
        strangers = sorted(named - subtree)
        if strangers:
            return f"a batch of Dones from {sender} names executors outside its subtree: {strangers[:3]}"
        return None

    def _tree_of_generation(self, generation: int) -> IslandTree | None:
        for tree in self._trees.values():
            if tree.generation == generation:
                return tree
        return self._ended.get(generation)

    # ------------------------------------------------------------ losses

    def end_island(self, island: str) -> None:
        """An executor of ``island`` was lost: its tree ends (the next run makes a new one without it)."""
        tree = self._trees.pop(island, None)
        if tree is not None:
            self._retire(tree)
            self._tree_ended.update(dict.fromkeys(tree.members, tree.generation))

    def forget(self, executor_id: str) -> None:
        """``executor_id`` registers (again): its new process counts commands and launches from zero."""
        self.commands_sent.pop(executor_id, None)
        self.launches_sent.pop(executor_id, None)
        self._numbered.discard(executor_id)
        self._tree_ended.pop(executor_id, None)

    def tell_ended(self, reason: str) -> None:
        """Tell each live member of an ended tree not told yet (no Cancel went to it) how many launches it will
        never get: an empty Cancel, which `stamp` numbers so."""
        executors = self.resources.executors
        for executor_id in sorted(self._tree_ended):
            info = executors.get(executor_id)
            if info is None or info.lost:
                self._tree_ended.pop(executor_id, None)
            else:
                self._send(executor_id, pb.Envelope(cancel=pb.Cancel(reason=reason)))

    def _retire(self, tree: IslandTree) -> None:
        self._ended[tree.generation] = tree
        while len(self._ended) > _KEPT_GENERATIONS:
            self._ended.popitem(last=False)

    def describe(self) -> str:
        return "\n".join(tree.describe() for tree in self._trees.values()) or "no launch trees"
