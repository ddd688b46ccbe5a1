"""The controller's sockets: one CURVE ROUTER that every executor's DEALERs connect to, and
one DEALER per executor to the executor's command ROUTER.

Each executor opens two connections to the ROUTER: its control DEALER (identity =
executor id), on which it registers and reports (Done, replies), and a heartbeat
DEALER (identity = ``<id>#heartbeat``) driven by a thread of its own; each identity
ends in ``~<nonce>`` of the process, so a replacement never collides with a stopped
old incarnation's connections (`security.split_identity`). The server
answers each heartbeat at once, so neither side's view of the other's liveness
depends on how busy the other's message handling is.

Control messages to an executor leave on its command DEALER, from whichever thread
sends them (the client's thread dispatching a call, mostly), under a lock: a call
costs no wake-up of the controller's I/O thread on its way out. The I/O thread
owns the ROUTER alone and only reads from it (and answers heartbeats).

Every message must come over a connection authenticated as the executor it
names: the role of its CURVE key (`pathways_torch.wire.security`) must equal the
ROUTER identity, so an executor can speak only as itself.
"""

from __future__ import annotations

import collections
import logging
import threading

import zmq

from pathways_torch.wire import SocketLoop, body_name, decode, encode, pb
from pathways_torch.wire.framing import MAX_ENVELOPE_BYTES, FramingError, log_dropped
from pathways_torch.wire.loop import RECONNECT_BACKOFF_MAX_MS, frame_nbytes
from pathways_torch.wire.security import (CONTROLLER, is_client, HEARTBEAT_SUFFIX, STORE_SUFFIX, ConnectionWatch, Credentials,
                                          SecurityError, identity_nonce, make_client, make_server, peer_role,
                                          spare_of, split_identity)

from .config import ControllerConfig
from .dispatch import Controller

__all__ = ["ControllerServer"]

log = logging.getLogger(__name__)

_ROUTER = "executors"


class ControllerServer:
    """Runs a `Controller` behind a CURVE ROUTER on its own I/O thread.

    ``context`` must have a running `Gatekeeper` (the allow-list); without one the
    socket refuses every connection.
    """

    def __init__(self, config: ControllerConfig | None, credentials: Credentials, context: zmq.Context):
        self.config = config or ControllerConfig()
        self.credentials = credentials
        self.loop = SocketLoop("controller", context)
        socket = self.loop.context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Executors send the controller envelopes, never tensors: a bigger frame is hostile.
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_ENVELOPE_BYTES)
        if self.loop.context.get(zmq.IO_THREADS) >= 2:   # the first libzmq I/O thread: a service's clients get the other
            socket.setsockopt(zmq.AFFINITY, 0b01)
        make_server(socket, credentials)
        socket.bind(self.config.bind_address)
        self.address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.loop.add_socket(_ROUTER, socket, self._on_frames)
        self.connections = ConnectionWatch("controller")
        self.loop.monitor(_ROUTER, self.connections.on_frames)
        self.controller = Controller(self, self.config)
        self.loop.every(self.config.heartbeat_interval_s, self.controller.members.heartbeat)
        # Gets parked past the group timeout fail, and their groups' keys go (their executors gave up waiting).
        self.loop.every(1.0, self.controller.rendezvous.expire)
        self.dropped_messages = 0   # refused here; the Controller counts what it refuses itself
        # Messages that reached the heartbeat and store handlers, by connection (the Controller counts the control
        # connection's): bench/fuzz.py reports how many fuzzed ones got this far.
        self.handled_messages: collections.Counter = collections.Counter()
        self._commands: dict[str, zmq.Socket] = {}   # executor id → DEALER to its command ROUTER
        # executor id → the role of the key it registered with (its own, or a spare after a replacement)
        self._active_roles: dict[str, str] = {}
        # executor id → the process (identity nonce) its last accepted Register came from: that process's pings count
        # before its Welcome reaches it (a start-up of a thousand executors can take longer than the heartbeat bound)
        self._registered_process: dict[str, str] = {}
        self.on_key_revoked = None   # (public key) -> None: the client process's Gatekeeper refuses it (Context)
        # executor id → (the routing identity of its heartbeat connection, the faults its last ping said it knew):
        # a loss is told to the survivors on it at once, unasked (`_tell_faults`)
        self._pingers: dict[str, tuple[bytes, int]] = {}
        self._telling_faults = False
        self.controller.loss_listeners.append(self._on_loss)
        self._commands_lock = threading.Lock()       # the DEALERs are used from any thread, one at a time
        self._command_payload_bytes = 0
        self.command_bytes = 0     # every byte sent on the command connections (envelopes and payload)

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()
        with self._commands_lock:
            for socket in self._commands.values():
                socket.close(linger=0)
            self._commands.clear()

    def to_executor(self, executor_id, envelope, payload=()) -> None:
        """Send on the calling thread (any), in the order of the calls."""
        frames = encode(envelope, payload)
        if self.config.inject_latency_s > 0:   # tests and benchmarks only: equal delays keep the order
            self.loop.call_later(self.config.inject_latency_s, lambda: self._send_command(executor_id, frames))
        else:
            self._send_command(executor_id, frames)

    def _send_command(self, executor_id: str, frames: list) -> None:
        with self._commands_lock:
            socket = self._commands.get(executor_id)
            if socket is not None:
                self._command_payload_bytes += sum(frame_nbytes(f) for f in frames[1:])
                self.command_bytes += sum(frame_nbytes(f) for f in frames)
                socket.send_multipart(frames, copy=False)
                return
        log.warning("no command connection to %s; a %d-frame message dropped", executor_id, len(frames))
        # Whatever that message asked for will never happen: what depends on the executor fails, on the loop
        # thread in a later turn (call_later, not call_soon, which runs at once on the loop thread): the
        # caller may be inside a controller operation, holding its lock.
        self.loop.call_later(0.0, lambda: self.controller.members.declare_lost(
            executor_id, "the controller has no command connection to it (a message to it could not be sent)"))

    def _connect_commands(self, executor_id: str, register: pb.Register) -> bool:
        """Open the DEALER to a registering executor's command ROUTER (its key: the one it registered)."""
        if not register.command_address.startswith("tcp://"):
            self._drop(f"{executor_id} registered command address {register.command_address!r}, not a tcp:// one")
            return False
        socket = self.loop.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        # Nothing is dropped for a slow executor: the client's own pace bounds what waits.
        socket.setsockopt(zmq.SNDHWM, 0)
        # A lost executor's address is retried with back-off, not every 100 ms for good (a replacement registers
        # with an address of its own).
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_BACKOFF_MAX_MS)
        try:
            make_client(socket, self.credentials, register.public_key)
        except SecurityError as exc:
            socket.close()
            self._drop(f"{executor_id} registered an unusable key: {exc}")
            return False
        # Queued from now on, sent once the handshake is done: the Welcome may follow at once.
        socket.connect(register.command_address)
        with self._commands_lock:
            old = self._commands.pop(executor_id, None)
            if old is not None:   # registered again (restarted): the new process has a new address
                old.close(linger=0)
            self._commands[executor_id] = socket
        return True

    @property
    def refused_connections(self) -> int:
        """Connections that never completed the CURVE handshake (see `ConnectionWatch.refused`)."""
        return self.connections.refused

    def _on_frames(self, frames) -> None:
        try:
            identity = frames[0].bytes.decode()
            role = peer_role(frames[1])
            envelope, payload = decode(frames[1:])
        except (FramingError, UnicodeDecodeError, IndexError) as exc:
            self._drop(f"malformed message: {exc}")
            return
        executor_id, connection = split_identity(identity)
        if executor_id != (spare_of(role or "") or role) or role == CONTROLLER or is_client(role):
            self._drop(f"a peer authenticated as {role!r} spoke as {identity!r}")
            return
        active = self._active_roles.get(executor_id)
        if active is not None and role != active and body_name(envelope) != "register":
            self._drop(f"{executor_id} spoke with the key of {role!r}, which a replacement's key ({active!r}) "
                       f"revoked")
            return
        if connection == HEARTBEAT_SUFFIX:
            self._on_heartbeat(frames[0], executor_id, envelope)
            return
        if connection == STORE_SUFFIX:
            self._on_store(frames[0], executor_id, envelope)
            return
        if body_name(envelope) == "register":
            if envelope.register.public_key != self.credentials.allowed.get(role):
                self._drop(f"{executor_id} registered a data-socket key that is not its own")
                return
            # A spare key is held by the executor's own node alone: its launcher restarted it (no rival claim).
            claim = None if spare_of(role) else self.controller.members.rival_claim(executor_id, envelope.register)
            if claim is not None:
                log.error("controller: %s", claim)
                self._drop(claim)
                return
            if not self._connect_commands(executor_id, envelope.register):
                return
            previous = self._active_roles.get(executor_id)
            self._active_roles[executor_id] = role
            self._registered_process[executor_id] = identity_nonce(identity)
            self.controller.on_message(executor_id, envelope, payload)
            if previous is not None and previous != role:
                self._revoke_replaced(executor_id, previous, role)
            return
        self.controller.on_message(executor_id, envelope, payload)

    def _revoke_replaced(self, executor_id: str, old_role: str, new_role: str) -> None:
        """A replacement registered with a spare key (started by pathways-run on its node): the key it replaces
        is refused from now on, here and on every executor."""
        old_key, new_key = self.credentials.allowed.get(old_role), self.credentials.allowed[new_role]
        log.warning("controller: %s now uses the key of %s; the key of %s is revoked", executor_id, new_role,
                    old_role)
        if old_key is not None and self.on_key_revoked is not None:
            self.on_key_revoked(old_key)
        self.controller.members.admit_key(executor_id, new_key)

    def _on_store(self, identity_frame, executor_id: str, envelope: pb.Envelope) -> None:
        """A rendezvous store request: answered on this thread, now or when the key it waits for is set."""
        if body_name(envelope) != "store_request":
            self._drop(f"{body_name(envelope)!r} on {executor_id}'s store connection")
            return
        self.handled_messages["store"] += 1
        identity = identity_frame.bytes

        def send(answer: pb.StoreReply) -> None:
            try:
                self.loop.send_now(_ROUTER, [identity, pb.Envelope(store_reply=answer).SerializeToString()])
            except zmq.ZMQError as exc:   # the executor went away while it waited: nothing to answer
                self._drop(f"store reply to {executor_id} undeliverable: {exc}")

        def reply(answer: pb.StoreReply) -> None:
            # A parked get may be answered from another thread (a member lost, groups forgotten): the socket is
            # the I/O thread's alone. On that thread call_soon runs at once.
            self.loop.call_soon(lambda: send(answer))

        self.controller.rendezvous.handle(executor_id, envelope.store_request, reply)

    def _on_heartbeat(self, identity_frame, executor_id: str, envelope: pb.Envelope) -> None:
        """Answer at once: the echo keeps the executor running, a Shutdown tells a lost one to stop."""
        if body_name(envelope) != "heartbeat":
            self._drop(f"{body_name(envelope)!r} on {executor_id}'s heartbeat connection")
            return
        self.handled_messages["heartbeat"] += 1
        epoch = envelope.heartbeat.epoch or envelope.epoch
        # Before its Welcome (epoch 0), only the process whose Register was accepted keeps its executor alive; a
        # new process pinging under the same id must not keep a dead incarnation alive.
        awaiting_welcome = False
        if not epoch:   # the identity is parsed only before a Welcome, not on every ping
            nonce = identity_nonce(identity_frame.bytes.decode())
            awaiting_welcome = nonce != "" and self._registered_process.get(executor_id) == nonce
        state, lost_peers, faults = self.controller.members.heard_from(
            executor_id, epoch, awaiting_welcome=awaiting_welcome, told=envelope.heartbeat.lost_peers_told)
        if state == "unknown":
            return  # its Register is still on the way; an executor never registered times out by itself
        if state == "lost":
            envelope = pb.Envelope(shutdown=pb.Shutdown(reason=f"the controller declared {executor_id} lost"))
        elif state == "stale":
            envelope = pb.Envelope(shutdown=pb.Shutdown(
                reason=f"this process is incarnation {envelope.heartbeat.epoch} of {executor_id}, which was declared "
                       f"lost and replaced: it may not rejoin"))
        else:
            self._pingers[executor_id] = (identity_frame.bytes, faults)
            self._fill_answer(envelope.heartbeat, lost_peers, faults)
        self.loop.send_now(_ROUTER, [identity_frame.bytes, envelope.SerializeToString()])

    def _fill_answer(self, heartbeat: pb.Heartbeat, lost_peers: list[str], faults: int) -> None:
        """What a heartbeat answer tells: the island's faults not yet told, their count, and the interval to ping at."""
        heartbeat.lost_peers[:] = lost_peers
        heartbeat.lost_peers_told = faults
        heartbeat.interval_s = self.controller.members.asked_heartbeat_interval_s()

    def _on_loss(self, executor_id: str, error) -> None:
        """An executor was lost (any thread, under the controller's lock): its island's survivors hear of it on their
        heartbeat connections in the loop's next turn, not at their next ping, which may be seconds away where many
        executors ping seldom (`ControllerConfig.max_heartbeats_per_s`); one pass for a storm of losses."""
        self._pingers.pop(executor_id, None)
        if not self._telling_faults:
            self._telling_faults = True
            self.loop.call_later(0.0, self._tell_faults)

    def _tell_faults(self) -> None:
        """Send each live executor the faults of its island it has not said it knows, as a heartbeat answer."""
        self._telling_faults = False
        for executor_id, (identity, told) in list(self._pingers.items()):
            faults = self.controller.members.island_faults(executor_id, told)
            if faults is None or not faults[0]:
                continue
            answer = pb.Heartbeat()
            self._fill_answer(answer, *faults)
            self._pingers[executor_id] = (identity, faults[1])
            try:
                self.loop.send_now(_ROUTER, [identity, pb.Envelope(heartbeat=answer).SerializeToString()])
            except zmq.ZMQError as exc:
                self._drop(f"faults to {executor_id} undeliverable: {exc}")

    def admit(self, role: str, public_key: bytes) -> None:
        """Accept ``public_key`` as ``role``'s registered key from now on (a replacement's fresh key)."""
        self.credentials.allowed[role] = public_key

    def _drop(self, why: str) -> None:
        self.dropped_messages += 1
        log_dropped(log, self.dropped_messages, "controller socket", why)

    @property
    def payload_bytes(self) -> dict[str, int]:
        """Tensor bytes this process's controller sockets carried (program constants only, by design)."""
        return {"sent": self._command_payload_bytes, "received": self.loop.payload_bytes_in[_ROUTER]}
