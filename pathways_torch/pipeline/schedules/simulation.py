"""The validator: check a schedule (placement, coverage, order, communication) and run it on a model clock.

`simulate` raises `ScheduleError` with the failing action marked, or returns a
`Simulation`: the order actions start in, each one's interval, the bubble and the
peak live activations per rank.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from .communication import _comm_after, _comm_before, _partner, _why_no_partner, with_communication
from .ir import Action, Schedule, ScheduleError

__all__ = ["Simulation", "simulate"]


@dataclasses.dataclass(frozen=True)
class Simulation:
    """A simulated run of ``schedule`` (with its communication).

    ``order`` is every ``(rank, action)`` in the order they start, ties broken by
    rank, and consistent with every dependency. ``intervals[r][i]`` is
    ``(start, end, action)`` of ``schedule.ranks[r][i]``. ``bubble_fraction`` is
    the idle compute time of all ranks over ``num_ranks * makespan``;
    ``peak_live_activations[r]`` is the most ``(chunk, microbatch)`` forwards done
    but not yet backwarded on rank r.
    """

    schedule: Schedule
    forward_time: float
    backward_time: float
    order: tuple[tuple[int, Action], ...]
    intervals: tuple[tuple[tuple[float, float, Action], ...], ...]
    makespan: float
    bubble_fraction: float
    peak_live_activations: tuple[int, ...]

    def busy_time(self, rank: int) -> float:
        """Time rank ``rank`` spends computing."""
        return sum(end - start for start, end, _ in self.intervals[rank])

    def describe(self) -> str:
        """A short table: busy and idle time and peak live activations per rank, then the totals."""
        lines = [f"{self.schedule.header()} (F={self.forward_time:g}, B={self.backward_time:g})",
                 "rank   busy   idle  peak_live"]
        for r in range(self.schedule.num_ranks):
            busy = self.busy_time(r)
            lines.append(f"{r:>4} {busy:>6g} {self.makespan - busy:>6g} {self.peak_live_activations[r]:>10}")
        lines.append(f"makespan {self.makespan:g}, bubble {self.bubble_fraction:.1%}")
        return "\n".join(lines)


def simulate(schedule: Schedule, forward_time: float = 1.0, backward_time: float = 2.0) -> Simulation:
    """Check ``schedule`` and run it on a model clock; raise :class:`ScheduleError` if it cannot run.

    A schedule without any send or receive gets them from :func:`with_communication`
    first. Each rank runs its actions in order; ``F`` takes ``forward_time``, ``B``
    ``backward_time``, communication nothing. A send is buffered (never blocks); a
    receive waits for its send.
    """
    if not forward_time > 0 or not backward_time > 0:
        raise ValueError(f"simulate: expected positive forward_time and backward_time, got "
                         f"{forward_time!r} and {backward_time!r}")
    _check_placement(schedule)
    _check_compute_coverage(schedule)
    _check_local_order(schedule)
    if not schedule.has_communication():
        schedule = with_communication(schedule)
    _check_communication(schedule)
    durations = {"F": forward_time, "B": backward_time}
    order, intervals = _run(schedule, durations)
    makespan = max((end for rank in intervals for _, end, _ in rank), default=0.0)
    busy = sum(end - start for rank in intervals for start, end, _ in rank)
    bubble = 1.0 - busy / (schedule.num_ranks * makespan) if makespan else 0.0
    return Simulation(schedule, forward_time, backward_time, order, intervals, makespan, bubble,
                      tuple(_peak_live(actions) for actions in schedule.ranks))


def _positions(schedule: Schedule) -> Iterable[tuple[int, int, Action]]:
    for r, actions in enumerate(schedule.ranks):
        for i, action in enumerate(actions):
            yield r, i, action


def _check_placement(schedule: Schedule) -> None:
    for r, i, a in _positions(schedule):
        if a.chunk >= schedule.num_chunks or a.microbatch >= schedule.num_microbatches:
            raise ScheduleError(f"{a} is out of range: the schedule has chunks 0..{schedule.num_chunks - 1} "
                                f"and microbatches 0..{schedule.num_microbatches - 1}", schedule, (r, i))
        if schedule.rank_of(a.chunk) != r:
            raise ScheduleError(f"{a} is on rank {r}, but chunk {a.chunk} lives on rank "
                                f"{schedule.rank_of(a.chunk)} (chunk c is on rank c % {schedule.num_ranks}); "
                                f"move it there", schedule, (r, i))


def _check_duplicates(schedule: Schedule) -> dict[Action, tuple[int, int]]:
    """Where each action is, ``(rank, index)``, once it is known that each appears once."""
    seen: dict[Action, tuple[int, int]] = {}
    for r, i, a in _positions(schedule):
        if a in seen:
            raise ScheduleError(f"duplicate {a}: it already ran at position {seen[a][1]} of rank "
                                f"{seen[a][0]}; each action runs once", schedule, (r, i))
        seen[a] = (r, i)
    return seen


def _check_compute_coverage(schedule: Schedule) -> None:
    seen = _check_duplicates(schedule)
    for c in range(schedule.num_chunks):
        for m in range(schedule.num_microbatches):
            for kind, other in (("F", "B"), ("B", "F")):
                if Action(c, kind, m) not in seen:
                    # Mark the other half of the pair, if present: that is where the gap shows.
                    raise ScheduleError(f"missing {Action(c, kind, m)}: every chunk needs an F and a B of "
                                        f"every microbatch; add it to rank {schedule.rank_of(c)}",
                                        schedule, seen.get(Action(c, other, m)))


def _local_deps(schedule: Schedule, a: Action) -> list[Action]:
    """What ``a`` needs done earlier on its own rank."""
    c, m = a.chunk, a.microbatch
    if a.kind in ("SEND_F", "SEND_B"):
        return [Action(c, a.kind[-1], m)]
    if a.kind == "RECV_F" or a.kind == "RECV_B":
        return []  # a receive waits on another rank only
    # The input (of F) or output gradient (of B) comes from the neighbouring chunk:
    # through a receive, or, with one rank, straight from that chunk's compute.
    neighbour = c - 1 if a.kind == "F" else c + 1
    own = [] if a.kind == "F" else [Action(c, "F", m)]
    if not 0 <= neighbour < schedule.num_chunks:
        return own
    received = _comm_before(schedule, a)
    return own + [received if received else Action(neighbour, a.kind, m)]


def _remote_dep(schedule: Schedule, a: Action) -> Action | None:
    """The send a receive waits for (on the neighbouring chunk's rank)."""
    if a.kind == "RECV_F":
        return Action(a.chunk - 1, "SEND_F", a.microbatch)
    if a.kind == "RECV_B":
        return Action(a.chunk + 1, "SEND_B", a.microbatch)
    return None


def _check_local_order(schedule: Schedule) -> None:
    # A dependency later on the same rank can never be met: report it as misordered,
    # not as the deadlock the simulation would find. Absent ones are reported later.
    for r, actions in enumerate(schedule.ranks):
        index = {a: i for i, a in enumerate(actions)}
        for i, a in enumerate(actions):
            for dep in _local_deps(schedule, a):
                if index.get(dep, -1) > i:
                    raise ScheduleError(f"{a} comes before {dep}, which it needs, on rank {r}; "
                                        f"move {dep} before {a}", schedule, (r, i))


def _check_communication(schedule: Schedule) -> None:
    seen = _check_duplicates(schedule)
    for r, i, a in _positions(schedule):
        if a.is_compute:
            continue
        partner = _partner(schedule, a)
        if partner is None:
            raise ScheduleError(f"{a} is not needed: {_why_no_partner(schedule, a)}; remove it",
                                schedule, (r, i))
        if partner not in seen:
            raise ScheduleError(f"{a} has no matching {partner} on rank {schedule.rank_of(partner.chunk)}; "
                                f"add it there (with_communication places both)", schedule, (r, i))
    for r, i, a in _positions(schedule):
        for comm in (_comm_before(schedule, a), _comm_after(schedule, a)) if a.is_compute else ():
            if comm is not None and comm not in seen:
                purpose = "receive its input" if comm.kind.startswith("RECV") else "send its result"
                raise ScheduleError(f"{a} on rank {r} has no {comm} to {purpose}; add it "
                                    f"(with_communication places it)", schedule, (r, i))



def _run(schedule: Schedule, durations: dict[str, float]):
    """Start, among the ranks whose next action has its inputs, the one that can start first
    (lowest rank on ties); starts so chosen never go back in time, so ``order`` is by start."""
    num_ranks = schedule.num_ranks
    next_index, free_at = [0] * num_ranks, [0.0] * num_ranks
    end: dict[Action, float] = {}
    order, intervals = [], [[] for _ in range(num_ranks)]
    while True:
        ready = [(start, r) for r in range(num_ranks)
                 if (start := _ready_at(schedule, r, next_index[r], free_at[r], end)) is not None]
        if not ready:
            break
        start, r = min(ready)
        action = schedule.ranks[r][next_index[r]]
        end[action] = free_at[r] = start + durations.get(action.kind, 0.0)
        order.append((r, action))
        intervals[r].append((start, end[action], action))
        next_index[r] += 1
    if any(next_index[r] < len(schedule.ranks[r]) for r in range(num_ranks)):
        _raise_deadlock(schedule, next_index, end)
    return tuple(order), tuple(tuple(rank) for rank in intervals)


def _deps(schedule: Schedule, a: Action) -> list[Action]:
    remote = _remote_dep(schedule, a)
    return _local_deps(schedule, a) + ([remote] if remote else [])


def _ready_at(schedule: Schedule, r: int, index: int, free_at: float, end: dict[Action, float]):
    """When rank r's action ``index`` can start, or None if it is done or still waits."""
    if index == len(schedule.ranks[r]):
        return None
    deps = _deps(schedule, schedule.ranks[r][index])
    if any(d not in end for d in deps):
        return None
    return max([free_at] + [end[d] for d in deps])


def _raise_deadlock(schedule: Schedule, next_index: list[int], end: dict[Action, float]):
    blocked = [(r, i) for r, i in enumerate(next_index) if i < len(schedule.ranks[r])]
    waits = []
    for r, i in blocked:
        a = schedule.ranks[r][i]
        missing = [d for d in _deps(schedule, a) if d not in end]
        waits.append(f"rank {r} waits at {a} for " +
                     ", ".join(f"{d} on rank {schedule.rank_of(d.chunk)}" for d in missing))
    raise ScheduleError("deadlock: no rank can go on; " + "; ".join(waits) +
                        ". Reorder so that each value is sent before its sender waits",
                        schedule, blocked[0])


def _peak_live(actions: tuple[Action, ...]) -> int:
    live = peak = 0
    for a in actions:
        live += {"F": 1, "B": -1}.get(a.kind, 0)
        peak = max(peak, live)
    return peak
