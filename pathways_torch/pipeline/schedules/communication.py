"""Where the sends and receives of a schedule go: after the compute that makes a value, before the one that needs it.

`with_communication` places them; the simulator asks the same questions (which receive
precedes a compute, which send is the other end of a receive) to check a schedule.
"""

from __future__ import annotations

from .ir import Action, Schedule

__all__ = ["with_communication"]


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
    return schedule.compute_only().replace_actions(edit)


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
