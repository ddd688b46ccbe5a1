"""Pipeline schedules as printable actions, and a validator that simulates them.

A pipeline has ``S`` pipe ranks; the model is cut into ``C = S * V`` chunks (``V``
virtual stages per rank) and chunk ``c`` lives on rank ``c % S``. ``M`` microbatches
flow through it. Each rank runs a list of actions, written like
``torch.distributed.pipelining`` writes them: ``{chunk}{kind}{microbatch}``:

- ``0F3``: forward of chunk 0 on microbatch 3; ``1B2``: its backward (which also
  accumulates the chunk's parameter gradients);
- ``0SEND_F3`` sends chunk 0's output of microbatch 3 to chunk 1's rank, where
  ``1RECV_F3`` receives it as the input of ``1F3``;
- ``1SEND_B2`` sends the gradient wrt chunk 1's input to chunk 0's rank, where
  ``0RECV_B2`` receives it as the gradient of chunk 0's output.

Consecutive chunks share a rank only when ``S == 1``; then no communication is needed.

The generators (:func:`gpipe`, :func:`one_f_one_b`, :func:`interleaved`) return
compute-only schedules; :func:`with_communication` inserts the sends and receives,
and :func:`simulate` checks a schedule and times it. This module imports no torch:
a schedule is a plan, tested as text in, text out.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable

__all__ = [
    "ACTION_KINDS", "SCHEDULE_NAMES", "Action", "Schedule", "ScheduleError", "Simulation",
    "with_communication", "gpipe", "one_f_one_b", "interleaved", "make_schedule", "simulate",
    "theoretical_bubble",
]

ACTION_KINDS = ("F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
"""Every action kind: the two computations first, then the four communications."""

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved")
"""The names :func:`make_schedule` accepts."""

_COMPUTE = ("F", "B")
# Longer kinds first so that the alternation never stops at a prefix ("F" of "SEND_F").
_ACTION_RE = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B)(\d+)")
_ACTION_FORM = (f"{{chunk}}{{kind}}{{microbatch}} with kind one of {', '.join(ACTION_KINDS)}, "
                "e.g. 0F3 or 1SEND_B2")
_NAME_RE = re.compile(r"[A-Za-z0-9_.+-]*")
_HEADER_RE = re.compile(r"schedule(?: ([A-Za-z0-9_.+-]+))?: (\d+) ranks?, (\d+) chunks?, "
                        r"(\d+) microbatch(?:es)?")
_RANK_RE = re.compile(r"rank (\d+):(.*)")


class ScheduleError(ValueError):
    """A schedule that cannot run; the message shows its text with the failing action marked.

    ``problem`` is the first line alone, ``schedule`` the schedule checked (with its
    communication, when it was added) and ``mark`` the ``(rank, index)`` of the marked
    action, or ``None``.
    """

    def __init__(self, problem: str, schedule: "Schedule | None" = None,
                 mark: tuple[int, int] | None = None):
        self.problem = problem
        self.schedule = schedule
        self.mark = mark
        text = problem if schedule is None else f"{problem}\n{schedule.to_text(mark)}"
        super().__init__(text)


# ---------------------------------------------------------------- actions


def _check_count(what: str, value, minimum: int) -> None:
    # bool is an int subclass; True chunks are a caller's bug, not chunk 1.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{what}: expected an int >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` (one of :data:`ACTION_KINDS`) of ``chunk`` on ``microbatch``."""

    chunk: int
    kind: str
    microbatch: int

    def __post_init__(self):
        _check_count("Action.chunk", self.chunk, 0)
        _check_count("Action.microbatch", self.microbatch, 0)
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"Action.kind: expected one of {', '.join(ACTION_KINDS)}, got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.chunk}{self.kind}{self.microbatch}"

    @property
    def is_compute(self) -> bool:
        """True for ``F`` and ``B``, False for the sends and receives."""
        return self.kind in _COMPUTE

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Read one action written as ``{chunk}{kind}{microbatch}``, e.g. ``1SEND_B2``."""
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"bad action {text!r}: expected {_ACTION_FORM}")
        return cls(int(match[1]), match[2], int(match[3]))


# ---------------------------------------------------------------- schedules


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What each of ``num_ranks`` pipe ranks runs, in order: ``ranks[r]`` is rank r's actions.

    ``num_chunks`` must be a multiple of ``num_ranks``; chunk ``c`` belongs on rank
    ``c % num_ranks``. Whether the actions make a runnable pipeline is checked by
    :func:`simulate`, so that a broken schedule can still be built, printed and shown.
    """

    num_ranks: int
    num_chunks: int
    num_microbatches: int
    ranks: tuple[tuple[Action, ...], ...]
    name: str = ""

    def __post_init__(self):
        _check_count("Schedule.num_ranks", self.num_ranks, 1)
        _check_count("Schedule.num_chunks", self.num_chunks, 1)
        _check_count("Schedule.num_microbatches", self.num_microbatches, 1)
        if self.num_chunks % self.num_ranks:
            raise ValueError(f"Schedule: num_chunks ({self.num_chunks}) must be a multiple of num_ranks "
                             f"({self.num_ranks}), since chunk c lives on rank c % num_ranks")
        ranks = tuple(tuple(actions) for actions in self.ranks)
        if len(ranks) != self.num_ranks:
            raise ValueError(f"Schedule: expected one action list per rank ({self.num_ranks}), "
                             f"got {len(ranks)}")
        for actions in ranks:
            for action in actions:
                if not isinstance(action, Action):
                    raise ValueError(f"Schedule.ranks: expected Action items, got {action!r}")
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise ValueError(f"Schedule.name: expected letters, digits or _.+- (it is printed in the "
                             f"header), got {self.name!r}")
        object.__setattr__(self, "ranks", ranks)  # lists in, tuples kept: the schedule stays hashable

    @property
    def virtual_stages(self) -> int:
        """Chunks per rank, ``V = num_chunks // num_ranks``."""
        return self.num_chunks // self.num_ranks

    def rank_of(self, chunk: int) -> int:
        """The rank chunk ``chunk`` lives on."""
        return chunk % self.num_ranks

    def header(self) -> str:
        """The first line of the text form, e.g. ``schedule 1f1b: 2 ranks, 2 chunks, 4 microbatches``."""
        label = f"schedule {self.name}" if self.name else "schedule"
        return (f"{label}: {_plural(self.num_ranks, 'rank')}, {_plural(self.num_chunks, 'chunk')}, "
                f"{_plural(self.num_microbatches, 'microbatch', 'es')}")

    def to_text(self, mark: tuple[int, int] | None = None) -> str:
        """The header and one line per rank; ``mark=(rank, index)`` shows that action as ``>>1B2<<``."""
        lines = [self.header()]
        for r, actions in enumerate(self.ranks):
            words = [f">>{a}<<" if mark == (r, i) else str(a) for i, a in enumerate(actions)]
            lines.append(" ".join([f"rank {r}:", *words]))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()

    def compute_only(self) -> "Schedule":
        """This schedule without its sends and receives."""
        return self._replace_actions(lambda r, actions: [a for a in actions if a.is_compute])

    def has_communication(self) -> bool:
        """Whether any rank has a send or a receive."""
        return any(not a.is_compute for actions in self.ranks for a in actions)

    def _replace_actions(self, edit: Callable[[int, tuple[Action, ...]], Iterable[Action]]) -> "Schedule":
        ranks = tuple(tuple(edit(r, actions)) for r, actions in enumerate(self.ranks))
        return dataclasses.replace(self, ranks=ranks)

    @classmethod
    def parse(cls, text: str, num_microbatches: int | None = None,
              num_chunks: int | None = None) -> "Schedule":
        """Read the text form that ``str(schedule)`` prints.

        The header line is optional; counts it does not give (and the arguments do
        not) are inferred from the actions: chunks rounded up to a multiple of the
        ranks, microbatches one past the largest seen.
        """
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        name, header = "", None
        if lines and lines[0].startswith("schedule"):
            header = _HEADER_RE.fullmatch(lines.pop(0))
            if header is None:
                raise ValueError(f"bad schedule header {text.strip().splitlines()[0].strip()!r}: expected "
                                 f"'schedule NAME: S ranks, C chunks, M microbatches'")
            name = header[1] or ""
        ranks = [_parse_rank_line(line, expected_rank) for expected_rank, line in enumerate(lines)]
        if not ranks:
            raise ValueError("schedule text has no 'rank 0: ...' line")
        if header is not None and int(header[2]) != len(ranks):
            raise ValueError(f"schedule header says {header[2]} ranks but the text has {len(ranks)} "
                             f"rank lines")
        actions = [a for rank in ranks for a in rank]
        chunks = _count("num_chunks", num_chunks, header and int(header[3]),
                        _round_up(max((a.chunk for a in actions), default=0) + 1, len(ranks)))
        microbatches = _count("num_microbatches", num_microbatches, header and int(header[4]),
                              max((a.microbatch for a in actions), default=0) + 1)
        return cls(len(ranks), chunks, microbatches, tuple(ranks), name)


def _plural(n: int, word: str, suffix: str = "s") -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}{suffix}"


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _parse_rank_line(line: str, expected_rank: int) -> tuple[Action, ...]:
    match = _RANK_RE.fullmatch(line)
    if match is None:
        raise ValueError(f"bad schedule line {line!r}: expected 'rank {expected_rank}: ACTION ...' "
                         f"with each ACTION written {_ACTION_FORM}")
    if int(match[1]) != expected_rank:
        raise ValueError(f"schedule line {line!r}: expected rank {expected_rank} here (rank lines "
                         f"run 0, 1, 2, ... in order)")
    try:
        return tuple(Action.parse(word) for word in match[2].split())
    except ValueError as error:
        raise ValueError(f"rank {expected_rank}: {error}") from None


def _count(what: str, given: int | None, in_header: int | None, inferred: int) -> int:
    if given is not None and in_header is not None and given != in_header:
        raise ValueError(f"Schedule.parse: {what}={given} but the header says {in_header}")
    for value in (given, in_header):
        if value is not None:
            return value
    return inferred


# ---------------------------------------------------------------- communication


def _comm_before(schedule: Schedule, action: Action) -> Action | None:
    """The receive that must precede compute ``action`` on its rank, if its input is remote."""
    if schedule.num_ranks == 1:
        return None
    if action.kind == "F" and action.chunk > 0:
        return Action(action.chunk, "RECV_F", action.microbatch)
    if action.kind == "B" and action.chunk < schedule.num_chunks - 1:
        return Action(action.chunk, "RECV_B", action.microbatch)
    return None


def _comm_after(schedule: Schedule, action: Action) -> Action | None:
    """The send that must follow compute ``action`` on its rank, if its consumer is remote."""
    if schedule.num_ranks == 1:
        return None
    if action.kind == "F" and action.chunk < schedule.num_chunks - 1:
        return Action(action.chunk, "SEND_F", action.microbatch)
    if action.kind == "B" and action.chunk > 0:
        return Action(action.chunk, "SEND_B", action.microbatch)
    return None


def with_communication(schedule: Schedule) -> Schedule:
    """``schedule`` with each send right after the compute that produced the value and each receive
    right before the compute that needs it (existing sends and receives are replaced).

    This is where torch's pipelining puts them; since sends are buffered, it never
    deadlocks a schedule whose compute order is sound.
    """
    def edit(rank: int, actions: tuple[Action, ...]) -> list[Action]:
        out: list[Action] = []
        for action in actions:
            out += [a for a in (_comm_before(schedule, action), action, _comm_after(schedule, action)) if a]
        return out
    return schedule.compute_only()._replace_actions(edit)


# ---------------------------------------------------------------- generators


def _check_shape(num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    _check_count("num_ranks", num_ranks, 1)
    _check_count("num_microbatches", num_microbatches, 1)
    _check_count("virtual_stages", virtual_stages, 1)


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """GPipe: every rank runs all its forwards, then all its backwards (microbatch order)."""
    _check_shape(num_ranks, num_microbatches)
    mbs = range(num_microbatches)
    ranks = tuple(tuple([Action(r, "F", m) for m in mbs] + [Action(r, "B", m) for m in mbs])
                  for r in range(num_ranks))
    return Schedule(num_ranks, num_ranks, num_microbatches, ranks, "gpipe")


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B: rank r warms up with ``S-1-r`` forwards, alternates one forward and one backward,
    then cools down with the remaining backwards, so at most ``S-r`` activations are live."""
    _check_shape(num_ranks, num_microbatches)
    return Schedule(num_ranks, num_ranks, num_microbatches,
                    tuple(_one_f_one_b_rank(r, num_ranks, num_microbatches) for r in range(num_ranks)),
                    "1f1b")


def _one_f_one_b_rank(rank: int, num_ranks: int, num_microbatches: int) -> tuple[Action, ...]:
    warmup = min(num_ranks - 1 - rank, num_microbatches)  # fewer microbatches than ranks: all warm-up
    actions = [Action(rank, "F", m) for m in range(warmup)]
    for m in range(num_microbatches - warmup):
        actions += [Action(rank, "F", m + warmup), Action(rank, "B", m)]
    actions += [Action(rank, "B", m) for m in range(num_microbatches - warmup, num_microbatches)]
    return tuple(actions)


def interleaved(num_ranks: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron's interleaved 1F1B over ``V = virtual_stages`` chunks per rank.

    Microbatches go through in rounds of ``S``: rank r runs the forwards of one round
    on its chunk r, then on chunk r+S, and so on, and the backwards in the reverse
    chunk order. Warm-up is ``(V-1)*S + 2*(S-1-r)`` forwards, as in Megatron and
    ``torch.distributed.pipelining.ScheduleInterleaved1F1B``; like torch, it needs
    ``num_microbatches`` to be a multiple of ``num_ranks``.
    """
    _check_shape(num_ranks, num_microbatches, virtual_stages)
    if num_microbatches % num_ranks:
        raise ValueError(f"interleaved: num_microbatches ({num_microbatches}) must be a multiple of "
                         f"num_ranks ({num_ranks}), as torch's ScheduleInterleaved1F1B requires; "
                         f"use {_round_up(num_microbatches, num_ranks)} microbatches or '1f1b'")
    ranks = tuple(_interleaved_rank(r, num_ranks, num_microbatches, virtual_stages)
                  for r in range(num_ranks))
    return Schedule(num_ranks, num_ranks * virtual_stages, num_microbatches, ranks, "interleaved")


def _interleaved_rank(rank: int, num_ranks: int, num_microbatches: int, virtual_stages: int):
    total = num_microbatches * virtual_stages  # forwards (and backwards) on this rank
    warmup = min((virtual_stages - 1) * num_ranks + 2 * (num_ranks - 1 - rank), total)
    forwards = _interleaved_order(rank, num_ranks, total, virtual_stages, "F", reverse=False)
    backwards = _interleaved_order(rank, num_ranks, total, virtual_stages, "B", reverse=True)
    actions = forwards[:warmup]
    for i in range(total - warmup):
        actions += [forwards[warmup + i], backwards[i]]
    return tuple(actions + backwards[total - warmup:])


def _interleaved_order(rank: int, num_ranks: int, total: int, virtual_stages: int, kind: str,
                       reverse: bool) -> list[Action]:
    # Step k works on local chunk (k // S) % V (reversed for backwards); each chunk
    # takes its microbatches in order, so count them per chunk.
    next_microbatch = [0] * virtual_stages
    actions = []
    for k in range(total):
        local = (k // num_ranks) % virtual_stages
        if reverse:
            local = virtual_stages - 1 - local
        actions.append(Action(local * num_ranks + rank, kind, next_microbatch[local]))
        next_microbatch[local] += 1
    return actions


def make_schedule(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule called ``name`` (one of :data:`SCHEDULE_NAMES`)."""
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {name!r}: expected one of {', '.join(SCHEDULE_NAMES)}")
    if name == "interleaved":
        return interleaved(num_ranks, num_microbatches, virtual_stages)
    if virtual_stages != 1:
        raise ValueError(f"schedule {name!r} runs one chunk per rank, got virtual_stages="
                         f"{virtual_stages}; use 'interleaved' for more")
    return gpipe(num_ranks, num_microbatches) if name == "gpipe" else one_f_one_b(num_ranks, num_microbatches)


def theoretical_bubble(num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """The idle fraction of a pipeline, ``(S-1) / (V*M + S-1)``.

    Assumes every chunk's forward takes the same time, and so does every backward,
    and that communication is free. With ``V = 1`` this is GPipe's and 1F1B's
    ``(S-1) / (M+S-1)``: the ramp up and down costs ``S-1`` slots of a rank's
    ``M`` (F+B) slots. Interleaving makes each chunk's slot ``V`` times shorter,
    so the ramp costs ``(S-1)/V`` of them. :func:`simulate` of :func:`gpipe`,
    :func:`one_f_one_b` and :func:`interleaved` gives exactly this for any ratio of
    forward to backward time (also for ``M < S`` with GPipe and 1F1B).
    """
    _check_shape(num_ranks, num_microbatches, virtual_stages)
    return (num_ranks - 1) / (virtual_stages * num_microbatches + num_ranks - 1)


# ---------------------------------------------------------------- simulation


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


def _partner(schedule: Schedule, a: Action) -> Action | None:
    """The other end of send or receive ``a``, or None when it has no neighbour on another rank."""
    if schedule.num_ranks == 1:
        return None
    step = {"SEND_F": 1, "RECV_B": 1, "SEND_B": -1, "RECV_F": -1}[a.kind]
    if not 0 <= a.chunk + step < schedule.num_chunks:
        return None
    kind = {"SEND_F": "RECV_F", "RECV_F": "SEND_F", "SEND_B": "RECV_B", "RECV_B": "SEND_B"}[a.kind]
    return Action(a.chunk + step, kind, a.microbatch)


def _why_no_partner(schedule: Schedule, a: Action) -> str:
    if schedule.num_ranks == 1:
        return "with one rank every chunk's neighbour is local"
    return f"chunk {a.chunk} has no {'next' if a.kind in ('SEND_F', 'RECV_B') else 'previous'} chunk"


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
