"""The controller as a service: remote clients on a CURVE ROUTER (`pathways-controller`, docs/service.md).

Each client connects a DEALER with its own key (role ``client-<name>``, `pathways_torch.launch.service_keys`); its
name is its identity, and what it may name is scoped to what it owns (`ClientOps`). A message is a `seam_codec`
message: a request ``{"r": id, "op": name, "a": [args]}`` (``r`` 0: no answer wanted), answered with
``{"r": id, "ok": value}`` or ``{"r": id, "err": error}``; the service also sends events, ``{"ev": kind, ...}``:
an array settled, an executor lost or replaced, a key revoked.

The client socket has an I/O thread of its own (``self.loop``), apart from the one that answers executors'
heartbeats and reads their Dones (`ControllerServer.loop`): no client's traffic can delay those. That thread only
measures a message, refuses one over ``max_client_message_bytes``, answers a ping, and queues the raw frames in the
client's bounded `RequestQueue` (`client_inbox`); the client's own worker thread decodes and runs them, in order (a
call may wait at the run-ahead bound, and a gather waits for the executors' answers). A client silent for
``heartbeat_timeout_s`` (killed, cut off) is disconnected: its worker is stopped first, then every array it holds
is freed.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Callable

import zmq

from pathways_torch.wire import SocketLoop, seam_codec
from pathways_torch.wire.checkpoint_paths import DEFAULT_CHECKPOINT_ROOT, client_root
from pathways_torch.wire.framing import log_dropped
from pathways_torch.wire.limits import Bounds, bounded
from pathways_torch.wire.seam import OPS, ArraySettled, Bye, Call, op_from_wire
from pathways_torch.wire.security import ConnectionWatch, client_name, make_server, peer_role

from .client_inbox import QueueFull, RefusalPace, RequestQueue, is_ping, message_bytes, peek_request_id
from .client_ops import ClientOps, executor_view, settled
from .config import ServiceConfig

__all__ = ["ClientService", "CLIENT_SOCKET"]

log = logging.getLogger(__name__)

CLIENT_SOCKET = "clients"
# A message this many times the cap is cut off by libzmq itself (the connection dropped, nothing allocated); up to
# it, the client is told why its message was refused.
_HARD_LIMIT_FACTOR = 4
# A worker still inside a request this long after its client left: what the client held is freed anyway (anything
# that request adds afterwards is freed as it is added: `ClientOps` is closed by then).
_FREE_AFTER_S = 1.0
_READS_PER_TURN = 4
REPLACE_TIMEOUT_S = Bounds(0.001, 600.0)   # a client's wait for an executor's replacement
_ACK_EVERY = 32                   # requests served between acknowledgements (and whenever the queue runs dry)


@dataclasses.dataclass
class _Session:
    """One connected client: its identity on the ROUTER, what it owns, and the worker running its requests."""

    name: str
    identity: bytes
    ops: ClientOps
    last_heard: float
    requests: RequestQueue
    connected: bool = True
    requests_served: int = 0
    freed: bool = False     # what it held is freed (once: by its worker as it stops, or after _FREE_AFTER_S)
    worker: threading.Thread | None = None
    refusals: RefusalPace = dataclasses.field(default_factory=RefusalPace)


class ClientService:
    """Serves remote clients of ``server`` (a `ControllerServer`, not yet started) on ``bind_address``, on an I/O
    thread of its own (`start`)."""

    def __init__(self, server, bind_address: str, *, heartbeat_timeout_s: float, weights: dict | None = None,
                 config: ServiceConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.server, self.controller = server, server.controller
        self.config = config or ServiceConfig()
        self.loop = SocketLoop("clients", server.loop.context)
        self.heartbeat_timeout_s, self.clock = heartbeat_timeout_s, clock
        socket = self.loop.context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        socket.setsockopt(zmq.MAXMSGSIZE, _HARD_LIMIT_FACTOR * self.config.max_client_message_bytes)
        if self.loop.context.get(zmq.IO_THREADS) >= 2:   # libzmq's second I/O thread: not the executors' (bit 0)
            socket.setsockopt(zmq.AFFINITY, 0b10)
        make_server(socket, server.credentials)
        socket.bind(bind_address)
        self.address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        # A few messages per turn: one tenant's flood delays the answers to the others by a few of its messages.
        self.loop.add_socket(CLIENT_SOCKET, socket, self._on_frames, batch=_READS_PER_TURN)
        self.connections = ConnectionWatch("client socket")   # handshakes refused: keys not on the allow-list
        self.loop.monitor(CLIENT_SOCKET, self.connections.on_frames)
        self.sessions: dict[str, _Session] = {}     # client name → its session (connected ones)
        # Connections of disconnected clients: heard no more (a new process with the same key may connect again).
        self._gone = _RecentSet(1024)
        self._lock = threading.Lock()
        self.dropped_messages = 0
        self.refused_messages = 0         # messages from a key that is not a client's (an executor's, say)
        self.oversized_messages = 0       # refused for their size (--max-client-message-bytes)
        self.disconnected: collections.Counter = collections.Counter()   # why → how many
        self.replacer = None   # (executor id, timeout s) -> ExecutorView: the host replaces executors it started
        self._replacing = threading.Lock()
        self._replacements: dict[str, concurrent.futures.Future] = {}   # executor id → its replacement under way
        self._error_names = seam_codec.ErrorNames()   # one failure reaching many arrays stays one error there
        # client name → its share of device time, set by the operator (a client not named: 1)
        self.weights: dict[str, float] = dict(weights or {})
        self.refusals: collections.Counter = collections.Counter()   # (op, error type) → requests that raised it
        self.admission = self.controller.admission
        # calls are admitted island by island, at the clients' proportional shares, waiting a bounded time
        self.admission.enable(self.config.admission_timeout_s)
        self.controller.loss_listeners.append(self._executor_lost)
        self.controller.incarnation_listeners.append(self._new_incarnation)
        server.on_key_revoked = self._key_revoked
        self.loop.every(max(0.05, heartbeat_timeout_s / 4), self._check_silent)

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()

    # ------------------------------------------------------------ the client socket's I/O thread

    def _on_frames(self, frames) -> None:
        """Measure, answer a ping, queue: nothing here decodes or runs a client's request (module docstring)."""
        identity, body = frames[0].bytes, frames[1:]
        if identity in self._gone:   # the rest of a flood that got its sender cut off: counted, nothing more
            self.dropped_messages += 1
            return
        role = peer_role(frames[1]) if len(frames) > 1 else None
        name = client_name(role)
        if name is None:
            self.refused_messages += 1
            self._drop(f"a message on the client socket from {role!r}, which is not a client's key")
            return
        if not body:
            self._drop(f"an empty message from client {name}")
            return
        session = self._session(name, identity)
        session.last_heard = self.clock()
        nbytes = message_bytes(body)
        if nbytes > self.config.max_client_message_bytes:
            self._refuse_oversized(session, body, nbytes)
            return
        if is_ping(body):
            self._send(session, {"r": peek_request_id(body[0].buffer), "ok": None})
            return
        try:
            session.requests.put(body, nbytes)
        except QueueFull as exc:
            self._end(session, f"it sent faster than it is served: {exc}")

    def _refuse_oversized(self, session: _Session, body, nbytes: int) -> None:
        self.oversized_messages += 1
        limit = self.config.max_client_message_bytes
        why = (f"a message of {nbytes} bytes: expected at most {limit} (the controller's --max-client-message-bytes; "
               f"graph constants ride on register_function: pass large tensors as inputs instead)")
        self._drop(f"client {session.name} sent {why}")
        request_id = peek_request_id(body[0].buffer)
        self._send(session, {"r": request_id, "err": ValueError(why)} if request_id else {"ev": "refused", "why": why})

    def _session(self, name: str, identity: bytes) -> _Session:
        with self._lock:
            session = self.sessions.get(name)
            if session is not None and session.identity != identity:
                # The same key from a new connection: the old process is gone (or this is a second one; the key is
                # the identity, so they cannot both be the client). What the old one held is freed.
                self._disconnect_locked(session, "it connected again from a new process")
                session = None
            if session is None:
                ops = ClientOps(self.controller, self.server, owner=name, limits=self.config, replace=self._replace,
                                checkpoint_root=client_root(self.config.checkpoint_root or DEFAULT_CHECKPOINT_ROOT,
                                                            name))
                session = _Session(name, identity, ops, self.clock(),
                                   RequestQueue(self.config.max_queued_requests, self.config.max_queued_bytes))
                self.sessions[name] = session
                self.admission.add_client(name, self.weights.get(name, 1.0))
                session.worker = threading.Thread(target=self._serve, args=(session,), name=f"pathways-client-{name}",
                                                  daemon=True)
                session.worker.start()
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
        try:
            while session.connected:
                frames = session.requests.take()
                if frames is None:
                    return
                self._serve_one(session, frames)
        finally:   # stopped: now what it held goes (nothing it runs can add more)
            self._free(session)

    def _serve_one(self, session: _Session, frames) -> None:
        try:
            message = seam_codec.decode(frames)
            request_id, op, args = message["r"], message["op"], list(message.get("a", []))
            if not isinstance(request_id, int) or not isinstance(op, str):
                raise TypeError(f"expected an int request id and an op name, got {request_id!r} and {op!r}")
        except (seam_codec.SeamCodecError, KeyError, TypeError, AttributeError) as exc:
            self._drop(f"a malformed request from client {session.name}: {exc}")
            request_id = peek_request_id(frames[0].buffer if hasattr(frames[0], "buffer") else frames[0])
            if request_id:
                self._send(session, {"r": request_id, "err": ValueError(f"a malformed request: {exc}")})
            session.refusals.pace()
            return
        try:
            result = self._handle(session, op, args, answered=bool(request_id))
            answer = {"r": request_id, "ok": result}
        except BaseException as exc:   # the client's error: it raises it, the service goes on
            answer = {"r": request_id, "err": exc}
            self._refused(session, op, exc)
            session.refusals.pace()
            at = getattr(OPS.get(op) if isinstance(op, str) else None, "OUTPUT_IDS_AT", None)
            if not request_id and at is not None and len(args) > at:
                self._fail_outputs(session, args[at], exc)   # a call not waited for fails its outputs
        session.requests_served += 1
        if request_id:
            self._send(session, answer)
        if session.requests.empty or session.requests_served % _ACK_EVERY == 0:
            # The client sends calls without waiting for them: it waits only when this many are unread here.
            self._send(session, {"ev": "ack", "n": session.requests_served})
        if op == Bye.NAME and "ok" in answer:   # a bye refused (bad arguments) ends nothing: its client is told why
            self._end(session, "it closed its context", tell=False)

    def _handle(self, session: _Session, name: str, args: list, answered: bool = True):
        op = op_from_wire(name, args)   # checked: a client sends plain data only
        if type(op) is Call and op.output_ids is None:   # the embedded client's form: a remote one names its outputs
            raise TypeError("request 'call': argument 'output_ids' must be list or tuple (the next ids this client "
                            "was granted: grant_ids), got None")
        result = session.ops.handle(op)
        return self._followed(session, result, answered) if op.MAKES_ARRAYS else result

    def _followed(self, session: _Session, records, answered: bool) -> tuple:
        """Each record's state now, and its changes from now on as events (attached under the controller's lock,
        where every change happens: none is missed between the two). A call not waited for (``answered``
        False) gets its state now as an event too, if it is no longer pending."""
        listener = self._settle_listener(session)

        def now(snapshot) -> None:   # under the lock: before any change's event
            if not answered and (snapshot.state != "pending" or snapshot.lost_holders):
                self._send(session, {"ev": "settled", "s": snapshot})
        return tuple(session.ops.follow(records, lambda record: listener, now))

    def _fail_outputs(self, session: _Session, output_ids, error: BaseException) -> None:
        if isinstance(output_ids, (list, tuple)):
            session.ops.never_made(output_ids, error)
        for array_id in output_ids if isinstance(output_ids, (list, tuple)) else ():
            if isinstance(array_id, int):
                self._send(session, {"ev": "settled", "s": ArraySettled(array_id, "failed", error)})

    def _settle_listener(self, session: _Session):
        def changed(record) -> None:
            if session.connected:
                self._send(session, {"ev": "settled", "s": settled(record)})
        return changed

    def _replace(self, executor_id: str, timeout_s: float):
        """A client's recovery asks for a lost executor's replacement: made once (the first asker's, on its worker),
        awaited by every other for at most its own ``timeout_s``, holding no lock meanwhile; the executor's view
        once it registered. ``replacer``: the host's (it started the executors), else an incarnation someone else
        starts (the operator, a node's launcher) is awaited."""
        timeout_s = bounded(timeout_s, "replace_executor: timeout_s", REPLACE_TIMEOUT_S)
        with self._replacing:
            info = self.controller.resources.executors.get(executor_id)
            if info is None:
                raise ValueError(f"replace_executor: expected one of {sorted(self.controller.resources.executors)}, "
                                 f"got {executor_id!r}")
            if not info.lost:   # replaced already, for another client
                return executor_view(self.controller, info)
            if info.draining:
                raise ValueError(f"replace_executor: {executor_id} was removed by the operator; use a mesh without it")
            pending = self._replacements.get(executor_id)
            making = pending is None
            if making:
                pending = self._replacements[executor_id] = concurrent.futures.Future()
        if making:
            self._make_replacement(executor_id, info.epoch, timeout_s, pending)
        try:
            return pending.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"replace_executor: {executor_id} was not replaced within {timeout_s:g} s (another "
                               f"client's request is making it); ask again, or use a mesh without it") from None

    def _make_replacement(self, executor_id: str, epoch: int, timeout_s: float, pending) -> None:
        try:
            if self.replacer is not None:
                pending.set_result(self.replacer(executor_id, timeout_s))
            else:
                info = self.controller.members.wait_for_incarnation(executor_id, epoch + 1, timeout_s)
                pending.set_result(executor_view(self.controller, info))
        except BaseException as exc:   # every asker gets the maker's failure
            pending.set_exception(exc)
        finally:
            with self._replacing:
                self._replacements.pop(executor_id, None)

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

    def _end(self, session: _Session, why: str, *, tell: bool = True) -> None:
        """Disconnect this session, not whichever has its client's name now: a bye its old worker was running must
        not end the session of the client's new process (bench/fuzz_service.py found that)."""
        with self._lock:
            if self.sessions.get(session.name) is session:
                self._disconnect_locked(session, why, tell=tell)

    def _disconnect_locked(self, session: _Session, why: str, *, tell: bool = True) -> None:
        """Its worker is stopped first (nothing queued runs; a call waiting for its turn fails), then what it held
        is freed: by the worker as it stops, or after `_FREE_AFTER_S` if it is still inside a request then."""
        if self.sessions.get(session.name) is session:
            del self.sessions[session.name]
        if tell:   # it fails what it waits for at once (ControllerLostError), and its connection speaks no more
            self._send(session, {"ev": "disconnected", "why": why})
        self._gone.add(session.identity)
        session.connected = False
        dropped = session.requests.close()
        self.admission.remove_client(session.name)   # its calls waiting for their turn are dropped
        session.ops.stop_waiting()                    # and those waiting for executor memory
        if session.worker is not threading.current_thread():
            timer = threading.Timer(_FREE_AFTER_S, self._free, args=(session,))
            timer.daemon = True
            timer.start()
        self.disconnected[why.split(":")[0].split(" (")[0]] += 1
        log.warning("controller: client %s disconnected: %s; %d queued request(s) dropped", session.name, why,
                    dropped)

    def _free(self, session: _Session) -> None:
        """Every array, function and program ``session``'s client held, once; its `ClientOps` refuses more."""
        with self._lock:
            if session.connected:   # its worker stopped without a disconnect (a bug): the client must know
                self._disconnect_locked(session, "its worker on the controller stopped")
            if session.freed:
                return
            session.freed = True
        freed = session.ops.release_everything()
        session.ops.forget_everything()
        log.info("controller: client %s: %d array(s) freed", session.name, freed)

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

    def _refused(self, session: _Session, op: str, error: BaseException) -> None:
        """Count a request that raised; log the first of each kind (op and error type), then every thousandth."""
        key = (op if op in OPS else "?", type(error).__name__)
        self.refusals[key] += 1
        if self.refusals[key] == 1 or self.refusals[key] % 1000 == 0:
            log.warning("controller: client %s: %s refused (%s of this kind so far): %s: %s", session.name, key[0],
                        self.refusals[key], key[1], str(error)[:300])

    def _drop(self, why: str) -> None:
        self.dropped_messages += 1
        log_dropped(log, self.dropped_messages, "client socket", why)


class _RecentSet:
    """The last ``size`` items added, for ``in`` in constant time (a flood's messages are each looked up)."""

    def __init__(self, size: int):
        self._order: collections.deque = collections.deque(maxlen=size)
        self._items: set = set()

    def add(self, item) -> None:
        if len(self._order) == self._order.maxlen:
            self._items.discard(self._order[0])
        self._order.append(item)
        self._items.add(item)

    def __contains__(self, item) -> bool:
        return item in self._items


