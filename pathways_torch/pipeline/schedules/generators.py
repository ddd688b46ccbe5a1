"""The schedule generators: GPipe, 1F1B and interleaved 1F1B as compute-only schedules, and their bubble."""

from __future__ import annotations

from .ir import Action, Schedule, _check_count, _round_up

__all__ = ["SCHEDULE_NAMES", "gpipe", "one_f_one_b", "interleaved", "make_schedule", "theoretical_bubble"]

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved")
"""The names :func:`make_schedule` accepts."""


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
