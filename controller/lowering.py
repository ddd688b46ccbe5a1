"""`ProgramInstaller`: a program lowered holding no lock of the controller's, then installed under it.

Lowering a program (`program.lower`) takes seconds for a large one on many executors (1.2–6.5 s measured for 128
nodes on 960 executors). Under the controller's lock, that froze every other client's calls and the executors'
reports for as long. So what lowering reads is taken under the lock (and the islands' sequencers: forming a
collective group is sequenced), the plans are made holding neither, and they are installed under the lock if what
they were made from still holds; else (an executor of the program replaced or lost, its groups formed again
meanwhile) the program is lowered again there, as before.

What lowering reads of the controller: the records of the executors the program names (addresses, keys; a record
is replaced, never changed, when an executor registers again, so the same record is the same incarnation) and its
collective nodes' groups.
"""

from __future__ import annotations

from typing import Callable

from pathways_torch.wire import pb

from .program import LoweredProgram, ProgramSpec, lower
from .resources import ResourceManager

__all__ = ["ProgramInstaller"]


class ProgramInstaller:
    """Lowers the `Controller`'s programs and sends each executor its plan, with the controller's ``state`` (its
    lock, its ``programs`` (id → lowered) and stale ones (ids to lower again), its ``send``), the process
    ``groups`` its collective nodes run in, and ``ensure_loaded(function_id, executor_id)``: sends an executor a
    function it does not hold yet (under the lock)."""

    def __init__(self, state, *, groups, ensure_loaded: Callable[[int, str], None]):
        self.sequencers, self.resources, self._groups = state.sequencers, state.resources, groups
        self._lock, self._programs, self._stale_programs = state.lock, state.programs, state.stale_programs
        self._send, self._ensure_loaded = state.send, ensure_loaded
        self.lowered_again_under_lock = 0   # what a lowering read changed before it was installed

    def lower_outside_lock(self, spec: ProgramSpec, program_id: int, islands, *, again: bool = False
                           ) -> LoweredProgram:
        """Lower ``spec`` holding no lock, and install it (takes the islands' sequencers, then the lock, twice).
        ``again``: a registered program lowered anew (stale): not installed if it was forgotten meanwhile."""
        with self.sequencers.taking(islands), self._lock:
            executors, axis_groups = self._basis(spec)
        snapshot = ResourceManager()
        snapshot.executors = executors
        keys = {e: info.public_key for e, info in executors.items()}
        lowered = lower(spec, program_id, snapshot.route, keys, axis_groups=axis_groups)
        with self.sequencers.taking(islands), self._lock:
            if again and program_id not in self._programs:
                raise KeyError(f"program {program_id} was forgotten while it was lowered again")
            now, groups_now = self._basis(spec)
            if groups_now == axis_groups and all(now[e] is info for e, info in executors.items()):
                return self._install(lowered)
            self.lowered_again_under_lock += 1
            return self.lower_under_lock(spec, program_id)

    def lower_under_lock(self, spec: ProgramSpec, program_id: int) -> LoweredProgram:
        """Lower ``spec`` for the executors as they are now and install it (the islands' sequencers and the lock
        held)."""
        executors, axis_groups = self._basis(spec)
        keys = {e: info.public_key for e, info in executors.items()}
        return self._install(lower(spec, program_id, self.resources.route, keys, axis_groups=axis_groups))

    def _basis(self, spec: ProgramSpec) -> tuple[dict, dict]:
        """What lowering ``spec`` reads: the records of the executors it names, and each collective node's groups
        (formed now if new)."""
        groups = self._groups
        axis_groups = {index: groups.axis_groups(node.mesh, node.collective_axes)
                       for index, node in enumerate(spec.nodes) if node.collective_axes}
        meshes = [*spec.value_meshes().values(), *(node.mesh for node in spec.nodes)]
        executors = {e: self.resources.executors[e] for mesh in meshes for e in mesh.executor_ids}
        return executors, axis_groups

    def _install(self, lowered: LoweredProgram) -> LoweredProgram:
        """Send each executor its plan (and the functions it runs first), and keep the program."""
        for executor_id, plan in lowered.plans.items():
            self.resources.check_live([executor_id])
            for function_id in lowered.function_ids.get(executor_id, ()):
                self._ensure_loaded(function_id, executor_id)
            self._send(executor_id, pb.Envelope(register_program=plan))
        self._programs[lowered.program_id] = lowered
        self._stale_programs.discard(lowered.program_id)
        return lowered
