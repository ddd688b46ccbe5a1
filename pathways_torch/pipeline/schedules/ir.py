"""The schedule IR: `Action` (``1F0``, ``0SEND_B2``), `Schedule` (one action list per rank) and their text form.

``str(schedule)`` prints a header and one line per rank; `Schedule.parse` reads it back;
`ScheduleError` shows the text with the failing action marked ``>>1B2<<``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable

__all__ = ["ACTION_KINDS", "Action", "Schedule", "ScheduleError"]

ACTION_KINDS = ("F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
"""Every action kind: the two computations first, then the four communications."""

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
        return self.replace_actions(lambda r, actions: [a for a in actions if a.is_compute])

    def has_communication(self) -> bool:
        """Whether any rank has a send or a receive."""
        return any(not a.is_compute for actions in self.ranks for a in actions)

    def replace_actions(self, edit: Callable[[int, tuple[Action, ...]], Iterable[Action]]) -> "Schedule":
        """The same schedule with each rank's actions replaced by ``edit(rank, actions)``."""
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
