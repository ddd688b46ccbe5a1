"""One simulated executor of a simulating host: its own key, sockets, store and device clock, on the host's loop.

To the controller it is an executor like any other: it registers from its own control connection, pings from its
own heartbeat connection, reads commands on its own command socket and data on its own data socket, under its own
identity and CURVE key. What it shares with the other executors of its process is the ZeroMQ context (its I/O
thread and its ZAP handler) and the one loop thread that reads every socket and keeps every device clock.

Its device runs one job at a time, in the order they come: a job is computed when the device takes it (the
simulated backend only advances the device's clock, `executor.sim.SimBackend`), and finished, its Dones sent,
when the clock's deadline comes (`SimHost.at`). Nothing sleeps. Imports no torch.
"""

from __future__ import annotations

import collections
import logging
import time

import zmq

from pathways_torch.wire import SocketLoop, encode, pb
from pathways_torch.wire.security import (CONTROLLER, HANDSHAKE_FAILURES, HEARTBEAT_SUFFIX, INCARNATION_MARK,
                                          ConnectionWatch, Credentials, make_client, make_server)

from .collectives import CollectiveRuntime
from .compile_cache import CompileCache
from .core import ExecutorCore
from .data_roles import DataGate
from .endpoint import CoreEndpoint
from .jobs import ComputeJob
from .sim import SimBackend
from .socket_outbox import SocketOutbox
from .trace import TraceRecorder

__all__ = ["SimExecutor"]

log = logging.getLogger(__name__)

# A simulated executor's trace ring: small, since a thousand of them share one machine (a real executor: 200,000).
SIM_TRACE_EVENTS = 2_000


class SimExecutor(CoreEndpoint):
    """One simulated executor on ``host``'s loop (``host``: a `SimHost`, which schedules and stops it)."""

    def __init__(self, host, executor_id: str, credentials: Credentials, nonce: str):
        self.host, self.executor_id, self.credentials = host, executor_id, credentials
        config = host.config
        self.loop: SocketLoop = host.loop
        self.backend = SimBackend(sleeps=False)
        trace = TraceRecorder(SIM_TRACE_EVENTS)
        self.collectives = CollectiveRuntime(config.bind_host, "sim", trace)
        self._keys = {name: f"{name}:{executor_id}" for name in ("data", "commands", "control", "heartbeat")}
        self.outbox = SocketOutbox(self.loop, credentials, data_key=self._keys["data"],
                                   peer_prefix=f"peer:{executor_id}:", send_control=self._send_control)
        self.outbox.on_peer_frames = self._peer_frames
        self.core = ExecutorCore(executor_id=executor_id, backend=self.backend, outbox=self.outbox,
                                 submit=self._submit, trace=trace, collectives=self.collectives,
                                 compiler=CompileCache(self.backend, trace, background=False))
        self.core.admit_key = host.admit_key
        self.core.data_gate = DataGate(host.gatekeeper.admits)
        self.core.tree.arrival_time = lambda: self._received_at or time.monotonic()
        self._jobs: collections.deque = collections.deque()   # (job, when it became ready), in order
        self._busy = False        # the device is computing a job (its deadline is in the host's heap)
        self._finishing_at: float | None = None   # the deadline of the job being finished: when its successors became ready
        self._received_at: float | None = None    # when the control message being handled came: when its jobs did
        self._last_turn = -1.0
        self.stopped = False
        self.heartbeats_sent = 0
        self.last_answer = time.monotonic()
        self.answered = False
        self._nonce = nonce
        self.data_address = self._bind(self._keys["data"], self._on_data, mandatory=True)
        self.command_address = self._bind(self._keys["commands"], self._on_control)
        self._connect(self._keys["control"], "", lambda frames: None, watch=True)
        self._connect(self._keys["heartbeat"], HEARTBEAT_SUFFIX, self._on_heartbeat_answer)

    # ------------------------------------------------------------ sockets

    def _bind(self, key: str, handler, mandatory: bool = False) -> str:
        socket = self.loop.context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        if mandatory:   # a client that stops reading: its messages wait here (SocketLoop), none is dropped
            socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        make_server(socket, self.credentials)
        socket.bind(f"tcp://{self.host.config.bind_host}:0")
        self.loop.add_socket(key, socket, handler)
        return socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def _connect(self, key: str, suffix: str, handler, watch: bool = False) -> None:
        """A DEALER to the controller under identity ``<id><suffix>~<nonce>``, CURVE to the controller's key."""
        socket = self.loop.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IDENTITY, f"{self.executor_id}{suffix}{INCARNATION_MARK}{self._nonce}".encode())
        make_client(socket, self.credentials, self.credentials.public_key(CONTROLLER))
        self.loop.add_socket(key, socket, handler)
        if watch:   # before it connects: a refused key is refused at the first handshake (ExecutorProcess says why)
            self.loop.monitor(key, ConnectionWatch(f"{self.executor_id} control socket", self._on_control_event)
                              .on_frames)
        socket.connect(self.host.config.controller_address)

    def _on_control_event(self, event: str, watch: ConnectionWatch) -> None:
        if event in HANDSHAKE_FAILURES and watch.rejected:
            self.host.refused(self.executor_id, event)

    def _send_control(self, frames: list) -> None:
        self.loop.send_now(self._keys["control"], frames)

    def register(self) -> None:
        register = pb.Register(executor_id=self.executor_id, data_address=self.data_address,
                               device=self.backend.device, backend=self.backend.name, pid=self.host.pid,
                               store_bytes=self.core.store.bytes, public_key=self.credentials.keys.public,
                               command_address=self.command_address, island=self.host.config.island)
        self._send_control(encode(pb.Envelope(register=register)))

    # ------------------------------------------------------------ messages

    def _socket_counters(self) -> dict[str, int]:
        return {"send_backlog_high_water": self.loop.backlog_high_water, "heartbeats_sent": self.heartbeats_sent}

    def _on_control(self, frames) -> None:
        self._arrived(self._control_frames, frames)
        if self.core.stopped:
            self.stop("the controller asked")

    def _on_data(self, frames) -> None:
        self._arrived(self._data_frames, frames)   # a launch from this executor's parent in a launch tree, too

    def _arrived(self, handle, frames) -> None:
        """Handle a message whose jobs are ready when it came: its socket was ready when this turn's poll returned if
        it is the first read this turn (the host may have spent the turn so far computing other executors' jobs); a
        later one may have come during the turn, so it counts from now."""
        turn = self.loop.turn_started
        self._received_at = turn if turn != self._last_turn else time.monotonic()
        self._last_turn = turn
        try:
            handle(frames)
        finally:
            self._received_at = None

    def ping(self, now: float) -> None:
        try:   # a ping that cannot leave now is not kept: the next one will (the silence check still runs)
            self.loop.socket(self._keys["heartbeat"]).send(self.heartbeat(), zmq.NOBLOCK)
            self.heartbeats_sent += 1
        except zmq.Again:
            pass

    def _on_heartbeat_answer(self, frames) -> None:
        self.last_answer, self.answered = time.monotonic(), True
        stop = self._heartbeat_answer(frames)
        if stop is not None:
            self.stop(stop)

    # ------------------------------------------------------------ the device

    def _submit(self, job: ComputeJob) -> None:
        # A launch from a parent in a launch tree came when the parent had it (the host's turn is the simulation's).
        came = self.core.tree.launch_sent_at or self._received_at
        ready = next((t for t in (self._finishing_at, came) if t is not None), None) or time.monotonic()
        self._jobs.append((job, ready))
        if not self._busy:
            self._start_next()

    def _start_next(self) -> None:
        if self._busy or not self._jobs or self.stopped:
            return
        job, ready = self._jobs.popleft()
        self._busy = True
        self.backend.ready_at = ready
        try:
            self.core.compute(job)
        except Exception as exc:  # a bug of ours: fail this job, keep serving the rest
            log.exception("executor %s: compute failed outside the function", self.executor_id)
            self.core.fail(job, exc)
        deadline = max(self.backend.free_at, ready)
        self.host.at(deadline, lambda: self._finish(job, deadline))

    def _finish(self, job: ComputeJob, deadline: float) -> None:
        if self.stopped:
            return
        self._finishing_at = deadline
        try:
            self.core.finish(job)   # its Dones leave now; a job queued behind it may start
        finally:
            self._finishing_at = None
            self._busy = False
        # After the other executors' jobs due now have finished (their Dones first): a timer due now runs after
        # those already due.
        if self._jobs:
            self.host.at(time.monotonic(), self._start_next)

    def check_transfers(self, now: float) -> None:
        self.core.check_transfers(now)

    # ------------------------------------------------------------ stop

    def stop(self, reason: str) -> None:
        """Close this executor's sockets (the others of the process go on); the host exits after the last."""
        if self.stopped:
            return
        self.stopped = True
        self._jobs.clear()
        self.outbox.close_all_peers()
        for key in self._keys.values():
            self.loop.close_socket(key)
        log.info("executor %s stopped: %s", self.executor_id, reason)
        self.host.stopped(self, reason)
