"""bench/pipeline.py's arithmetic on timed schedule actions (pure, unit-tested): the schedule's order kept on every
rank, the waits for transfers between ranks, and the schedule replayed with such a wait. The bubble itself is
`pathways_torch.observe.span_math.occupancy`, the formula the pipeline picture (``trainer.runner.timeline``) uses."""

from __future__ import annotations

from pathways_torch.observe.span_math import Occupancy, occupancy
from pathways_torch.pipeline.schedules import Action


def virtual_stages(schedule: str) -> int:
    """Chunks per rank: 2 for the interleaved schedule, 1 for GPipe and 1F1B."""
    return 2 if schedule == "interleaved" else 1


def kept_order(timed: dict[Action, tuple[int, float, float]], schedule) -> bool:
    """Whether every rank started its compute actions in the schedule's order (``timed``: action → (rank,
    start, end)), each on the rank its chunk lives on."""
    for r, actions in enumerate(schedule.ranks):
        expected = [a for a in actions if a.is_compute]
        ran = sorted(((start, a) for a, (rank, start, _) in timed.items() if rank == r), key=lambda t: t[0])
        if [a for _, a in ran] != expected:
            return False
    return all(rank == schedule.rank_of(a.chunk) for a, (rank, _, _) in timed.items())


def producer(action: Action, num_chunks: int) -> Action | None:
    """The compute action on the neighbouring chunk whose output ``action`` reads: the previous chunk's
    forward for a forward, the next chunk's backward for a backward; None at the ends of the pipe."""
    if action.kind == "F":
        return Action(action.chunk - 1, "F", action.microbatch) if action.chunk > 0 else None
    return Action(action.chunk + 1, "B", action.microbatch) if action.chunk + 1 < num_chunks else None


def transfer_waits(timed: dict[Action, tuple[int, float, float]], num_chunks: int) -> list[float]:
    """For each action whose input came from another rank and arrived after its own rank was free:
    start - producer's end (the transfer and the hand-off to the compute thread)."""
    by_rank: dict[int, list] = {}
    for a, (rank, start, end) in timed.items():
        by_rank.setdefault(rank, []).append((start, end, a))
    previous_end = {}
    for spans in by_rank.values():
        spans.sort(key=lambda t: t[0])
        for (_, end, _), (_, _, a) in zip(spans, spans[1:]):
            previous_end[a] = end
    waits = []
    for a, (rank, start, _) in timed.items():
        source = producer(a, num_chunks)
        if source is None or source not in timed or timed[source][0] == rank:
            continue
        produced = timed[source][2]
        if produced >= previous_end.get(a, float("-inf")):
            waits.append(start - produced)
    return waits


def replay(order: list[Action], num_chunks: int, num_ranks: int, forward_s: float, backward_s: float,
           latency_s: float) -> Occupancy:
    """Time compute actions run in ``order`` (a global order consistent with every dependency, each rank's
    actions in its own order) when a value from another rank arrives ``latency_s`` after its producer
    ends: what the schedule should take with this runtime's transfer wait."""
    free = [0.0] * num_ranks
    ends: dict[Action, float] = {}
    spans = []
    for a in order:
        rank = a.chunk % num_ranks
        ready = free[rank]
        source = producer(a, num_chunks)
        if source is not None:
            ready = max(ready, ends[source] + (latency_s if source.chunk % num_ranks != rank else 0.0))
        end = ready + (forward_s if a.kind == "F" else backward_s)
        ends[a], free[rank] = end, end
        spans.append((rank, ready, end))
    return occupancy(spans, num_ranks)


def activation_peaks(rest: dict, peak: dict, stage_executors: list[list[str]]) -> list[int] | None:
    """Per stage: the largest (``store_bytes_high_water`` in ``peak`` - ``store_bytes`` in ``rest``) over
    its executors (``rest``/``peak``: ``ctx.stats()["executors"]`` before and after one step). None when
    no executor reports a high-water mark (all zero: the executor does not fill it in)."""
    if not any(peak[e]["store_bytes_high_water"] for ids in stage_executors for e in ids):
        return None
    return [max(peak[e]["store_bytes_high_water"] - rest[e]["store_bytes"] for e in ids) for ids in stage_executors]


def relative_error(measured: float, expected: float) -> float:
    return abs(measured - expected) / expected if expected else abs(measured)
