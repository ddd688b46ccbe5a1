"""An executor process: sockets, the compute thread and the liveness watch around `ExecutorCore`.

Threads: the compute thread (`ComputeLoop`) owns the command ROUTER, where the
controller's messages arrive, and the control DEALER, where Register, Done and
every other reply leave; it runs the jobs. The main thread (`SocketLoop`) owns the
data socket (puts, transfers, fetches) and the peer connections; a heartbeat
thread owns the heartbeat connection. `ExecutorCore` is shared by the first two
under one lock.

Every socket speaks CURVE (`pathways_torch.wire.security`): the data and command
ROUTERs admit only allow-listed keys, the command ROUTER only messages sent
with the controller's, and the data ROUTER each kind only from its role's keys
(`executor.data_roles`); the control and heartbeat DEALERs accept only the
controller's key, and a peer DEALER only the key the controller gave for that peer.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time

import zmq

from pathways_torch.wire.process_state import is_alive
from pathways_torch.wire import SocketLoop, encode, pb
from pathways_torch.wire.security import (CONTROLLER, HANDSHAKE_FAILURES, HEARTBEAT_SUFFIX, INCARNATION_MARK,
                                          STORE_SUFFIX, ConnectionWatch, Gatekeeper, KeyDirectory, make_client,
                                          make_server, without_replaced_keys)
from pathways_torch.wire.threads import name_os_thread

from .backends import make_backend
from .collectives import CollectiveRuntime
from .compile_cache import CompileCache
from .compute_loop import ComputeLoop
from .config import ExecutorConfig
from .core import ExecutorCore
from .data_roles import DataGate
from .endpoint import CoreEndpoint
from .jobs import ComputeJob
from .direct_peers import DirectPeers, sends_from_compute
from . import native_lib
from .host_rings import HostRings, rings_enabled
from .socket_outbox import SocketOutbox
from .transfer_inbox import IO_READ_INTERVAL_S, TransferInbox, receives_on_compute
from .trace import TraceRecorder

__all__ = ["ExecutorProcess", "EXIT_LOST", "EXIT_CONTROLLER_GONE", "EXIT_REFUSED"]

log = logging.getLogger(__name__)

# Exit codes a launcher reads (pathways-run restarts the first kind with --max-executor-restarts, not the second).
EXIT_LOST = 3              # told to stop as lost, or refused: a replacement may take its place
EXIT_CONTROLLER_GONE = 4   # the controller (or the parent) is gone: nothing to rejoin
EXIT_REFUSED = 5           # its key was refused: another key of the same folder would not fare better

_CONTROL = "control"
_COMMANDS = "commands"
_DATA = "data"
_INBOX = "transfer inbox"


class ExecutorProcess(CoreEndpoint):
    """Runs one executor until the controller says stop, goes silent, or the parent dies."""

    def __init__(self, config: ExecutorConfig):
        self.config = config
        self.credentials = KeyDirectory(config.keys_dir).credentials(config.key_role or config.executor_id)
        if config.key_role:   # a replacement: the keys of the incarnations it replaces are not admitted
            self.credentials = dataclasses.replace(self.credentials, allowed=without_replaced_keys(
                self.credentials.allowed, config.executor_id, config.key_role))
        self.zmq = zmq.Context()
        self.gatekeeper = Gatekeeper(self.zmq, self.credentials.allowed)
        self.loop = SocketLoop(f"executor-{config.executor_id}", self.zmq)
        self.backend = make_backend(config.backend, config.device, config.num_threads)
        trace = TraceRecorder(config.max_trace_events)
        self.compiler = CompileCache(self.backend, trace, post=lambda fn: self.loop.call_soon(self._locked(fn)))
        self.collectives = CollectiveRuntime(config.bind_host, config.device, trace,
                                             store_factory=self._rendezvous_store,
                                             native=getattr(self.backend, "native_collectives", None))
        if config.backend != "sim":   # the simulated device imports no torch
            from pathways_torch.wire import collective_ops

            collective_ops.set_runtime(self.collectives)
        self.outbox = SocketOutbox(self.loop, self.credentials, data_key=_DATA)
        self.executor_id = config.executor_id
        self.core = ExecutorCore(executor_id=config.executor_id, backend=self.backend, outbox=self.outbox,
                                 submit=self._submit, trace=trace, compiler=self.compiler,
                                 collectives=self.collectives)
        self.core.data.writer.checkpoint_root = config.checkpoint_root   # service clients' checkpoints, under it
        self.core.admit_key = self._admit_key
        self.core.data_gate = DataGate(self.gatekeeper.admits)   # a revoked key's old connections are refused
        self.outbox.on_peer_frames = self._on_peer_frames
        # Appended to every identity towards the controller: this process's connections are its own.
        self._nonce = secrets.token_hex(4)
        self._heartbeats_sent = 0   # written by the heartbeat thread alone; reported with Stats
        # ExecutorCore is single-threaded: the I/O thread (data messages, compile results) and
        # the compute thread (control messages, its jobs) take turns under this lock.
        self._core_lock = threading.RLock()   # re-entered: a compile done at once posts its result inline
        self._exit_reason = ""
        self._refused: dict[str, int] = {}   # refused connections, by socket
        self.data_address = self._bind_data()
        commands, self.command_address = self._bind_commands()
        self.compute = ComputeLoop(f"executor-{config.executor_id}", self.zmq,
                                                         commands=commands, replies=self._connect_control(),
                                                         on_control=self._on_control)
        self.outbox.send_control = self.compute.send
        if sends_from_compute():
            self.outbox.direct = DirectPeers(self.compute, self.zmq, self.credentials, self._on_peer_frames)
        self.inbox = self._bind_inbox() if receives_on_compute() else None
        self.compute.between_jobs = self._between_jobs
        self.loop.every(_TRANSFER_CHECK_S, self._locked(self._check_transfers))
        # Shared-memory rings to the peers of this host (made on the compute thread once the Welcome names this
        # incarnation: `_start_rings`); copies made on the compute thread use them (executor/host_rings.py).
        self.rings: HostRings | None = None
        self._rings_wanted = rings_enabled() and self.outbox.direct is not None and self.inbox is not None
        if self._rings_wanted:
            native_lib.library()   # built by the install; a machine without it fails here, saying how to build it
            self.core.data.on_ring_invite = self._on_ring_invite

    # ------------------------------------------------------------ sockets

    def _bind_data(self) -> str:
        socket = self.loop.context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        # A reader that stops reading: at its high-water mark a send raises (the loop keeps the message and
        # retries; SocketLoop) instead of ZeroMQ dropping it without a word.
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        make_server(socket, self.credentials)
        socket.bind(f"tcp://{self.config.bind_host}:0")
        self.loop.add_socket(_DATA, socket, self._on_data)
        watch = ConnectionWatch(f"executor {self.config.executor_id} data socket", self._on_server_socket_event)
        self.loop.monitor(_DATA, watch.on_frames)
        return socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def _on_server_socket_event(self, event: str, watch: ConnectionWatch) -> None:
        """Refused connections, summed over the sockets we bind (data and command), for Stats."""
        self._refused[watch.name] = watch.refused
        self.core.counters["refused_connections"] = sum(self._refused.values())

    def _bind_inbox(self) -> TransferInbox:
        """The ROUTER peers send copies to, read by the compute thread (and by the I/O thread while it runs a job)."""
        inbox = TransferInbox(self.zmq, self.credentials, self.config.bind_host, self._on_inbox)
        watch = ConnectionWatch(f"executor {self.config.executor_id} transfer inbox", self._on_server_socket_event)
        self.loop.monitor(_INBOX, watch.on_frames, socket=inbox.socket)
        self.compute.share_inbox(inbox)
        self.loop.every(IO_READ_INTERVAL_S, lambda: inbox.read(by_io=True))
        return inbox

    def _between_jobs(self) -> None:
        """On the compute thread before each job: peers' acknowledgements and copies."""
        if self.outbox.direct is not None:
            self.outbox.direct.read_replies()
        if self.inbox is not None:
            self.inbox.read()
        if self.rings is not None:
            self.rings.service()

    def _start_rings(self) -> None:
        """The compute thread's rings, for the incarnation the Welcome named."""
        self.rings = HostRings(self.core.data.epoch, self._on_ring_message, on_lost=self._on_ring_lost,
                               watch=self.compute.watch, unwatch=self.compute.unwatch)
        self.outbox.rings = self.rings
        self.compute.before_sleep, self.compute.after_sleep = self.rings.before_sleep, self.rings.awake

    def _on_ring_lost(self, address: str, tags: list) -> None:
        with self._core_lock:
            self.core.data.report_ring_lost(address, tags)

    def _on_ring_invite(self, invite: pb.RingInvite, role: str | None, key: bytes | None) -> None:
        """A copy carried an invite (on the compute thread, or the I/O thread while a job runs): answered there."""
        def answer():
            if self.rings is not None:
                self.rings.on_invite(invite, role, key)

        answer() if self.compute.on_loop_thread() else self.compute.call_soon(answer)

    def _on_ring_message(self, envelope: bytes, frames: list, role: str | None, key: bytes | None) -> None:
        """A copy read from a ring: handled as the same peer's copy over ZeroMQ would be (no acknowledgement)."""
        with self._core_lock:
            self._data_message(b"", [envelope, *frames], role, key, _no_reply, copies_only="a shared-memory ring")

    def _on_inbox(self, frames) -> None:
        with self._core_lock:
            self._data_frames(frames, reply=self.inbox.reply)

    def _bind_commands(self) -> tuple[zmq.Socket, str]:
        """The ROUTER the controller sends control messages to, for the compute thread (which
        reads only messages sent with the controller's key)."""
        socket = self.zmq.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        make_server(socket, self.credentials)
        socket.bind(f"tcp://{self.config.bind_host}:0")
        # Set up here, before the compute thread takes the socket over.
        watch = ConnectionWatch(f"executor {self.config.executor_id} command socket", self._on_server_socket_event)
        self.loop.monitor(_COMMANDS, watch.on_frames, socket=socket)
        return socket, socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def _connect_control(self) -> zmq.Socket:
        """The connection replies leave on, for the compute thread; its handshake events go to the I/O loop."""
        watch = ConnectionWatch("control socket", self._on_control_event)
        # Watched from before it connects (and set up here, before the compute thread takes the socket over): a
        # refused key is refused once, at the first handshake (ZeroMQ does not try again after an authentication
        # failure), and on a loaded machine that handshake can be over before the line after connect() runs. A
        # watch set up after it missed the refusal: the executor waited unheard for the join timeout.
        return self._controller_connection(
            "", before_connect=lambda socket: self.loop.monitor(_CONTROL, watch.on_frames, socket=socket))

    def _on_control_event(self, event: str, watch: ConnectionWatch) -> None:
        if event in HANDSHAKE_FAILURES and watch.rejected:
            # The keys do not match: fail now, visibly, instead of waiting unheard.
            self._exit(f"could not authenticate with the controller at {self.config.controller_address} ({event}): "
                       f"its key in {self.config.keys_dir} is not the controller's, or this executor's key is "
                       f"not on its allow-list; use the key directory the launcher made for this cluster",
                       EXIT_REFUSED)

    def _controller_connection(self, suffix: str, before_connect=None) -> zmq.Socket:
        """A DEALER to the controller under identity ``<executor id><suffix>``, CURVE to the controller's key;
        ``before_connect(socket)`` runs before it connects (a monitor that must see the first handshake)."""
        socket = self.zmq.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IDENTITY, f"{self.config.executor_id}{suffix}{INCARNATION_MARK}{self._nonce}".encode())
        make_client(socket, self.credentials, self.credentials.public_key(CONTROLLER))
        if before_connect is not None:
            before_connect(socket)
        socket.connect(self.config.controller_address)
        return socket

    def _rendezvous_store(self):
        """This executor's connection to the controller's rendezvous store (made at its first group; imports
        torch, which a simulated executor never does: it forms no group)."""
        from .rendezvous import ControllerStore

        return ControllerStore(self._controller_connection(STORE_SUFFIX), timeout_s=60.0)

    def _locked(self, fn):
        def run():
            with self._core_lock:
                fn()
        return run

    def _on_control(self, frames) -> None:
        with self._core_lock:
            self._control_frames(frames)
        if self._rings_wanted and self.rings is None and self.core.data.epoch:
            self._start_rings()
        if self.core.stopped:
            self._stop("the controller asked")

    def _check_transfers(self) -> None:
        """Report copies not acknowledged by their deadline (I/O thread, every second). The acknowledgements of the
        compute thread's copies are read first, here: a long job (or a blocked collective) leaves them unread there,
        and must neither make a copy look lost nor hide a lost one."""
        if self.outbox.direct is not None:
            self.outbox.direct.read_replies(by_io=True)   # held by the compute thread: it reads them as they come
        self.core.check_transfers(time.monotonic())

    def _socket_counters(self) -> dict[str, int]:
        # The I/O thread's and the heartbeat thread's counts (int reads)
        return {"send_backlog_high_water": self.loop.backlog_high_water, "heartbeats_sent": self._heartbeats_sent,
                "sent_from_compute": self.outbox.direct.sent if self.outbox.direct is not None else 0,
                "inbox_read_by_io": self.inbox.read_by_io if self.inbox is not None else 0,
                **(self.rings.counts() if self.rings is not None else {})}

    def _on_peer_frames(self, address: str, frames) -> None:
        with self._core_lock:
            self._peer_frames(address, frames)

    def _on_data(self, frames) -> None:
        with self._core_lock:
            self._data_frames(frames)

    # ------------------------------------------------------------ compute thread

    def _submit(self, job: ComputeJob) -> None:
        # From the compute thread (a run it just read) the job is queued without a wake-up.
        self.compute.call_soon(lambda: self._run_job(job))

    def _run_job(self, job: ComputeJob) -> None:
        try:
            self.core.compute(job)
        except Exception as exc:  # a bug of ours: fail this job, keep the thread serving the rest
            log.exception("executor %s: compute failed outside the function", self.config.executor_id)
            self.core.fail(job, exc)
        # Finished here, before the next job (which may read its outputs): its Done leaves at
        # once on the control connection, which this thread owns.
        with self._core_lock:
            self.core.finish(job)

    def _compute_thread(self) -> None:
        name_os_thread()
        if self.config.backend != "sim":
            import torch

            torch.set_num_threads(self.config.num_threads)
        try:
            self.compute.run()
        finally:
            if self.rings is not None:
                self.rings.close()

    # ------------------------------------------------------------ liveness

    def _watch(self) -> None:
        """Heartbeats on a thread and a connection of their own.

        Neither a long computation (compute thread) nor a long compile or load
        (I/O thread) delays a ping or its answer, so neither looks like death:
        the controller answers each ping at once, and this thread exits the
        process when answers stop for the timeout, or the parent process is gone.
        """
        name_os_thread()
        socket = self._heartbeat_socket()
        interval, timeout = self.config.heartbeat_interval_s, self.config.heartbeat_timeout_s
        last_answer = next_ping = time.monotonic()
        answered = False
        while not self.loop.stopping:
            now = time.monotonic()
            if now >= next_ping:
                interval, timeout = self.core.heartbeat_timing(interval, timeout)
                if self.config.parent_pid and not is_alive(self.config.parent_pid):
                    self._exit(f"parent process {self.config.parent_pid} is gone", EXIT_CONTROLLER_GONE)
                # Until the controller first answers, it may still be starting (a launcher starts executors
                # on every node before the script on node 0 has made its controller): wait up to join_timeout_s.
                limit = timeout if answered else max(timeout, self.config.join_timeout_s)
                if now - last_answer > limit:
                    what = "no answer from the controller" if answered else \
                        f"the controller at {self.config.controller_address} never answered"
                    self._exit(f"{what} for {now - last_answer:.1f} s (timeout {limit:g} s)", EXIT_CONTROLLER_GONE)
                try:
                    socket.send(self.heartbeat(), zmq.NOBLOCK)
                    self._heartbeats_sent += 1
                except zmq.Again:
                    pass  # not connected yet; the silence check above still runs
                next_ping = now + interval
            if socket.poll(max(1, int((next_ping - time.monotonic()) * 1000))):
                last_answer, answered = time.monotonic(), True
                try:
                    self._on_heartbeat_answer(socket.recv_multipart())
                except Exception:   # a bug of ours in one answer must not end the heartbeats (we would be lost)
                    log.exception("executor %s: handling a heartbeat answer failed", self.config.executor_id)
        socket.close(linger=0)

    def _heartbeat_socket(self) -> zmq.Socket:
        return self._controller_connection(HEARTBEAT_SUFFIX)

    def _on_heartbeat_answer(self, frames) -> None:
        stop = self._heartbeat_answer(frames)
        if stop is not None:
            self._exit(stop)

    def _admit_key(self, role: str, public_key: bytes) -> None:
        """A replacement's fresh key: admitted from now on, the old incarnation's revoked (and its connections
        closed)."""
        self.gatekeeper.admit(role, public_key)
        self.credentials.allowed[role] = public_key
        # Every connection whose key is revoked now, not only the one this process listed for the role: one started
        # after an earlier replacement may have reached that incarnation under a key it lists as a spare's.
        self.outbox.close_peers_not_admitted(self.gatekeeper.admits)
        if self.rings is not None:
            self.compute.call_soon(lambda: self.rings.drop_not_admitted(self.gatekeeper.admits))

    def _exit(self, reason: str, code: int = EXIT_LOST) -> None:
        log.warning("executor %s exits: %s", self.config.executor_id, reason)
        os._exit(code)

    def _stop(self, reason: str) -> None:
        self._exit_reason = reason
        self.compute.stop()
        self.compiler.stop()
        self.loop.stop()

    # ------------------------------------------------------------ main

    def run(self) -> None:
        register = pb.Register(executor_id=self.config.executor_id, data_address=self.data_address,
                               device=self.backend.device, backend=self.backend.name, pid=os.getpid(),
                               store_bytes=self.core.store.bytes, public_key=self.credentials.keys.public,
                               command_address=self.command_address, island=self.config.island,
                               transfer_address=self.inbox.address if self.inbox is not None else "")
        self.compute.send(encode(pb.Envelope(register=register)))   # the first thing the thread does
        threading.Thread(target=self._compute_thread, name="pathways-compute", daemon=True).start()
        threading.Thread(target=self._watch, name="pathways-heartbeat", daemon=True).start()
        self.loop.run_forever()
        if self.outbox.direct is not None:
            self.outbox.direct.close_all()
        if self.inbox is not None:
            self.inbox.close()
        self.gatekeeper.stop()
        log.info("executor %s stopped: %s", self.config.executor_id, self._exit_reason)


def _no_reply(identity, envelope) -> None:
    """A ring copy is acknowledged by nothing: committed, it is in the receiver's memory."""


_TRANSFER_CHECK_S = 1.0   # how often unacknowledged transfers are checked against their deadlines

