"""Whether a report on a lost transfer comes from one of that transfer's two ends.

An executor reports a transfer it sent and never saw acknowledged (``TransferLost``), and the receiver then says
whether a run there lacked the copy (``TransferLost.missing``). Acting on one fails a call and abandons the process
groups of both ends' islands, so a report is believed only from the copy's sender or receiver, as the call's routes
(a plain call) or its program's plan (a program run) name them: an executor cannot fail another's call, or make
another island abandon its groups, by naming a copy it has no part in.

This module imports no torch (the controller uses it).
"""

from __future__ import annotations

from typing import Iterable, Mapping

from pathways_torch.wire import pb

__all__ = ["transfer_ends", "report_refusal"]


def transfer_ends(calls: Iterable, copy: pb.ShardRef, programs: Mapping) -> set[tuple[str, str]]:
    """The (sender, receiver) pairs of ``copy`` (a shard tagged with the call that consumes it) among ``calls``: the
    live calls of its program run, or the plain call alone. ``programs``: program id → its lowered program."""
    ends: set[tuple[str, str]] = set()
    for call in calls:
        if not call.run_base:   # a plain call: the controller itself routed each copy (`CallDispatch._route_input`)
            ends.update((sender, receiver) for sender, receiver, routed in call.routes if routed == copy)
            continue
        lowered = programs.get(call.program_id)
        if lowered is None:
            continue
        to_node = copy.tag - call.run_base
        if not 0 <= to_node < len(lowered.spec.nodes):
            continue
        receivers = lowered.spec.nodes[to_node].mesh.executor_ids
        for sender, plan in lowered.plans.items():   # the plan's sends to that node (`controller.program.lower`)
            ends.update((sender, receivers[action.send.shard]) for action in plan.actions
                        if action.WhichOneof("kind") == "send" and action.send.to_node == to_node
                        and action.send.shard < len(receivers))
        break   # every call of one run shares its plan
    return ends


def report_refusal(calls: list, copy: pb.ShardRef, programs: Mapping, *, reporter: str, sender: str,
                   receiver: str) -> str | None:
    """Why ``reporter``'s report on ``copy``, which names ``sender`` → ``receiver``, is not believed; None if it is
    (``calls`` must not be empty: a report on a copy no live call waits for is late, not refused)."""
    ends = transfer_ends(calls, copy, programs)
    if reporter in (sender, receiver) and (sender, receiver) in ends:
        return None
    expected = ", ".join(f"{s}->{r}" for s, r in sorted(ends)) or "none"
    return (f"transfer_lost from {reporter} on array {copy.array_id} shard {copy.shard} for call {copy.tag}, naming "
            f"{sender}->{receiver}: expected a report from an end of that copy's route (routes: {expected}); refused")
