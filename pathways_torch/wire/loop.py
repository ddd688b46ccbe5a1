"""One I/O thread that owns every ZeroMQ socket of a process.

ZeroMQ sockets must not be used from two threads at once, so each process
(client, controller, executor) runs one `SocketLoop`: other threads hand it work
with `call_soon` / `send`, which wake the loop through an inproc pipe. Handlers
registered for a socket run on the loop thread. Bytes are counted per socket.

Sends never block the loop: a message a peer cannot take now (ZeroMQ's queue to it
is at its high-water mark: the peer stopped reading) waits in that peer's queue here,
in order, and goes out when the peer reads again. What bounds those queues is the
producer's own limit (the run-ahead bound, the data client's requests per executor);
`backlog_high_water` reports how deep one ever got.
A socket's connection events (accepted, handshake succeeded or refused, ...) can
be watched through a ZeroMQ socket monitor, also on the loop thread.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import threading
import time
from typing import Callable, Sequence

import zmq

from .threads import leave_signals_to_the_main_thread, name_os_thread
from .wake import WakePipe, defer_sets_on_this_thread, end_turn, sets_deferred

__all__ = ["SocketLoop", "frame_nbytes", "RECONNECT_BACKOFF_MAX_MS"]

log = logging.getLogger(__name__)

_loop_ids = itertools.count()
# While messages wait for a slow peer, the loop retries them this often (it also retries on any wake-up).
_RETRY_MS = 2
# An idle loop wakes this often anyway (a safety net only: every hand-over wakes it). Not more: each turn polls
# every socket, and the client's data loop holds two per executor (about 1.2 ms a turn at 256 executors, measured).
_IDLE_POLL_MS = 1000
_BATCH = 64   # messages read from one socket per turn, unless add_socket says otherwise
# The longest wait between two tries to reach a peer that went away (ZMQ_RECONNECT_IVL_MAX; ZeroMQ's default retries
# every 100 ms for good: a lost process of 64 simulated executors was 640 tries a second on each side).
RECONNECT_BACKOFF_MAX_MS = 5000


class SocketLoop:
    """Poll a set of sockets on one thread; run timers and callbacks posted by other threads."""

    def __init__(self, name: str, context: zmq.Context | None = None, precise_timers: bool = False):
        self.name = name
        # Timers to within a tenth of a millisecond, not one (ZeroMQ polls in whole milliseconds): the loop sleeps
        # the last fraction of a millisecond before a timer falls due (a simulating host's device clocks).
        self._precise = precise_timers
        self.context = context or zmq.Context.instance()
        self._sockets: dict[str, zmq.Socket] = {}
        self._handlers: dict[zmq.Socket, Callable[[list], None]] = {}
        self._socket_names: dict[zmq.Socket, str] = {}
        self._batches: dict[zmq.Socket, int] = {}    # messages read from a socket per turn, at most (default 64)
        self._monitors: dict[str, zmq.Socket] = {}   # socket key → its monitor's PAIR socket
        self._uncounted: set[zmq.Socket] = set()     # monitor sockets: their frames are not traffic
        self._poller = zmq.Poller()
        self._callbacks: collections.deque = collections.deque()
        self._timers: list[list] = []  # [next_due, interval_s, fn]
        self._delayed: list[tuple] = []  # heap of (due, order, fn): one-shot, run in due order
        self._delayed_order = itertools.count()
        self._waker = WakePipe(self.context, f"loop-{name}")
        self._poller.register(self._waker.socket, zmq.POLLIN)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.turn_started = 0.0   # when the poll of this turn returned (`time.monotonic`): when its messages came
        # (socket key, peer identity or b"") → frames a peer could not take yet, oldest first
        self._waiting: dict[tuple[str, bytes], collections.deque] = {}
        self.backlog_high_water = 0     # the most messages that ever waited for one peer
        self.bytes_out: collections.Counter = collections.Counter()
        self.bytes_in: collections.Counter = collections.Counter()
        self.payload_bytes_out: collections.Counter = collections.Counter()
        self.payload_bytes_in: collections.Counter = collections.Counter()
        self.messages_out: collections.Counter = collections.Counter()
        self.messages_in: collections.Counter = collections.Counter()

    # ------------------------------------------------------------ set-up (any thread, before start)

    def add_socket(self, key: str, socket: zmq.Socket, handler: Callable[[list], None] | None,
                   batch: int = _BATCH) -> zmq.Socket:
        """Own ``socket`` under ``key``; ``handler(frames)`` runs for each message received. ``batch``: messages read
        from it per turn at most, before what other threads handed over (sends, callbacks) runs: small for a socket
        one peer may flood, so the others' answers wait behind a few of its messages, not many."""
        self._sockets[key] = socket
        self._socket_names[socket] = key
        self._batches[socket] = batch
        if handler is not None:
            self._handlers[socket] = handler
            self._poller.register(socket, zmq.POLLIN)
        return socket

    def every(self, interval_s: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread every ``interval_s`` seconds (from any thread, also once started)."""
        timer = [time.monotonic() + interval_s, interval_s, fn]
        self.call_soon(lambda: self._timers.append(timer))

    def monitor(self, key: str, handler: Callable[[list], None], socket: zmq.Socket | None = None) -> None:
        """Pass the monitor events of socket ``key`` (raw frames) to ``handler`` on the loop thread.

        Like `add_socket`, call it before `start` or on the loop thread: a socket
        must not be touched by two threads. ``socket``: one another thread owns (not
        in this loop), set up before that thread starts using it.
        """
        socket = socket if socket is not None else self._sockets[key]
        address = f"inproc://pathways-monitor-{self.name}-{next(_loop_ids)}"
        socket.monitor(address, zmq.EVENT_ALL)
        pair = self.context.socket(zmq.PAIR)
        pair.setsockopt(zmq.LINGER, 0)
        pair.connect(address)
        self._monitors[key] = pair
        self._uncounted.add(pair)
        self._socket_names[pair] = f"{key}#monitor"
        self._handlers[pair] = handler
        self._poller.register(pair, zmq.POLLIN)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"pathways-io-{self.name}", daemon=True)
        self._thread.start()

    def run_forever(self) -> None:
        """Run the loop on the calling thread (executors use their main thread)."""
        self._thread = threading.current_thread()
        self._run()

    # ------------------------------------------------------------ any thread

    @property
    def running(self) -> bool:
        """True while the loop's thread runs (started and not yet stopped)."""
        return self._thread is not None and self._thread.is_alive()

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread (at once if already there)."""
        if self.on_loop_thread():
            fn()
            return
        self._callbacks.append(fn)
        # The loop drains the wake-ups before it runs the callbacks, so a callback appended
        # after the drain sends a new wake-up and one appended before it runs this turn.
        self._waker.wake()

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread after ``delay_s`` (calls with equal delays keep their order)."""
        self.call_at(time.monotonic() + delay_s, fn)

    def call_at(self, due: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread at ``due`` (`time.monotonic`), in due order (ties: in the order given)."""
        self.call_soon(lambda: heapq.heappush(self._delayed, (due, next(self._delayed_order), fn)))

    def send(self, key: str, frames: Sequence) -> None:
        """Send a multipart message on the socket named ``key`` (from any thread)."""
        self.call_soon(lambda: self.send_now(key, frames))

    @property
    def stopping(self) -> bool:
        """Whether `stop` was asked: threads beside the loop that serve it end too."""
        return self._stopping

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        self.call_soon(lambda: None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    # ------------------------------------------------------------ loop thread

    def socket(self, key: str) -> zmq.Socket | None:
        return self._sockets.get(key)

    def send_now(self, key: str, frames: Sequence) -> None:
        """Send at once if the peer can take it, else queue it behind what already waits for that peer."""
        socket = self._sockets.get(key)
        if socket is None:
            log.warning("%s: no socket %r; dropping a message", self.name, key)
            return
        routed = socket.type == zmq.ROUTER
        self._count(self.bytes_out, self.payload_bytes_out, key, frames, routed=routed)
        self.messages_out[key] += 1
        peer = (key, _identity(frames[0]) if routed else b"")
        waiting = self._waiting.get(peer)
        if waiting is None:
            if self._try_send(socket, key, frames):
                return
            waiting = self._waiting[peer] = collections.deque()
        waiting.append(frames)     # keep the order: behind what waits already
        self.backlog_high_water = max(self.backlog_high_water, len(waiting))

    def _try_send(self, socket: zmq.Socket, key: str, frames: Sequence) -> bool:
        """Send without blocking: False if the peer cannot take it now (it is kept by the caller)."""
        try:
            socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            # A ROUTER with ROUTER_MANDATORY raises for a peer that is gone (EHOSTUNREACH): nothing to keep. That
            # is expected (a heartbeat answered as a thousand executors stop), so not a warning.
            log.log(logging.DEBUG if exc.errno == zmq.EHOSTUNREACH else logging.WARNING, "%s: send on %r failed: %s",
                    self.name, key, exc)
        return True

    def _send_waiting(self) -> None:
        """Retry what waits for slow peers, oldest first, until a peer cannot take more."""
        for peer in list(self._waiting):
            socket = self._sockets.get(peer[0])
            waiting = self._waiting[peer]
            while socket is not None and waiting and self._try_send(socket, peer[0], waiting[0]):
                waiting.popleft()
            if socket is None or not waiting:
                del self._waiting[peer]

    def close_socket(self, key: str) -> None:
        socket = self._sockets.pop(key, None)
        if socket is None:
            return
        for peer in [p for p in self._waiting if p[0] == key]:
            del self._waiting[peer]
        monitor = self._monitors.pop(key, None)
        if monitor is not None:
            socket.disable_monitor()
        for sock in (socket, monitor):
            if sock is None:
                continue
            if sock in self._handlers:
                self._poller.unregister(sock)
                del self._handlers[sock]
            self._socket_names.pop(sock, None)
            self._batches.pop(sock, None)
            self._uncounted.discard(sock)
            sock.close(linger=0)

    def _count(self, total, payload, key, frames, routed: bool) -> None:
        start = 1 if routed else 0   # the routing identity is not our message
        envelope = frame_nbytes(frames[start]) if len(frames) > start else 0
        tensors = sum(frame_nbytes(f) for f in frames[start + 1:]) if len(frames) > start + 1 else 0
        total[key] += envelope + tensors
        payload[key] += tensors

    def _run(self) -> None:
        name_os_thread()
        leave_signals_to_the_main_thread()
        try:
            defer_sets_on_this_thread()
            held = False   # waiters' events were held back a turn already
            while not self._stopping:
                timeout_ms = self._poll_timeout_ms()
                ready = self._poller.poll(0) if sets_deferred() and not held and timeout_ms else []
                held = bool(ready)
                if not ready:   # nothing more to read: wake the waiters, then sleep
                    end_turn()
                    ready = self._poller.poll(timeout_ms)
                self.turn_started = time.monotonic()
                for socket, _ in ready:
                    if socket is self._waker.socket:
                        self._waker.drain()
                    elif socket in self._handlers:   # not closed by a handler earlier in this turn
                        self._receive(socket)
                self._run_callbacks()
                if self._precise:
                    self._sleep_to_next_due()
                self._run_timers()
                if self._waiting:
                    self._send_waiting()
        finally:
            self._close_all()

    def _poll_timeout_ms(self) -> int:
        if self._callbacks:
            return 0
        ceiling = _RETRY_MS if self._waiting else _IDLE_POLL_MS
        dues = [t[0] for t in self._timers] + ([self._delayed[0][0]] if self._delayed else [])
        if not dues:
            return ceiling
        due = min(dues) - time.monotonic()
        # A precise loop wakes up to a millisecond early and sleeps the rest (`_sleep_to_next_due`).
        return max(0, min(ceiling, int(due * 1000) + (0 if self._precise else 1)))

    def _sleep_to_next_due(self) -> None:
        if self._callbacks or not self._delayed:
            return
        left = self._delayed[0][0] - time.monotonic()
        if 0 < left < 0.0011:
            time.sleep(left)

    def _receive(self, socket: zmq.Socket) -> None:
        handler = self._handlers.get(socket)
        key = self._socket_names.get(socket, "?")
        # Drain what is queued, but yield to other sockets and to what other threads handed over after a batch.
        for _ in range(self._batches.get(socket, _BATCH)):
            try:   # until Again: one exception per drained socket costs less than asking EVENTS per message
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if socket not in self._uncounted:
                self._count(self.bytes_in, self.payload_bytes_in, key, frames, routed=socket.type == zmq.ROUTER)
                self.messages_in[key] += 1
            try:
                handler(frames)
            except Exception:  # a bad message must not kill the loop
                log.exception("%s: handler for %r failed; message dropped", self.name, key)
            if socket.closed:   # its handler closed it (an executor told to stop)
                return

    def _run_callbacks(self) -> None:
        while self._callbacks:
            fn = self._callbacks.popleft()
            try:
                fn()
            except Exception:
                log.exception("%s: callback failed", self.name)

    def _run_timers(self) -> None:
        now = time.monotonic()
        while self._delayed and self._delayed[0][0] <= now:
            _, _, fn = heapq.heappop(self._delayed)
            try:
                fn()
            except Exception:
                log.exception("%s: delayed call failed", self.name)
        for timer in self._timers:
            if timer[0] <= now:
                timer[0] = now + timer[1]
                try:
                    timer[2]()
                except Exception:
                    log.exception("%s: timer failed", self.name)

    def _close_all(self) -> None:
        for key in list(self._sockets):
            self.close_socket(key)
        for pair in self._monitors.values():   # monitors of sockets other threads own
            pair.close(linger=0)
        self._waker.close()


def _identity(frame) -> bytes:
    return frame.bytes if isinstance(frame, zmq.Frame) else bytes(frame)


def frame_nbytes(frame) -> int:
    """The bytes a frame carries (bytes, zmq.Frame, memoryview or any buffer)."""
    if isinstance(frame, (bytes, zmq.Frame)):
        return len(frame)
    if isinstance(frame, memoryview):
        return frame.nbytes
    return frame.buffer.nbytes if hasattr(frame, "buffer") else len(frame)
