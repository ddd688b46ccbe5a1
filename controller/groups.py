"""Process groups: the groups a mesh's collectives run in, formed at first use and abandoned after a fault.

A group is formed once per set of members (in rank order), as a gang-scheduled action of its island, and its
members meet in the rendezvous store under a prefix open to them alone. A fault in an island (a lost executor,
a lost transfer) makes every group there suspect: the controller forgets them, so the next collective forms new
ones, and each heartbeat answer there names the fault, so the executors abandon theirs too.
"""

from __future__ import annotations

import collections

from pathways_torch.errors import PlacementError
from pathways_torch.wire import pb

from .resources import MeshAllocation

__all__ = ["ProcessGroups"]

# Lost incarnations each heartbeat answer names (per island): the most recent ones.
_MAX_LOST_PEERS = 64


class ProcessGroups:
    """The `Controller`'s process groups; used under its lock (and the sequencers of the islands involved)."""

    def __init__(self, state):
        self._state = state
        self.resources, self.sequencers, self.rendezvous = state.resources, state.sequencers, state.rendezvous
        self._programs, self._stale_programs = state.programs, state.stale_programs
        self._send = state.send
        self.by_members: dict[tuple[str, ...], int] = {}       # members (in rank order) → group id (live ones)
        # island → its faults, each "what<first group id after it": a lost "id@epoch" or a lost "transfer:..."
        self.lost_peers: dict[str, list[str]] = collections.defaultdict(list)   # the last _MAX_LOST_PEERS
        self.faults_counted: collections.Counter = collections.Counter()         # island → faults ever recorded
        self._axis_group_cache: dict[tuple, dict[str, list[int]]] = {}
        self._last_group_id = 0   # groups get increasing ids: a loss names the last one made before it
        self.epoch = 0            # part of every group's rendezvous prefix

    def axis_groups(self, mesh: MeshAllocation, axes) -> dict[str, list[int]]:
        """For each axis, the group id of every mesh position; forms groups not seen before.

        Cached per (mesh, axes): groups are never re-formed under the same members, and
        every call of a training step asks the same question.
        """
        key = (mesh, tuple(axes))
        found = self._axis_group_cache.get(key)
        if found is None:
            found = self._axis_group_cache[key] = {
                axis: [self._group_for(mesh.axis_members(axis, position)) for position in range(mesh.size)]
                for axis in axes}
        return found

    def _group_for(self, members: tuple[str, ...]) -> int:
        group_id = self.by_members.get(members)
        if group_id is not None:
            return group_id
        islands = sorted({self.resources.island_of(e) for e in members})
        if len(islands) > 1:   # the client refuses such a call first (pathways_torch.islands): a bug if reached
            raise PlacementError(f"a process group may not span islands: members {list(members)} are in islands "
                                 f"{islands}; collectives run inside an island")
        self._last_group_id += 1
        group_id = self.by_members[members] = self._last_group_id
        sequencer = self.sequencers.of(islands[0])   # held by the call or program that needs the group
        seq = sequencer.take(1)   # forming a group is a gang-scheduled action of its own
        # The members meet under this prefix of the rendezvous store, open to them alone; the epoch lets the
        # same members form a group again (a replacement executor, later).
        store_path = f"group-{group_id}/epoch-{self.epoch}"
        self.rendezvous.allow(store_path, members)
        incarnations = [f"{e}@{self.resources.executors[e].epoch}" for e in members]
        for rank, executor_id in enumerate(members):
            form = pb.FormGroup(seq=seq, prev_collective_seq=sequencer.chain(executor_id, seq), group_id=group_id,
                                rank=rank, size=len(members), store_path=store_path,
                                timeout_s=self._state.config.group_timeout_s, members=incarnations)
            self._send(executor_id, pb.Envelope(form_group=form))
        return group_id

    def abandon_island(self, island: str, what: str) -> list[int]:
        """After a fault in ``island`` (``what``: a lost incarnation ``id@epoch``, or a lost transfer): in every
        heartbeat answer there, its executors are told to abandon the groups made up to now (not the ones formed
        later, with a replacement: "executor-1@1<7" spares group 7 and on); the controller forgets them, so the
        next collective forms new ones. Returns the forgotten group ids."""
        entries = self.lost_peers[island]
        entries.append(f"{what}<{self._last_group_id + 1}")
        del entries[:-_MAX_LOST_PEERS]
        self.faults_counted[island] += 1
        # A registered program's collective nodes name their groups: one with such a node there is lowered again at
        # its next run. One without (a chain of 128 nodes on 960 survivors: seconds of lowering) runs as it is.
        self._stale_programs.update(pid for pid, lowered in self._programs.items()
                                    if any(node.collective_axes for node in lowered.spec.nodes)
                                    and any(self.resources.island_of(e) == island for e in lowered.plans))
        return self._forget_island(island)

    def faults_since(self, island: str, told: int) -> tuple[list[str], int]:
        """The faults of ``island`` after the first ``told`` (at most the last _MAX_LOST_PEERS), and how many there
        are in all. A heartbeat answer carries only these: with every fault in every answer, 64 lost executors were
        64 entries, built, encrypted and walked, in each of 1,920 answers a second to the 960 survivors."""
        total = self.faults_counted[island]
        entries = self.lost_peers.get(island, [])
        fresh = min(total - told, len(entries)) if told <= total else len(entries)   # more told: not this island's
        return entries[len(entries) - fresh:], total

    def _forget_island(self, island: str) -> list[int]:
        """Drop every group of ``island`` at a loss there: its survivors abandon them all (a group without the lost
        executor may be out of step: `CollectiveRuntime.abandon`); meshes form new ones at their next call."""
        gone = [g for members, g in self.by_members.items() if self.resources.island_of(members[0]) == island]
        self.rendezvous.forget_groups(gone)
        self.by_members = {m: g for m, g in self.by_members.items() if self.resources.island_of(m[0]) != island}
        self._axis_group_cache = {k: v for k, v in self._axis_group_cache.items()
                                  if island not in {self.resources.island_of(e) for e in k[0].executor_ids}}
        return gone
