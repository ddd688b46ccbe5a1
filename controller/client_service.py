"""The controller as a service: remote clients on a CURVE ROUTER (`pathways-controller`, docs/service.md).

Each client connects a DEALER with its own key (role ``client-<name>``, `pathways_torch.launch.service_keys`); its
name is its identity, and what it may name is scoped to what it owns (`ClientOps`). A message is a `seam_codec`
message: a request ``{"r": id, "op": name, "a": [args]}`` (``r`` 0: no answer wanted), answered with
``{"r": id, "ok": value}`` or ``{"r": id, "err": error}``; the service also sends events, ``{"ev": kind, ...}``:
an array settled, an executor lost or replaced, a key revoked.

Requests arrive on the controller's I/O thread and run on a worker thread of the client's own, in order: a call
may wait at the run-ahead bound, and a gather waits for the executors' answers, which arrive on the I/O thread.
A ping is answered on the I/O thread at once, so a client's view of the controller's liveness never depends on how
busy its worker is. A client silent for ``heartbeat_timeout_s`` (killed, cut off) is disconnected: every array it
holds is freed.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable

import zmq

from pathways_torch.wire import pb, seam_codec
from pathways_torch.wire.framing import log_dropped
from pathways_torch.wire.seam import ArraySettled, CallSpec, ProgramSpec
from pathways_torch.wire.security import ConnectionWatch, client_name, make_server, peer_role

from .client_ops import ClientOps, executor_view

__all__ = ["ClientService", "CLIENT_SOCKET"]

log = logging.getLogger(__name__)

CLIENT_SOCKET = "clients"
_MAX_MESSAGE_BYTES = 1 << 30     # graph constants ride on register_function; tensors never come this way
_ACK_EVERY = 32                   # requests served between acknowledgements (and whenever the queue runs dry)
_OUTPUT_IDS = {"call": 1, "run_program": 2}   # where a call's output ids are among its arguments
_IDS = (list, tuple)
# op → the types of its positional arguments (checked before anything runs: a client sends plain data only)
_SIGNATURES: dict[str, tuple] = {
    "register_function": (str, pb.Graph, list, (int, float)), "register_program": (ProgramSpec,),
    "describe_program": (int,), "forget_programs": ((list, tuple),), "call": (CallSpec, _IDS),
    "run_program": (int, _IDS, (*_IDS, type(None))),
    "grant_ids": (int,),
    "new_array": ((list, tuple), int, int), "landed": (int, (BaseException, type(None))), "release": (int,),
    "release_many": ((list, tuple),), "flush_frees": (), "allocate_mesh": (dict, (list, tuple, type(None))),
    "island_of": (str,), "executors": (), "executor": (str,), "wait_for_executors": (int, (int, float)),
    "gather": (str,), "counters": (), "runahead_waits": (), "note_runahead_wait": (int, int, int, str),
    "replace_executor": (str, (int, float)), "bye": (),
}


@dataclasses.dataclass
class _Session:
    """One connected client: its identity on the ROUTER, what it owns, and the worker running its requests."""

    name: str
    identity: bytes
    ops: ClientOps
    last_heard: float
    requests: collections.deque = dataclasses.field(default_factory=collections.deque)
    wake: threading.Condition = dataclasses.field(default_factory=threading.Condition)
    connected: bool = True
    requests_served: int = 0


class ClientService:
    """Serves remote clients of ``server`` (a `ControllerServer`, not yet started) on ``bind_address``."""

    def __init__(self, server, bind_address: str, *, heartbeat_timeout_s: float, weights: dict | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.server, self.controller, self.loop = server, server.controller, server.loop
        self.heartbeat_timeout_s, self.clock = heartbeat_timeout_s, clock
        socket = self.loop.context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        socket.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE_BYTES)
        make_server(socket, server.credentials)
        socket.bind(bind_address)
        self.address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.loop.add_socket(CLIENT_SOCKET, socket, self._on_frames)
        self.connections = ConnectionWatch("client socket")   # handshakes refused: keys not on the allow-list
        self.loop.monitor(CLIENT_SOCKET, self.connections.on_frames)
        self.sessions: dict[str, _Session] = {}     # client name → its session (connected ones)
        # Connections of disconnected clients: heard no more (a new process with the same key may connect again).
        self._gone: collections.deque = collections.deque(maxlen=1024)
        self._lock = threading.Lock()
        self.dropped_messages = 0
        self.refused_messages = 0         # messages from a key that is not a client's (an executor's, say)
        self.disconnected: collections.Counter = collections.Counter()   # why → how many
        self.replacer = None   # (executor id, timeout s) -> ExecutorView: the host replaces executors it started
        self._replacing = threading.Lock()
        self._error_names = seam_codec.ErrorNames()   # one failure reaching many arrays stays one error there
        # client name → its share of device time, set by the operator (a client not named: 1)
        self.weights: dict[str, float] = dict(weights or {})
        self.admission = self.controller.admission
        self.admission.enabled = True   # calls are admitted island by island, at the clients' proportional shares
        self.controller.loss_listeners.append(self._executor_lost)
        self.controller.incarnation_listeners.append(self._new_incarnation)
        server.on_key_revoked = self._key_revoked
        self.loop.every(max(0.05, heartbeat_timeout_s / 4), self._check_silent)

    # ------------------------------------------------------------ the I/O thread

    def _on_frames(self, frames) -> None:
        identity = frames[0].bytes
        role = peer_role(frames[1]) if len(frames) > 1 else None
        name = client_name(role)
        if name is None:
            self.refused_messages += 1
            self._drop(f"a message on the client socket from {role!r}, which is not a client's key")
            return
        try:
            message = seam_codec.decode(frames[1:])
            request_id, op, args = message["r"], message["op"], list(message.get("a", []))
        except (seam_codec.SeamCodecError, KeyError, TypeError) as exc:
            self._drop(f"a malformed request from client {name}: {exc}")
            return
        if identity in self._gone:
            self._drop(f"a message from client {name}'s connection, which was disconnected")
            return
        session = self._session(name, identity)
        session.last_heard = self.clock()
        if op == "ping":
            self._send(session, {"r": request_id, "ok": None})
            return
        with session.wake:
            session.requests.append((request_id, op, args))
            session.wake.notify()

    def _session(self, name: str, identity: bytes) -> _Session:
        with self._lock:
            session = self.sessions.get(name)
            if session is not None and session.identity != identity:
                # The same key from a new connection: the old process is gone (or this is a second one; the key is
                # the identity, so they cannot both be the client). What the old one held is freed.
                self._disconnect_locked(session, "it connected again from a new process")
                session = None
            if session is None:
                session = _Session(name, identity, ClientOps(self.controller, self.server, owner=name), self.clock())
                self.sessions[name] = session
                self.admission.add_client(name, self.weights.get(name, 1.0))
                threading.Thread(target=self._serve, args=(session,), name=f"pathways-client-{name}",
                                 daemon=True).start()
                log.info("controller: client %s connected", name)
            return session

    def _check_silent(self) -> None:
        now = self.clock()
        with self._lock:
            for session in list(self.sessions.values()):
                if now - session.last_heard > self.heartbeat_timeout_s:
                    self._disconnect_locked(session, f"silent for {now - session.last_heard:.1f} s (more than the "
                                                     f"heartbeat timeout, {self.heartbeat_timeout_s:g} s)")

    # ------------------------------------------------------------ a client's worker

    def _serve(self, session: _Session) -> None:
        while True:
            with session.wake:
                session.wake.wait_for(lambda: session.requests or not session.connected)
                if not session.connected:
                    return
                request_id, op, args = session.requests.popleft()
            try:
                result = self._handle(session, op, args, answered=bool(request_id))
                answer = {"r": request_id, "ok": result}
            except BaseException as exc:   # the client's error: it raises it, the service goes on
                answer = {"r": request_id, "err": exc}
                if not request_id and op in _OUTPUT_IDS:   # a call not waited for: its outputs fail with it
                    self._fail_outputs(session, args[_OUTPUT_IDS[op]], exc)
            session.requests_served += 1
            if request_id:
                self._send(session, answer)
            if not session.requests or session.requests_served % _ACK_EVERY == 0:
                # The client sends calls without waiting for them: it waits only when this many are unread here.
                self._send(session, {"ev": "ack", "n": session.requests_served})
            if op == "bye":
                self.disconnect(session.name, "it closed its context", tell=False)
                return

    def _handle(self, session: _Session, op: str, args: list, answered: bool = True):
        signature = _SIGNATURES.get(op)
        if signature is None or len(args) != len(signature) or not all(
                isinstance(a, t) for a, t in zip(args, signature)):
            raise TypeError(f"request {op!r} with {[type(a).__name__ for a in args]}: expected one of "
                            f"{sorted(_SIGNATURES)} with arguments of {signature}")
        ops = session.ops
        if op == "bye":
            return None
        if op == "call":
            return self._followed(session, ops.call(args[0], args[1]), answered)
        if op == "run_program":
            return self._followed(session, ops.run_program(args[0], args[1], args[2]), answered)
        if op == "new_array":
            return self._followed(session, [ops.new_array(tuple(args[0]), landing=args[1], shard_bytes=args[2])],
                                  answered)[0]
        if op == "replace_executor":
            return self._replace(args[0], float(args[1]))
        if op == "register_function":
            return ops.register_function(args[0], args[1], args[2], sim_seconds=float(args[3]))
        return getattr(ops, op)(*args)

    def _followed(self, session: _Session, records, answered: bool) -> tuple:
        """Each record's state now, and its changes from now on as events (attached under the controller's lock,
        where every change happens: none is missed between the two). A call not waited for (``answered``
        False) gets its state now as an event too, if it is no longer pending."""
        with self.controller._lock:
            snapshots = []
            for record in records:
                record.listener = self._settle_listener(session)
                snapshots.append(_settled(record))
                if not answered and (record.state != "pending" or record.lost_holders):
                    self._send(session, {"ev": "settled", "s": snapshots[-1]})
            return tuple(snapshots)

    def _fail_outputs(self, session: _Session, output_ids, error: BaseException) -> None:
        if isinstance(output_ids, (list, tuple)):
            session.ops.never_made(output_ids, error)
        for array_id in output_ids if isinstance(output_ids, (list, tuple)) else ():
            if isinstance(array_id, int):
                self._send(session, {"ev": "settled", "s": ArraySettled(array_id, "failed", error)})

    def _settle_listener(self, session: _Session):
        def changed(record) -> None:
            if session.connected:
                self._send(session, {"ev": "settled", "s": _settled(record)})
        return changed

    def _replace(self, executor_id: str, timeout_s: float):
        """A client's recovery asks for a lost executor's replacement: made once (the first asker's), awaited by
        every other; the executor's view once it registered. ``replacer``: the host's (it started the executors),
        else an incarnation someone else starts (the operator, a node's launcher) is awaited."""
        info = self.controller.resources.executors.get(executor_id)
        if info is None:
            raise ValueError(f"replace_executor: expected one of {sorted(self.controller.resources.executors)}, got "
                             f"{executor_id!r}")
        with self._replacing:
            info = self.controller.resources.executors[executor_id]
            if not info.lost:   # replaced already, for another client
                return executor_view(self.controller, info)
            if info.draining:
                raise ValueError(f"replace_executor: {executor_id} was removed by the operator; use a mesh without it")
            if self.replacer is not None:
                return self.replacer(executor_id, timeout_s)
            return executor_view(self.controller,
                                 self.controller.wait_for_incarnation(executor_id, info.epoch + 1, timeout_s))

    # ------------------------------------------------------------ events to every client

    def _executor_lost(self, executor_id: str, error: BaseException) -> None:
        self._broadcast({"ev": "lost", "executor": executor_id, "error": error})

    def _new_incarnation(self, info) -> None:
        self._broadcast({"ev": "incarnation", "view": executor_view(self.controller, info)})

    def _key_revoked(self, public_key: bytes) -> None:
        self._broadcast({"ev": "revoked", "key": public_key})

    def _broadcast(self, message: dict) -> None:
        with self._lock:
            sessions = list(self.sessions.values())
        for session in sessions:
            self._send(session, message)

    # ------------------------------------------------------------ sending, disconnecting

    def _send(self, session: _Session, message: dict) -> None:
        try:
            frames = seam_codec.encode(message, self._error_names)
        except seam_codec.SeamCodecError as exc:   # a result the seam cannot carry: the client gets why
            frames = seam_codec.encode({"r": message.get("r", 0), "err": TypeError(str(exc))})
        self.loop.send(CLIENT_SOCKET, [session.identity, *frames])

    def disconnect(self, name: str, why: str, *, tell: bool = True) -> bool:
        """Drop client ``name``: its queued requests, and every array it holds (freed on the executors); ``tell``:
        say so to the client (its pending arrays fail with `ControllerLostError` there)."""
        with self._lock:
            session = self.sessions.get(name)
            if session is None:
                return False
            self._disconnect_locked(session, why, tell=tell)
            return True

    def _disconnect_locked(self, session: _Session, why: str, *, tell: bool = True) -> None:
        if self.sessions.get(session.name) is session:
            del self.sessions[session.name]
        if tell:   # it fails what it waits for at once (ControllerLostError), and its connection speaks no more
            self._send(session, {"ev": "disconnected", "why": why})
        self._gone.append(session.identity)
        with session.wake:
            session.connected = False
            dropped = len(session.requests)
            session.requests.clear()
            session.wake.notify_all()
        self.admission.remove_client(session.name)   # its calls waiting for their turn are dropped
        freed = session.ops.release_everything()
        session.ops.forget_everything()
        self.disconnected[why.split(" (")[0]] += 1
        log.warning("controller: client %s disconnected: %s; %d queued request(s) dropped, %d array(s) freed",
                    session.name, why, dropped, freed)

    def close(self, why: str = "the controller stopped") -> None:
        """Tell every client the controller stops (each fails what it waits for with `ControllerLostError` at
        once), then disconnect them. The caller lets the I/O thread run a moment after, to send the news."""
        self._broadcast({"ev": "stopping", "why": why})
        with self._lock:
            for session in list(self.sessions.values()):
                self._disconnect_locked(session, why)

    @property
    def refused_clients(self) -> int:
        """Connections refused at the handshake (a key not on the allow-list) and messages from keys that are no
        client's."""
        return self.connections.refused + self.refused_messages

    def _drop(self, why: str) -> None:
        self.dropped_messages += 1
        log_dropped(log, self.dropped_messages, "client socket", why)


def _settled(record) -> ArraySettled:
    return ArraySettled(record.array_id, record.state, record.error, record.block_shape,
                        tuple(record.lost_holders), record.put_token)
