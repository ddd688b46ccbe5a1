"""What no client will use again leaves the controller and its executors, never ahead of a run still to come.

A function or program a client forgets may still be run by a call in flight: a Forget that overtook that run on
an executor would fail it, and a report on a forgotten program's run could not be checked against its plan. So
each waits here until the last call in flight that runs it ends.
"""

from __future__ import annotations

import collections
from typing import Iterable

from pathways_torch.wire import pb

__all__ = ["Forgetting"]


class Forgetting:
    """Forgets functions and programs once no call in flight runs them; every method under the controller's lock."""

    def __init__(self, *, calls: dict, functions: dict, programs: dict, stale_programs: set, resources, send):
        self._calls, self._functions, self._programs = calls, functions, programs
        self._stale_programs, self._resources, self._send = stale_programs, resources, send
        self._programs_after_runs: dict[int, int] = {}   # program id → its calls still in flight
        self.functions_after_calls: set[int] = set()     # functions to forget once no call in flight runs them

    def call_ended(self, call) -> None:
        """A call left the in-flight table: forget what waited for it alone."""
        if self._programs_after_runs and call.run_base and call.program_id in self._programs_after_runs:
            self._programs_after_runs[call.program_id] -= 1
            if not self._programs_after_runs[call.program_id]:
                del self._programs_after_runs[call.program_id]
                self.forget((), (call.program_id,))
        if self.functions_after_calls and (idle := self.functions_after_calls - self._functions_in_flight()):
            self.forget(idle, ())

    def forget(self, function_ids: Iterable[int], program_ids: Iterable[int]) -> None:
        """Functions and programs leave the controller's tables and every executor that holds them (one Forget
        each), or wait for the calls in flight that run them."""
        by_executor: dict[str, tuple[list, list]] = {}
        for function_id in sorted(self._functions_to_forget_now(set(function_ids))):
            function = self._functions.pop(function_id, None)
            for executor_id in function.loaded_on if function is not None else ():
                by_executor.setdefault(executor_id, ([], []))[0].append(function_id)
        running = collections.Counter(call.program_id for call in self._calls.values() if call.run_base)
        for program_id in program_ids:
            if running[program_id]:
                self._programs_after_runs[program_id] = running[program_id]
                continue
            lowered = self._programs.pop(program_id, None)
            self._stale_programs.discard(program_id)
            for executor_id in lowered.plans if lowered is not None else ():
                by_executor.setdefault(executor_id, ([], []))[1].append(program_id)
        for executor_id, (functions, programs) in by_executor.items():
            info = self._resources.executors.get(executor_id)
            if info is not None and not info.lost:
                self._send(executor_id, pb.Envelope(forget=pb.Forget(function_ids=functions, program_ids=programs)))

    def _functions_to_forget_now(self, function_ids: set[int]) -> set[int]:
        """Those of ``function_ids`` no call in flight runs; the others wait in ``functions_after_calls``."""
        if not function_ids:
            return function_ids
        in_flight = self._functions_in_flight()
        self.functions_after_calls |= function_ids & in_flight
        now = function_ids - in_flight
        self.functions_after_calls -= now
        return now

    def _functions_in_flight(self) -> set[int]:
        """The functions a call in flight runs, directly or as a node of its program (whose other nodes' runs have
        no call of their own here)."""
        used = set()
        for call in self._calls.values():
            used.add(call.spec.function_id)
            program = self._programs.get(call.program_id) if call.run_base else None
            for function_ids in program.function_ids.values() if program is not None else ():
                used.update(function_ids)
        return used
