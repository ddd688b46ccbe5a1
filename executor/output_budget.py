"""Outputs stored within the bytes the controller counts for them (issue 46: memory counted where it lands).

Under ``--executor-memory-bytes`` the controller counts each output shard of a call or program run at the size its
client declared (`controller.memory`) and sends that count with the run (``Run.output_budget_bytes``,
``RunProgram.output_budget_bytes``); the data plane marks each output's store entry with it (`Entry.budget`).
Every output of every backend, fused, simulated or not, lands in the store through `RunQueue.finish`, which calls
`refuse_over_budget` on a job that has such an output: a value larger than its budget is not stored; a failure of
0 bytes takes its place, which its owner reads, and the Done of the call that made it says so (the controller fails
that call's outputs). So an executor never stores more for a run than the controller counts, whatever a client
declares. Without a limit no budget is sent and nothing here runs.

An output whose size depends on the data is declared 0 bytes (the client cannot know it): under a limit it cannot
be stored, since nothing counts it.
"""

from __future__ import annotations

import collections
import logging

from pathways_torch.errors import OUTPUT_OVER_BUDGET
from pathways_torch.wire import pb

from .jobs import ComputeJob

__all__ = ["refuse_over_budget", "program_budgets", "OUTPUT_OVER_BUDGET"]

log = logging.getLogger(__name__)


def program_budgets(run: pb.RunProgram, keys: list) -> list | tuple:
    """The budgets of a segment's stored outputs (``keys``: their store keys) in one run of a program: a program
    output's bytes as the controller counts them, None for an intermediate (not counted: unchecked); () without a
    limit."""
    if not run.output_budget_bytes:
        return ()
    budget_of = dict(zip(run.output_array_ids, run.output_budget_bytes))
    return [budget_of.get(key[0]) for key in keys]


def refuse_over_budget(job: ComputeJob, executor_id: str, counters: collections.Counter) -> int:
    """Put a failure in ``job.values`` in place of each output larger than its store entry's budget, and fail the
    Done of the call that made it; how many were refused. Each is counted (``outputs_over_budget``, reported with
    Stats) and logged: the first ten, then every thousandth (a client must not flood the log)."""
    refused = 0
    values = job.values
    for index, (value, entry) in enumerate(zip(values, job.out_entries)):
        budget = entry.budget
        if budget is None or isinstance(value, pb.RemoteFailure) or value.nbytes <= budget:
            continue
        if refused == 0 and not isinstance(values, list):   # a backend's tuple: copied once, to be written
            values = job.values = list(values)
        call_id, position, name = _made_by(job, index)
        failure = pb.RemoteFailure(type=OUTPUT_OVER_BUDGET, executor_id=executor_id, origin_call_id=call_id,
                                   message=_message(name, call_id, position, value.nbytes, budget, executor_id))
        values[index] = failure
        _fail_done(job.dones, call_id, failure)
        refused += 1
        counters["outputs_over_budget"] += 1
        count = counters["outputs_over_budget"]
        if count <= 10 or count % 1000 == 0:
            log.warning("%s: an output not stored (%d so far): %s", executor_id, count, failure.message)
    return refused


def _made_by(job: ComputeJob, index: int) -> tuple[int, int, str]:
    """(call id, output position in that call, function name) of the job's ``index``-th stored output."""
    segment = job.segment
    if segment is None:   # a plain run started at once: one call, its outputs in order
        return job.call_id, index, job.function.name if job.function is not None else ""
    slot = segment.output_slots[index]
    for step_index, step in enumerate(segment.steps):
        if slot in step.outputs:
            function = job.functions[step_index] if step_index < len(job.functions) else None
            return segment.ids(step)[1], step.outputs.index(slot), function.name if function is not None else ""
    return segment.base_call_id, index, ""


def _fail_done(dones: list, call_id: int, failure: pb.RemoteFailure) -> None:
    """The call's Done reports the failure (a call whose Done failed already keeps its first failure)."""
    for done in dones:
        if done.call_id == call_id and done.ok:
            done.ok = False
            done.failure.CopyFrom(failure)
            del done.digests[:]
            del done.output_shapes[:]


def _message(name: str, call_id: int, position: int, nbytes: int, budget: int, executor_id: str) -> str:
    function = f" of function {name!r}" if name else ""
    return (f"output {position} of call {call_id}{function} is {nbytes} bytes on executor {executor_id}, but the call "
            f"declared {budget} bytes per shard, which is what the controller counts against its memory limit "
            f"(--executor-memory-bytes); it was not stored. Fix: declare each output's real size "
            f"(CallSpec.output_shard_bytes: the pathways_torch client library does), or, for an output whose size "
            f"depends on the data (declared 0), give it a size known when tracing (pad it to a bound)")
