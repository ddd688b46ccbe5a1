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
import itertools
import logging
import threading
import time
from typing import Sequence

import zmq

from .controller_api import FAILED, PENDING, ArraySettled, ArrayState, ClientEvents, ControllerCounters, ExecutorView
from .errors import AuthenticationError, ContextClosedError, ControllerLostError, PathwaysError
from .wire import SocketLoop, seam_codec
from .wire.seam import CallSpec, MeshAllocation, ProgramSpec
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
        self.loop.every(heartbeat_interval_s, self._ping)
        self.loop.start()

    # ------------------------------------------------------------ requests

    def _request(self, op: str, *args):
        future = concurrent.futures.Future()
        with self._lock:
            if self._lost is not None:
                raise self._lost
            request_id = next(self._ids)
            self._answers[request_id] = future
        self._send({"r": request_id, "op": op, "a": list(args)})
        return future.result()   # never hangs: a lost controller fails every answer still awaited

    def _post(self, op: str, *args) -> None:
        """A request that needs no answer (it keeps its place among the others)."""
        if self._lost is None:
            self._send({"r": 0, "op": op, "a": list(args)})

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
            self.loop.send_now(_SOCKET, seam_codec.encode({"r": 0, "op": "ping", "a": []}))

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

    # ------------------------------------------------------------ functions, programs, calls, arrays

    def register_function(self, name: str, graph, constants: list, *, sim_seconds: float = 0.0) -> int:
        return self._request("register_function", name, graph, list(constants), float(sim_seconds))

    def register_program(self, spec: ProgramSpec) -> int:
        return self._request("register_program", spec)

    def describe_program(self, program_id: int) -> str:
        return self._request("describe_program", program_id)

    def forget(self, function_ids: Sequence[int], program_ids: Sequence[int]) -> None:
        self._post("forget", list(function_ids), list(program_ids))

    def call(self, spec: CallSpec) -> list[ArrayState]:
        """Sent without waiting for the controller: its outputs are named with ids granted before, and an error
        it meets there fails them (as a remote error does)."""
        ids = self._take_ids(spec.num_outputs)
        states = self._pending_states(ids)
        self._post_call("call", spec, ids)
        return states

    def run_program(self, program_id: int, input_ids: Sequence[int], num_outputs: int | None = None
                    ) -> list[ArrayState]:
        if num_outputs is None:   # not known here: ask, and wait for the answer
            return self._track(self._request("run_program", program_id, list(input_ids), None))
        ids = self._take_ids(num_outputs)
        states = self._pending_states(ids)
        self._post_call("run_program", program_id, list(input_ids), ids)
        return states

    def _take_ids(self, count: int) -> list[int]:
        """The next ``count`` of this client's granted array ids (more are granted, waited for, when they run
        out: one answer per `_ID_BLOCK` ids)."""
        with self._id_lock:
            while len(self._free_ids) < count:
                first, granted = self._request("grant_ids", max(_ID_BLOCK, count))
                self._free_ids.extend(range(first, first + granted))
            return [self._free_ids.popleft() for _ in range(count)]

    def _pending_states(self, ids: list[int]) -> list[ArrayState]:
        return self._track([ArraySettled(array_id, PENDING) for array_id in ids])

    def _post_call(self, op: str, *args) -> None:
        """Send a call once fewer than `_WINDOW` requests are unread by the controller (its answers say how many it
        read): the client runs ahead of the controller, never unboundedly."""
        with self._window:
            if self._sent - self._acked >= _WINDOW:
                start = time.time_ns()
                self._window.wait_for(lambda: self._sent - self._acked < _WINDOW // 2 or self._lost is not None)
                self.note_runahead_wait(start, time.time_ns(), self._sent - self._acked, f"{op} (controller)")
            if self._lost is not None:
                raise self._lost
        self._post(op, *args)

    def new_array(self, executor_ids: tuple[str, ...], *, landing: int, shard_bytes: int = 0) -> ArrayState:
        return self._track([self._request("new_array", list(executor_ids), landing, int(shard_bytes))])[0]

    def landed(self, array_id: int, error: BaseException | None = None) -> None:
        self._post("landed", array_id, error)

    def release(self, array_id: int) -> None:
        with self._lock:
            self._states.pop(array_id, None)
        self._post("release", array_id)

    def release_many(self, array_ids: Sequence[int]) -> None:
        with self._lock:
            for array_id in array_ids:
                self._states.pop(array_id, None)
        self._post("release_many", list(array_ids))

    def flush_frees(self) -> None:
        self._post("flush_frees")

    # ------------------------------------------------------------ executors

    def allocate_mesh(self, axes: dict[str, int], executor_ids: Sequence[str] | None = None) -> MeshAllocation:
        return self._request("allocate_mesh", dict(axes), None if executor_ids is None else list(executor_ids))

    def island_of(self, executor_id: str) -> str:
        return self._request("island_of", executor_id)

    def checkpoint_root(self) -> str:
        return self._request("checkpoint_root")

    def executors(self) -> tuple[ExecutorView, ...]:
        views = self._request("executors")
        self._known_executors = views
        return views

    _known_executors: tuple[ExecutorView, ...] = ()

    def executor(self, executor_id: str) -> ExecutorView | None:
        return self._request("executor", executor_id)

    def wait_for_executors(self, count: int, timeout_s: float) -> None:
        self._request("wait_for_executors", count, float(timeout_s))

    def order_executors(self, order: dict[str, int]) -> None:
        """The controller orders its own executors (the clients share them): nothing to do."""

    def _local_only(self, what: str):
        raise PathwaysError(f"{what} is not available through a remote controller ({self.address}): the "
                            f"controller's operator starts, replaces and routes its executors "
                            f"(pathways-controller; docs/service.md)")

    def label_executor(self, executor_id: str, label: str) -> None:
        self._local_only("label_executor")

    def route_through(self, executor_id: str, link_address: str) -> None:
        self._local_only("a shaped link (link=)")

    def replace_executor(self, executor_id: str, timeout_s: float) -> ExecutorView:
        """Have the controller replace a lost executor (it started it; else await the one its operator starts)."""
        return self._request("replace_executor", executor_id, float(timeout_s))

    def allowed_keys(self) -> dict[str, bytes]:
        self._local_only("replace_executor")

    def admit_key(self, role: str, public_key: bytes) -> None:
        self._local_only("replace_executor")

    def wait_for_incarnation(self, executor_id: str, epoch: int, timeout_s: float) -> ExecutorView:
        self._local_only("replace_executor")

    def declare_lost(self, executor_id: str, why: str) -> None:
        self._local_only("declare_lost")

    def watch_exits(self, cluster, interval_s: float) -> None:
        self._local_only("watching local executor processes")

    def serve_status(self, port: int, run_id: str = ""):
        self._local_only("serve_status (the controller serves its own: --status-port)")

    # ------------------------------------------------------------ observability

    def gather(self, kind: str) -> dict:
        return self._request("gather", kind)

    def counters(self) -> ControllerCounters:
        return self._request("counters")

    def runahead_waits(self) -> tuple[tuple[int, int, int, str], ...]:
        return tuple(tuple(w) for w in self._request("runahead_waits"))

    def note_runahead_wait(self, start_ns: int, end_ns: int, in_flight: int, what: str) -> None:
        self._post("note_runahead_wait", int(start_ns), int(end_ns), int(in_flight), str(what))

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
                self._request("bye")
            except PathwaysError:
                pass

    @property
    def io_running(self) -> bool:
        return self.loop.running

    def close(self) -> None:
        self._controller_lost(f"this client closed its connection to {self.address}", closing=True)
        self.loop.stop()
