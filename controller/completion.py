"""How calls end: executors' Done reports, the errors of failed calls, and lost transfers.

A call completes when every executor of its mesh has reported; its outputs settle ready (or fail, when replicas
disagree or data-dependent shapes differ). A failed call's error is its origin's when the failure came from
upstream (kept in `CallFailures` while the origin's outputs are held), and a failure that reads like a lost peer
waits a moment for the launcher to see an exit, so that it is reported as that executor's loss rather than the
model's. A transfer no one acknowledged is reported by its sender; its receiver says whether a run there lacked
it, which fails that run and abandons the groups of both ends' islands.
"""

from __future__ import annotations

import collections
import logging
import traceback
from typing import Callable

from pathways_torch.errors import PathwaysError, PlacementError, RemoteError, ReplicationError, TRANSFER_LOST
from pathways_torch.wire import pb
from pathways_torch.wire.framing import PROGRAM_RUN_REFUSED

from .arrays import FAILED, READY
from .call_spec import CallSpec, InFlightCall
from .failures import failed_copy
from .transfer_reports import report_refusal

__all__ = ["Completion"]

log = logging.getLogger(__name__)

# A failure that reads like a lost peer (a collective's connection reset or closed) waits up to this long for the
# launcher to see an executor exit, so that it is reported as that executor's loss, not as the model's error.
_PEER_LOSS_PATIENCE_S = 1.0
_PEER_LOSS_MARKERS = ("connection closed by peer", "connection reset", "broken pipe", "remote worker",
                      "socket closed")


class Completion:
    """The `Controller`'s handling of Done and TransferLost reports, and of failed calls (under its lock).

    A Done batch is checked against its launch tree (``launch_trees``); a call that ended leaves ``dispatch``; a
    failed call's error is kept in ``failures``; an executor that refuses a program run is lost (``members``); a
    run that lacked a lost transfer abandons the ``groups`` of both ends' islands."""

    def __init__(self, state, *, groups, launch_trees, dispatch, members, failures):
        self._lock, self._calls, self._programs = state.lock, state.calls, state.programs
        self.resources = state.resources
        self._send, self._drop = state.send, state.drop
        self._groups, self._launch_trees, self._dispatch = groups, launch_trees, dispatch
        self._members, self._failures = members, failures
        # Asks the launcher whether an executor process has exited (and declares it lost if so), set by its host
        # (`exit_watch.watch_exits`). Called before a failure is reported: a collective whose peer was killed fails
        # with a transport error ("connection reset") before any heartbeat could tell, and that failure is the lost
        # executor's, not the user's code's. Arguments: how long to wait for an exit, and with a wait, what to call
        # (on the I/O thread) once it ends.
        self.liveness_probe: Callable[..., None] | None = None
        self.transfers_lost = 0                  # reported by their senders: not acknowledged in time (a cut link)
        self.calls_failed_by_lost_transfers = 0  # of those, the ones a run still waited for (its receiver says: the
                                                 # rest had arrived, their acknowledgement lost, or their run had
                                                 # failed already)
        self.refused_reports = 0                 # transfer reports from an executor that is neither end of the copy

    # ------------------------------------------------------------ Done

    def on_done_batch(self, sender: str, batch: pb.DoneBatch) -> None:
        """The Dones of one run from ``sender``'s subtree of a launch tree: each handled as if its executor sent
        it. A batch naming an executor outside that subtree is dropped whole."""
        refused = self._launch_trees.covers(sender, batch)
        if refused:
            self._drop(refused)
            return
        executors = self.resources.executors
        for done in batch.dones:
            info = executors.get(done.executor_id)
            if info is None or info.lost:
                continue   # its calls failed with it
            call = self._calls.get(done.call_id)
            try:
                self.on_done(done.executor_id, done)
            except Exception as exc:   # as in Controller.on_message: the call must still end, with the reason
                self.fail_done_call(call, exc)
        for group in batch.groups:
            call = self._calls.get(group.call_id)
            try:
                self._on_done_group(group, call)
            except Exception as exc:
                self.fail_done_call(call, exc)

    def _on_done_group(self, group: pb.DoneGroup, call: InFlightCall | None) -> None:
        """Successes of one call from many executors: `on_done`'s success path with set operations, not a Done
        handled per executor (a run on 1,024 executors ends with 1,024 of them)."""
        if call is None:
            if not self._dispatch.closing_reason:
                self._drop(f"Dones for unknown call {group.call_id} from {len(group.executor_ids)} executors")
            return
        named = set(group.executor_ids)
        waited = named & call.waiting
        if len(waited) < len(named):
            executors = self.resources.executors
            unexpected = sorted(e for e in named - waited if e not in executors or not executors[e].lost)
            if unexpected:   # a lost executor's Done is late, not unknown: its calls failed with it
                self._drop(f"Done for call {group.call_id} from {unexpected[:3]}, which it does not wait for")
        call.waiting -= waited
        call.device_s += group.device_ns / 1e9
        if not call.waiting:
            self._end_when_all_reported(call)

    def on_done(self, executor_id: str, done: pb.Done, probed: bool = False) -> None:
        if not done.ok and done.failure.type == PROGRAM_RUN_REFUSED:
            # The executor does not hold a program we sent it: none of that run's calls (nor later gang work)
            # can complete there. What depends on it fails now, as for a lost executor.
            info = self.resources.executors.get(executor_id)
            if info is not None and not info.lost:
                self._members.lose(executor_id, done.failure.message)
            return
        call = self._calls.get(done.call_id)
        if call is None and self._dispatch.closing_reason:
            return   # closing ended every pending call (ContextClosedError): late Dones are expected, not dropped
        if call is None or executor_id not in call.waiting:
            self._drop(f"Done for unknown call {done.call_id} from {executor_id}")
            return
        if not (done.ok or probed or call.failed) and self.liveness_probe is not None \
                and _looks_like_peer_loss(done.failure.message):
            # A peer's transport error can arrive while the killed process is still being torn down (its sockets
            # close before it can be reaped): the launcher gets a moment to see the exit, then this Done is handled.
            # Polled later, never slept here: this is the I/O thread, under the lock, and heartbeats would wait.
            self.liveness_probe(_PEER_LOSS_PATIENCE_S, lambda: self._on_probed_done(executor_id, done))
            return
        call.waiting.discard(executor_id)
        call.device_s += done.device_ns / 1e9   # what the executor measured: the client's share is charged it
        if not done.ok:
            peer_loss = _looks_like_peer_loss(done.failure.message)
            if self.liveness_probe is not None and not call.failed:   # failed already: a loss was declared
                self.liveness_probe(0.0)   # may fail the call first, with ExecutorLostError
            if peer_loss and call.waiting and not call.failed and self.liveness_probe is None:
                # Executors on other hosts: no process to reap. The peer that went silent is either lost
                # within the heartbeat bound (ExecutorLostError, naming it) or reports itself.
                call.held_failure = call.held_failure or done.failure
            else:
                self._failures.fail(call, self._error_for(call, call.held_failure or done.failure))
        else:
            if done.digests:
                call.digests[executor_id] = list(done.digests)
            if done.output_shapes:
                call.shapes[executor_id] = [tuple(meta.shape) for meta in done.output_shapes]
        if not call.waiting:
            self._end_when_all_reported(call)

    def _end_when_all_reported(self, call: InFlightCall) -> None:
        if call.held_failure is not None:
            self._failures.fail(call, self._error_for(call, call.held_failure))
        self._dispatch.end(call)   # the liveness probe may have ended it already
        if not call.failed:
            self._complete(call)

    def _on_probed_done(self, executor_id: str, done: pb.Done) -> None:
        """The liveness probe a failed Done waited for has ended: handle the Done, unless its call ended."""
        with self._lock:
            call = self._calls.get(done.call_id)
            if call is not None and executor_id in call.waiting:
                try:
                    self.on_done(executor_id, done, probed=True)
                except Exception as exc:   # as in on_message: the call must still end, with the reason
                    self.fail_done_call(call, exc)

    def fail_done_call(self, call: InFlightCall | None, exc: BaseException) -> None:
        """Handling a Done raised ``exc`` (a bug of ours): its call still ends, failing with the reason."""
        log.exception("controller: handling a Done failed; its call fails")
        if call is not None:
            self._dispatch.end(call)
            self._failures.fail(call, PathwaysError(
                f"the controller failed while completing {call.spec.name!r} (a bug of ours: "
                f"{type(exc).__name__}: {exc}); called from:\n{call.spec.call_site.rstrip()}\n"
                f"{''.join(traceback.format_exception(exc))}"))

    def _complete(self, call: InFlightCall) -> None:
        if call.spec.report_shapes and not self._record_shapes(call):
            return
        for index, record in enumerate(call.outputs):
            replicated = index < len(call.spec.replicated_outputs) and call.spec.replicated_outputs[index]
            if replicated and call.digests:
                position = call.spec.output_positions[index] if call.spec.output_positions else index
                digests = {executor: d[position] for executor, d in call.digests.items()}
                if len(set(digests.values())) > 1:
                    groups = collections.defaultdict(list)
                    for executor, digest in digests.items():
                        groups[digest].append(executor)
                    record.settle(FAILED, ReplicationError(
                        f"output {index} of {call.spec.name!r} is declared Replicate() but its shards differ "
                        f"({len(groups)} distinct values across {', '.join(call.spec.mesh.executor_ids)}); "
                        f"reduce it with pw.all_reduce first or declare it Shard(...)\ncalled from:\n"
                        f"{call.spec.call_site.rstrip()}"))
                    continue
            record.settle(READY)

    def _record_shapes(self, call: InFlightCall) -> bool:
        """Give each output the block shape its executors reported; fail the call if they disagree."""
        executors = call.spec.mesh.executor_ids
        for index, record in enumerate(call.outputs):
            shapes = [call.shapes.get(e, [None] * (index + 1))[index] for e in executors]
            if len(set(shapes)) > 1 or shapes[0] is None:
                described = ", ".join(f"{e}: {list(s) if s is not None else 'none'}" for e, s in zip(executors, shapes))
                self._failures.fail(call, PlacementError(
                    f"output {index} of {call.spec.name!r} has a size that depends on the data, and its shards came "
                    f"out with different shapes ({described}); a sharded array needs equal blocks. Fix: make the "
                    f"size agree across shards (e.g. pad to a fixed size, or decide it from an all_reduce), or "
                    f"run the function on a mesh of one executor\ncalled from:\n{call.spec.call_site.rstrip()}"))
                return False
            record.block_shape = shapes[0]
        return True

    # ------------------------------------------------------------ failure

    def _error_for(self, call: InFlightCall, failure: pb.RemoteFailure) -> BaseException:
        """The error for a failed call: the origin call's own error when the failure came from upstream.

        A dependent's Done can arrive before the origin's (the failure travels
        executor→executor faster than the origin's Done reaches us), so the origin
        call is failed here, first, with an error built from the same report.
        """
        origin = failure.origin_call_id
        if origin and origin != call.call_id:
            kept = self._failures.error_of(origin)
            if kept is not None:
                return kept
            origin_call = self._calls.get(origin)
            if origin_call is not None:
                error = _remote_error(origin_call.spec, failure)
                self._failures.fail(origin_call, error)
                return error
        return _remote_error(call.spec, failure)

    # ------------------------------------------------------------ lost transfers

    def on_transfer_lost(self, executor_id: str, msg: pb.TransferLost) -> None:
        """A transfer was not acknowledged in time (its link failed): the sender says so (`_on_unacknowledged`),
        and the receiver, told, says whether a run there did lack it (`_on_copy_missing`)."""
        if msg.missing:
            self._on_copy_missing(executor_id, msg)
        else:
            self._on_unacknowledged(executor_id, msg)

    def _on_unacknowledged(self, sender: str, msg: pb.TransferLost) -> None:
        """The sender's report: tell the receiver its copy will not come, on the control path. Nothing fails yet:
        the copy may have arrived, its acknowledgement alone lost (then the receiver ignores this)."""
        destination = next((info for info in self.resources.ordered()
                            if msg.to_address in (info.data_address, info.link_address, info.transfer_address)), None)
        if destination is not None and not self._believed(sender, sender, destination.executor_id, msg.shard):
            return
        self.transfers_lost += 1
        if destination is None or destination.lost:
            return   # its loss failed what waited for it already
        failure = pb.RemoteFailure(
            type=TRANSFER_LOST, executor_id=sender, origin_call_id=msg.shard.tag,
            message=(f"the transfer of array {msg.shard.array_id} shard {msg.shard.shard} ({msg.nbytes} B) from "
                     f"{sender} to {destination.executor_id} at {msg.to_address} was not acknowledged within "
                     f"{msg.waited_s:.0f} s: the link between them failed (both executors are alive); the calls "
                     f"that need it fail, later ones are unaffected"))
        self._send(destination.executor_id, failed_copy(msg.shard, failure))

    def _on_copy_missing(self, receiver: str, msg: pb.TransferLost) -> None:
        """The receiver's answer: a run there waited for the lost copy and now fails at that input. Fail its call,
        and abandon the groups of both ends' islands: the receiver's peers go on into the run's collectives
        without it (they would wait until gloo's timeout, and the group would be out of step after)."""
        call_id = msg.shard.tag
        run = self._live_calls_of_run(call_id)
        if not run or any(c.failed for c in run):
            # Its run ended, or failed already (an earlier fault's failure reached it, or another transfer of the
            # same cut: that fault abandoned the groups). A late answer must not abandon the groups formed since,
            # for the steps run again.
            return
        sender = msg.failure.executor_id
        if not self._believed(receiver, sender, receiver, msg.shard):
            return
        self.calls_failed_by_lost_transfers += 1
        call = self._calls.get(call_id)
        if call is not None:        # a reporting node (the others fail with the run on the receiver)
            self._failures.fail(call, _remote_error(call.spec, msg.failure))
        islands = {self.resources.island_of(e) for e in (sender, receiver) if e in self.resources.executors}
        what = f"transfer:{msg.shard.array_id}.{msg.shard.shard}:{sender}->{receiver}"
        for island in sorted(islands):
            self._groups.abandon_island(island, what)

    def _believed(self, reporter: str, sender: str, receiver: str, copy: pb.ShardRef) -> bool:
        """Whether a report on ``copy`` (``sender`` → ``receiver``) comes from one of its ends by the routes of the
        live calls that wait for it; else it is dropped and counted (`controller.transfer_reports`). A report on a
        copy no live call waits for is late: believed, as it can fail nothing."""
        run = self._live_calls_of_run(copy.tag)
        why = report_refusal(run, copy, self._programs, reporter=reporter, sender=sender, receiver=receiver) \
            if run else None
        if why:
            self.refused_reports += 1
            self._drop(why)
        return not why

    def _live_calls_of_run(self, call_id: int) -> list[InFlightCall]:
        """The unfinished calls of the program run holding ``call_id`` (any node's, reporting or not); the call
        alone for a plain call."""
        call = self._calls.get(call_id)
        if call is not None and not call.run_base:
            return [call]
        return [c for c in self._calls.values() if c.run_base and c.run_base <= call_id < c.run_base + c.run_nodes]


def _looks_like_peer_loss(message: str) -> bool:
    lowered = message.lower()
    return any(marker in lowered for marker in _PEER_LOSS_MARKERS)


def _remote_error(spec: CallSpec, failure: pb.RemoteFailure) -> RemoteError:
    return RemoteError(failure.message, function=spec.name, executor_id=failure.executor_id,
                       remote_type=failure.type, remote_traceback=failure.traceback, call_site=spec.call_site,
                       op=failure.op, node_index=failure.node_index, function_id=spec.function_id)
