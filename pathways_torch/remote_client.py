"""`RemoteClient`: the `ControllerClient` protocol to a standalone `pathways-controller`, over ZeroMQ and CURVE.

``pw.Context(controller="tcp://HOST:PORT", keys="DIR/clients/NAME")`` uses it. Requests travel as `seam_codec`
messages on one DEALER (the client's own key; the controller's served key): each waits for its answer, except
those that need none (releases, landed puts), which leave at once and keep their order. The controller's events
(an array settled, an executor lost or replaced, a key revoked) update the client's `ArrayState`s and reach the
subscriber, as the embedded controller's do.

The client pings the controller every heartbeat interval. No word from it for ``heartbeat_timeout_s`` (it died,
or the network between is cut), or its word that it stops: every pending request and array fails with
`ControllerLostError`, and so does every request after. Nothing waits forever.

Tensor bytes never come this way: the data client moves them between this process and the executors.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from typing import Sequence

import zmq

from .controller_api import FAILED, PENDING, ArrayState, ClientEvents, ExecutorView
from .errors import AuthenticationError, ContextClosedError, ControllerLostError, PathwaysError
from .wire import SocketLoop, seam_codec
from .wire.seam import (ArraySettled, Bye, Call, Executors, Forget, GrantIds, NoteRunaheadWait, RegisterProgram,
                        Release, ReleaseMany, RunProgram, SeamOp)
from .wire.security import HANDSHAKE_FAILURES, ConnectionWatch, Credentials, make_client

__all__ = ["RemoteClient"]

log = logging.getLogger(__name__)

_SOCKET = "controller"
_EARLY_EVENTS = 100_000   # events for arrays whose call's answer is still on its way (bounded)
_ID_BLOCK = 4096          # array ids asked for at once
_WINDOW = 512             # requests sent and not yet read by the controller, at most


class RemoteClient:
    """One client of a remote controller at ``address``, authenticated by ``credentials`` (its own key pair; the
    allow-list holds the controller's public key as ``"controller"``)."""

    def __init__(self, address: str, credentials: Credentials, zmq_context: zmq.Context, *,
                 heartbeat_interval_s: float, heartbeat_timeout_s: float):
        self.address = address
        self._timeout_s = heartbeat_timeout_s
        self.loop = SocketLoop("client-controller", zmq_context)
        socket = zmq_context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 0)   # nothing dropped: the run-ahead bound paces the client
        make_client(socket, credentials, credentials.public_key("controller"))
        socket.connect(address)
        self.loop.add_socket(_SOCKET, socket, self._on_frames)
        self.loop.monitor(_SOCKET, ConnectionWatch("client → controller", self._on_connection_event).on_frames)
        self._lock = threading.Lock()
        self._answers: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count(1)
        self._states: dict[int, ArrayState] = {}          # arrays handed out and not released
        self._early: dict[int, list[ArraySettled]] = {}   # events that came before their array's answer
        self._events: ClientEvents | None = None
        self._interned = seam_codec.Interned()   # one failure of many arrays: one error object, as embedded
        self._lost: PathwaysError | None = None   # why nothing more is answered (ControllerLostError mostly)
        self._last_heard = time.monotonic()
        self._heard_once = False
        self._id_lock = threading.Lock()
        self._free_ids: collections.deque = collections.deque()   # array ids granted to this client, unused
        self._window = threading.Condition()   # requests sent and read by the controller (its acks)
        self._sent = self._acked = 0
        self._program_outputs: dict[int, int] = {}   # program id → its outputs, for runs sent without waiting
        self.loop.every(heartbeat_interval_s, self._ping)
        self.loop.start()

    # ------------------------------------------------------------ requests

    def _request(self, op: SeamOp):
        future = concurrent.futures.Future()
        with self._lock:
            if self._lost is not None:
                raise self._lost
            request_id = next(self._ids)
            self._answers[request_id] = future
        self._send({"r": request_id, "op": op.NAME, "a": op.wire_args()})
        return future.result()   # never hangs: a lost controller fails every answer still awaited

    def _post(self, op: SeamOp) -> None:
        """A request that needs no answer (it keeps its place among the others)."""
        if self._lost is None:
            self._send({"r": 0, "op": op.NAME, "a": op.wire_args()})

    def _send(self, message: dict) -> None:
        frames = seam_codec.encode(message)
        with self._window:
            self._sent += 1   # in the order the loop sends them: the controller reads them in this order
            self.loop.send(_SOCKET, frames)

    # ------------------------------------------------------------ the I/O thread

    def _on_frames(self, frames) -> None:
        try:
            message = seam_codec.decode(frames, self._interned)
        except seam_codec.SeamCodecError as exc:
            log.warning("a malformed message from the controller at %s dropped: %s", self.address, exc)
            return
        self._last_heard, self._heard_once = time.monotonic(), True
        if "ev" in message:
            self._on_event(message)
            return
        with self._lock:
            future = self._answers.pop(message.get("r"), None)
        if future is None:
            return   # a ping's answer
        if "err" in message:
            future.set_exception(message["err"])
        else:
            future.set_result(message.get("ok"))

    def _on_event(self, message: dict) -> None:
        kind = message["ev"]
        if kind == "settled":
            self._settle(message["s"])
        elif kind == "ack":
            with self._window:
                self._acked = max(self._acked, int(message["n"]))
                self._window.notify_all()
        elif kind == "stopping":
            self._controller_lost(f"the controller at {self.address} stopped ({message.get('why', '')})")
        elif kind == "refused":   # a request not waited for that the controller would not read (its size)
            log.warning("the controller at %s refused a request of this client: %s", self.address, message.get("why"))
        elif kind == "disconnected":
            self._controller_lost(f"the controller at {self.address} disconnected this client "
                                  f"({message.get('why', '')}); what it held there is freed")
        elif self._events is None:
            return
        elif kind == "lost":
            self._events.executor_lost(message["executor"], message["error"])
        elif kind == "incarnation":
            self._events.new_incarnation(message["view"])
        elif kind == "revoked":
            self._events.key_revoked(message["key"])

    def _settle(self, event: ArraySettled) -> None:
        with self._lock:
            state = self._states.get(event.array_id)
            if state is None:
                if len(self._early) < _EARLY_EVENTS:
                    self._early.setdefault(event.array_id, []).append(event)
                return
        state.apply(event)

    def _ping(self) -> None:
        silent = time.monotonic() - self._last_heard
        if self._lost is None and silent > self._timeout_s:
            heard = "" if self._heard_once else " (it never answered: check the address, and that keys= is a " \
                                                "client folder of this controller's --make-keys)"
            self._controller_lost(f"the controller at {self.address} has not answered for {silent:.1f} s (the "
                                  f"heartbeat timeout is {self._timeout_s:g} s){heard}")
            return
        if self._lost is None:
            self.loop.send_now(_SOCKET, seam_codec.encode({"r": 0, "op": "ping", "a": []}))   # the inbox answers it

    def _controller_lost(self, why: str, *, closing: bool = False) -> None:
        """Fail everything pending with `ControllerLostError`, and every request from now on."""
        self._fail_everything(ControllerLostError(f"{why}; nothing pending will complete: reconnect with a new "
                                                  f"pw.Context", address=self.address), closing=closing)

    def _on_connection_event(self, event: str, watch: ConnectionWatch) -> None:
        if event in HANDSHAKE_FAILURES and watch.rejected:
            self._fail_everything(AuthenticationError(
                f"the controller at {self.address} refused this client's key ({event}): keys= must be a client "
                f"folder (DIR/clients/NAME) of that controller's pathways-controller --make-keys", peer="controller"))

    def _fail_everything(self, error: PathwaysError, *, closing: bool = False) -> None:
        with self._lock:
            if self._lost is not None:
                return
            self._lost = error
            answers, self._answers = list(self._answers.values()), {}
            states = [s for s in self._states.values() if s.state == PENDING]
        if not closing:
            log.error("%s", error)
        for future in answers:
            future.set_exception(error)
        with self._window:
            self._window.notify_all()
        for state in states:
            state.apply(ArraySettled(state.array_id, FAILED, error))
        if self._events is not None:
            for info in self._known_executors:
                self._events.executor_lost(info.executor_id, error)

    # ------------------------------------------------------------ the protocol: events

    def subscribe(self, events: ClientEvents) -> None:
        self._events = events

    def _track(self, settled: Sequence[ArraySettled]) -> list[ArrayState]:
        states = []
        with self._lock:
            for event in settled:
                state = ArrayState(event.array_id)
                state.put_token = event.put_token
                state.apply(event)
                for early in self._early.pop(event.array_id, ()):
                    state.apply(early)
                self._states[event.array_id] = state
                if self._lost is not None and state.state == PENDING:
                    state.apply(ArraySettled(event.array_id, FAILED, self._lost))
                states.append(state)
        return states

    # ------------------------------------------------------------ the protocol: operations

    def request(self, op: SeamOp):
        """Send ``op``. A call (and a run of a program registered here) is sent without waiting: its outputs are
        named with ids granted before, and an error it meets there fails them (as a remote error does); an
        operation that needs no answer (`SeamOp.ANSWERED`) is sent and not waited for; any other waits for its
        answer."""
        kind = type(op)
        if kind is Call and op.output_ids is None:
            return self._call_ahead(op, op.spec.num_outputs)
        if kind is RunProgram and op.output_ids is None and op.program_id in self._program_outputs:
            return self._call_ahead(op, self._program_outputs[op.program_id])
        if kind is Forget:
            for program_id in op.program_ids:
                self._program_outputs.pop(program_id, None)
        if kind is Release or kind is ReleaseMany:
            with self._lock:
                for array_id in (op.array_id,) if kind is Release else op.array_ids:
                    self._states.pop(array_id, None)
        if not op.ANSWERED:
            self._post(op)
            return None
        answer = self._request(op)
        if kind is RegisterProgram:   # its runs can then be sent without waiting
            self._program_outputs[answer] = len(op.spec.output_values)
        elif kind is Executors:
            self._known_executors = answer
        return self._track(answer) if op.MAKES_ARRAYS else answer

    _known_executors: tuple[ExecutorView, ...] = ()

    def _call_ahead(self, op, num_outputs: int) -> list[ArrayState]:
        ids = self._take_ids(num_outputs)
        states = self._track([ArraySettled(array_id, PENDING) for array_id in ids])
        self._wait_for_window(op.NAME)
        self._post(dataclasses.replace(op, output_ids=ids))
        return states

    def _take_ids(self, count: int) -> list[int]:
        """The next ``count`` of this client's granted array ids (more are granted, waited for, when they run
        out: one answer per `_ID_BLOCK` ids)."""
        with self._id_lock:
            while len(self._free_ids) < count:
                first, granted = self._request(GrantIds(max(_ID_BLOCK, count)))
                self._free_ids.extend(range(first, first + granted))
            return [self._free_ids.popleft() for _ in range(count)]

    def _wait_for_window(self, what: str) -> None:
        """Go on once fewer than `_WINDOW` requests are unread by the controller (its answers say how many it
        read): the client runs ahead of the controller, never unboundedly."""
        with self._window:
            if self._sent - self._acked >= _WINDOW:
                start = time.time_ns()
                self._window.wait_for(lambda: self._sent - self._acked < _WINDOW // 2 or self._lost is not None)
                self._post(NoteRunaheadWait(start, time.time_ns(), self._sent - self._acked, f"{what} (controller)"))
            if self._lost is not None:
                raise self._lost

    # ------------------------------------------------------------ lifecycle

    def fail_pending(self, reason: str) -> int:
        """Fail this client's pending arrays with `ContextClosedError` (the controller's other clients go on)."""
        with self._lock:
            pending = [s for s in self._states.values() if s.state == PENDING]
        for state in pending:
            state.apply(ArraySettled(state.array_id, FAILED,
                                     ContextClosedError(f"{reason} before array {state.array_id} was ready")))
        return len(pending)

    def shutdown_executors(self, reason: str) -> None:
        """Say goodbye: the controller frees what this client holds. Its executors serve the others on."""
        if self._lost is None:
            try:
                self._request(Bye())
            except PathwaysError:
                pass

    @property
    def io_running(self) -> bool:
        return self.loop.running

    def close(self) -> None:
        self._controller_lost(f"this client closed its connection to {self.address}", closing=True)
        self.loop.stop()
