"""Who the executors are and whether they live: registration, incarnations, heartbeats and loss.

An executor registers, and registers again as a new incarnation after a restart; its heartbeats keep it alive.
Silence past the heartbeat timeout, the launcher's word, or a second registration declares it lost, and a loss
fails every call and array that depends on it, abandons the process groups of the islands involved, and tells
the survivors there what to drop.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from pathways_torch.errors import ExecutorLostError
from pathways_torch.wire import pb

from .arrays import PENDING
from .call_spec import InFlightCall
from .failures import failed_copy
from .resources import DEFAULT_ISLAND, ExecutorInfo

__all__ = ["Membership"]


@dataclasses.dataclass
class _Loss:
    """What one executor's loss failed, for the Cancel its survivors get."""

    executor_id: str
    incarnation: str
    islands: list[str]
    call_ids: list[int]
    group_ids: list[int]
    error: ExecutorLostError

log = logging.getLogger(__name__)


class Membership:
    """The `Controller`'s executors, their incarnations and their losses.

    Its public methods take the controller's lock; the ones its other parts call (`on_register`, `lose`) expect it
    held. A loss reaches every other part, each named here: the ``groups`` of the islands involved are abandoned,
    the calls on the lost executor fail (``failures``) and end (``dispatch``), its pending frees are dropped
    (``lifetimes``) and its island's tree ends (``launch_trees``). Then each of ``loss_listeners`` hears of it, as
    each of ``incarnation_listeners`` hears of a new incarnation; ``labels`` name executors in its errors.
    """

    def __init__(self, state, *, groups, failures, dispatch, lifetimes, launch_trees, labels: dict,
                 loss_listeners: list, incarnation_listeners: list):
        self._state = state
        self._lock, self._calls, self._functions = state.lock, state.calls, state.functions
        self._programs, self._stale_programs = state.programs, state.stale_programs
        self.resources, self.arrays, self.rendezvous = state.resources, state.arrays, state.rendezvous
        self.sequencers = state.sequencers
        self._send, self._drop = state.send, state.drop
        self._groups, self._failures, self._dispatch = groups, failures, dispatch
        self._lifetimes, self._launch_trees = lifetimes, launch_trees
        self._labels, self._loss_listeners, self._incarnation_listeners = labels, loss_listeners, incarnation_listeners
        self._registered = threading.Condition(self._lock)   # notified at each registration
        self.shut_down = False
        self.stale_messages = 0   # refused: sent by an incarnation that was replaced (here and `Controller`)

    # ------------------------------------------------------------ registration and incarnations

    def on_register(self, executor_id: str, msg: pb.Register) -> None:
        if msg.executor_id and msg.executor_id != executor_id:
            self._drop(f"executor {executor_id!r} tried to register as {msg.executor_id!r}")
            return
        previous = self.resources.executors.get(executor_id)
        if previous is not None and not previous.lost:
            # Registered again before its loss was declared (restarted within the heartbeat timeout): the old
            # incarnation's work fails now, as for any loss.
            self.lose(executor_id, f"it registered again from {msg.data_address} (a new incarnation)")
        self._launch_trees.forget(executor_id)   # a new process: its commands are numbered afresh
        info = self.resources.register(executor_id, data_address=msg.data_address, device=msg.device,
                                       backend=msg.backend, pid=msg.pid, last_heard=self._state.clock(),
                                       public_key=msg.public_key, command_address=msg.command_address,
                                       island=msg.island or DEFAULT_ISLAND, transfer_address=msg.transfer_address)
        if previous is not None:
            self._take_place(executor_id, info)
            for listener in self._incarnation_listeners:
                listener(info)
        config = self._state.config
        self._send(executor_id, pb.Envelope(welcome=pb.Welcome(
            index=info.index, heartbeat_interval_s=self.asked_heartbeat_interval_s(),
            heartbeat_timeout_s=config.heartbeat_timeout_s, epoch=info.epoch,
            transfer_timeout_s=config.resolved_transfer_timeout_s, put_secret=self._lifetimes.put_secret)))
        self._registered.notify_all()

    def _take_place(self, executor_id: str, info) -> None:
        """A new incarnation of a lost executor registered: it starts its gang order afresh (at 0, as the new
        process does), joins new groups (formed at first use: its loss forgot every group of its island, and
        none with it forms while it is lost), and programs that ran on the old one are lowered again for its
        address, key and groups at their next run."""
        self.sequencers.of(self.resources.island_of(executor_id)).last_collective[executor_id] = 0
        self._stale_programs.update(pid for pid, lowered in self._programs.items() if executor_id in lowered.plans)
        log.warning("controller: %s registered again as incarnation %d (pid %d, %s)", executor_id, info.epoch,
                    info.pid, info.data_address)

    def admit_key(self, role: str, public_key: bytes) -> None:
        """Tell every live executor to admit ``public_key`` as ``role`` from now on (a replacement's fresh key;
        the role's previous key is revoked). Sent before the replacement starts, so they admit it first."""
        with self._lock:
            for info in self.resources.ordered():
                if not info.lost and info.executor_id != role:
                    self._send(info.executor_id, pb.Envelope(admit_key=pb.AdmitKey(role=role, public_key=public_key)))

    def wait_for_incarnation(self, executor_id: str, epoch: int, timeout_s: float) -> ExecutorInfo:
        """Wait until incarnation ``epoch`` (or a later one) of ``executor_id`` has registered; return it."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                info = self.resources.executors.get(executor_id)
                if info is not None and info.epoch >= epoch and not info.lost:
                    return info
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ExecutorLostError(
                        f"no replacement for {executor_id} registered within {timeout_s:g} s (incarnation {epoch} "
                        f"expected); see its log, or raise replacement_timeout_s", executor_id=executor_id)
                self._registered.wait(left)

    def rival_claim(self, executor_id: str, msg: pb.Register) -> str | None:
        """Why a registration must be refused because a live executor already holds its id (two nodes launched
        with one --node-rank, or one key folder on two hosts); None if it may register."""
        with self._lock:
            info = self.resources.executors.get(executor_id)
            if info is None or info.lost or info.data_address == msg.data_address:
                return None
            if self._state.clock() - info.last_heard > self._state.config.heartbeat_timeout_s:
                return None     # the old one is gone, just not declared yet: a restart may take its place
            return (f"{executor_id} registered from {msg.data_address} while {executor_id} at {info.data_address} "
                    f"is alive: two nodes claim it (the same --node-rank on two nodes, or one node's key folder "
                    f"on two hosts); the second is refused: give each node its own --node-rank and key folder")

    def wait_for_executors(self, count: int, timeout_s: float) -> None:
        """Wait until ``count`` executors have registered."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while len(self.resources.executors) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ExecutorLostError(
                        f"expected {count} executors to register within {timeout_s:.0f} s, "
                        f"got {len(self.resources.executors)}; see the executors' logs")
                self._registered.wait(left)

    # ------------------------------------------------------------ liveness

    def heartbeat(self) -> None:
        """Declare lost every executor silent past the timeout (run every heartbeat interval).

        Executors ping on a connection of their own (see `ControllerServer`), from a
        thread of their own, so a long compile or computation never looks like death.
        """
        now = self._state.clock()
        with self._lock:
            if self.shut_down:
                return
            config = self._state.config
            # An incarnation not heard from on its heartbeat connection yet may still be connecting: a start-up of a
            # thousand executors took 13 s here between a Register and that executor's first ping. It gets the loss
            # bound (twice the timeout), as the executor gives the controller its join timeout.
            limits = (config.heartbeat_timeout_s, config.loss_bound_s)
            silent = [(info.executor_id, f"silent for {now - info.last_heard:.1f} s (heartbeat timeout "
                                         f"{limits[not info.pinged]:g} s)")
                      for info in self.resources.ordered()
                      if not info.lost and now - info.last_heard > limits[not info.pinged]]
            if silent:   # together: a process of many simulated executors falls silent at once
                self.lose_many(silent)

    def heard_from(self, executor_id: str, epoch: int = 0, awaiting_welcome: bool = False,
                   told: int = 0) -> tuple[str, list[str], int]:
        """An executor's heartbeat arrived: note it. Returns its state — ``"live"``, ``"lost"``, ``"stale"`` (an
        incarnation that was replaced) or ``"unknown"`` (not registered) — the faults of its island after the
        first ``told`` (lost incarnations, whose groups it must abandon), and how many its island had in all.
        ``awaiting_welcome``: epoch 0 from the very process whose Register was accepted (its Welcome is on the
        way): it is the current incarnation."""
        with self._lock:
            info = self.resources.executors.get(executor_id)
            if info is not None and not epoch and awaiting_welcome:
                epoch = info.epoch
            if info is None or not epoch:
                # Not welcomed yet (its Register may still be on its way, or was refused): it keeps no one alive.
                return "unknown", [], 0
            if epoch and epoch != info.epoch:
                self.stale_messages += 1
                return "stale", [], 0
            if info.lost:
                return "lost", [], 0
            info.last_heard = self._state.clock()
            info.pinged = True
            return ("live", *self._groups.faults_since(info.island, told))

    def island_faults(self, executor_id: str, told: int) -> tuple[list[str], int] | None:
        """The faults of a live executor's island after the first ``told``, and how many in all (None: not live)."""
        with self._lock:
            info = self.resources.executors.get(executor_id)
            if info is None or info.lost:
                return None
            return self._groups.faults_since(info.island, told)

    def asked_heartbeat_interval_s(self) -> float:
        """How often each executor is asked to ping, for as many as have registered (`ControllerConfig`)."""
        return self._state.config.asked_heartbeat_interval_s(len(self.resources.executors))

    # ------------------------------------------------------------ loss

    def declare_lost(self, executor_id: str, why: str) -> None:
        """The launcher saw the executor's process die: fail what depends on it now, not at the timeout."""
        self.declare_lost_many([(executor_id, why)])

    def declare_lost_many(self, lost: list[tuple[str, str]]) -> None:
        """Several executors died at once (one process ran many simulated executors): each is lost as by
        `declare_lost`, and the survivors get one Cancel for all of them, not one per loss."""
        with self._lock:
            if self.shut_down:
                return
            live = [(e, why) for e, why in lost
                    if (info := self.resources.executors.get(e)) is not None and not info.lost]
            if live:
                self.lose_many(live)

    def lose(self, executor_id: str, why: str) -> None:
        """Fail every future that depends on the executor; refuse new work that would."""
        self.lose_many([(executor_id, why)])

    def lose_many(self, lost: list[tuple[str, str]]) -> None:
        """`lose` each of ``lost`` (``(executor id, why)``), then tell the survivors of the islands involved once."""
        losses = [self._lose_one(executor_id, why) for executor_id, why in lost]
        self._cancel_on_survivors(losses)
        self._launch_trees.tell_ended(str(losses[0].error))   # those no Cancel told
        for executor_id, error in ((loss.executor_id, loss.error) for loss in losses):
            for listener in self._loss_listeners:
                listener(executor_id, error)

    def _lose_one(self, executor_id: str, why: str) -> "_Loss":
        info = self.resources.executors[executor_id]
        info.lost = True
        self._lifetimes.take_pending_frees(executor_id)   # never sent: its store is gone
        self._launch_trees.end_island(info.island)   # launches on their way through it will never arrive
        label = self._labels.get(executor_id)
        error = ExecutorLostError(f"executor {executor_id}{f' ({label})' if label else ''} lost: {why}",
                                  executor_id=executor_id)
        log.warning("controller: %s", error)
        incarnation = f"{executor_id}@{info.epoch}"
        self.rendezvous.fail_member(executor_id, str(error))
        failing = [call for call in self._calls.values()
                   if executor_id in call.spec.mesh.executor_ids or executor_id in call.depends_on
                   or any(route[0] == executor_id for route in call.routes)]
        # The island, and every island a failing call runs on or reads from (a program run across islands: its
        # steps there wait for copies the lost executor will never send, on some executors of an island, not all).
        islands = sorted({info.island} | {self.resources.island_of(e) for call in failing
                                          for e in (*call.spec.mesh.executor_ids, *call.depends_on)})
        group_ids = [g for island in islands for g in self._groups.abandon_island(island, incarnation)]
        # Program runs by their first call id too: a survivor drops every segment of such a run, reporting or not.
        failed_calls = sorted({c.call_id for c in failing} | {c.run_base for c in failing if c.run_base})
        # Ready arrays first: a thread woken by a failing future must not see one of them still ready.
        on_it = [record for record in self.arrays.records() if executor_id in record.executor_ids]
        for record in sorted(on_it, key=lambda r: r.state == PENDING):
            record.lose(executor_id, error)
        for call in failing:
            pushes_from_it = [route for route in call.routes if route[0] == executor_id]
            self._failures.fail(call, error)
            self._unblock(call, pushes_from_it, error)
            call.waiting.discard(executor_id)
            if not call.waiting:
                self._dispatch.end(call)
        for function in self._functions.values():
            function.loaded_on.discard(executor_id)  # a restarted executor loads afresh
        return _Loss(executor_id, incarnation, islands, failed_calls, group_ids, error)

    def _cancel_on_survivors(self, losses: list["_Loss"]) -> None:
        """Tell the islands involved (the lost executors', and those running calls that failed with them) what
        failed: their executors drop those calls' queued work and skip their places in gang order (else the next
        collective there would wait for them forever), and the queued formations of the abandoned groups. One
        Cancel per survivor, for every loss at once."""
        call_ids = sorted({c for loss in losses for c in loss.call_ids})
        group_ids = sorted({g for loss in losses for g in loss.group_ids})
        if not call_ids and not group_ids:
            return
        first = losses[0]
        reason = str(first.error) + (f" (and {len(losses) - 1} more executors lost with it)" if len(losses) > 1 else "")
        cancel = pb.Cancel(call_ids=call_ids, group_ids=group_ids, reason=reason, lost_executor=first.incarnation,
                           lost_executors=[loss.incarnation for loss in losses] if len(losses) > 1 else [])
        islands = {island for loss in losses for island in loss.islands}
        gone = {loss.executor_id for loss in losses}
        for other in self.resources.ordered():
            if other.island in islands and not other.lost and other.executor_id not in gone:
                self._send(other.executor_id, pb.Envelope(cancel=cancel))

    def _unblock(self, call: InFlightCall, pushes, error: ExecutorLostError) -> None:
        """Fail the copies a lost executor will never push, so the runs waiting for them end instead of hanging."""
        for _, destination, copy in pushes:
            if self.resources.executors[destination].lost:
                continue
            self._send(destination, failed_copy(copy, pb.RemoteFailure(
                type="ExecutorLostError", message=str(error), executor_id=error.executor_id,
                origin_call_id=call.call_id)))

    def shutdown_executors(self, reason: str) -> None:
        """Tell every live executor to stop; from now on no executor is declared lost."""
        with self._lock:
            self.shut_down = True
            for info in self.resources.ordered():
                if not info.lost:
                    self._send(info.executor_id, pb.Envelope(shutdown=pb.Shutdown(reason=reason)))
