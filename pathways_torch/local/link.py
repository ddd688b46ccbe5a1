"""A shaped link between islands: every transfer from one island to another passes a relay that delays
and rate-limits it, and counts its bytes.

Tests and benchmarks need the inter-island network to be slower than the inside of an
island, on one machine. `LinkRelay` is a TCP relay thread: one listening port per
executor, forwarding to that executor's data address. Executors of other islands are told
to send there (`ResourceManager` link addresses), so a cross-island transfer crosses it and
an in-island one never does. ZeroMQ's CURVE handshake and encryption pass through
untouched: the relay moves bytes it cannot read. Executors and the controller stay on
loopback in the root network namespace whatever the shaping.

Who sets the rate (``Link.shaping``):

- ``"tbf"``: the kernel. The relay makes a network namespace joined to the root one by a
  veth pair with ``tc tbf`` on both ends (`pathways_torch.local.netns`) and listens inside it, on
  the namespace's end: a sender's bytes cross the pair root -> namespace before the relay
  reads them, and the replies the relay writes cross it namespace -> root, each direction
  shaped on its egress. Needs root and iproute2; raises `LinkShapingError` where it cannot.
- ``"relay"``: the relay's own token bucket (burst: 2 ms of the rate, at least 64 KiB: a
  smaller bucket would cap fast links at what one wake-up of the relay thread can write),
  on loopback; needs nothing.
- ``"auto"`` (default): tbf where this process can make it, else the relay, keeping why
  (`LinkRelay.shaping_reason`).

The delay is always the relay's (``tc netem`` is missing on the machines this was built
on): a chunk read at time t is written no earlier than ``t + delay_s``, per direction of
each connection, so a transfer of n bytes takes about ``delay_s + n / bandwidth``.

Bounded: a direction stops reading while its queue holds two bursts (`LinkRelay.queue_limit`), so a
destination that stops reading holds its sender back through TCP instead of growing the relay's memory.
An unexpected error while relaying one connection closes that connection (logged, counted in
``failed_connections``), never the relay. A replaced executor's port is removed (`LinkRelay.add` with
``owner``, `LinkRelay.remove`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import selectors
import socket
import threading
import time

from . import netns
from ..errors import PathwaysError

__all__ = ["Link", "LinkRelay", "LinkShapingError", "SHAPINGS"]

log = logging.getLogger(__name__)

_CHUNK = 256 * 1024
# Loopback or the veth pair: a live destination answers at once, a gone one refuses at once. Short, since the relay
# thread waits it out (every direction holds meanwhile).
_CONNECT_TIMEOUT_S = 0.5
_BLOCKED_RETRY_S = 0.002   # how soon a sink that took nothing is tried again (about 500 tries a second, not 2,000)
_BURST = 64 * 1024
# For the queue bound only: a link without a bandwidth limit is taken to move this much, so a delayed one can keep
# its delay's worth of bytes in flight.
_NOMINAL_RATE = 1e9
SHAPINGS = ("auto", "tbf", "relay")


class LinkShapingError(PathwaysError, RuntimeError):
    """``Link(shaping="tbf")`` where this process cannot shape with tbf; the message names the failing step."""


@dataclasses.dataclass(frozen=True)
class Link:
    """How the link between islands is shaped: a one-way delay, a bandwidth (None: unlimited), and who
    enforces the bandwidth: ``"tbf"`` (the kernel, in a network namespace), ``"relay"`` (the relay's token
    bucket) or ``"auto"`` (tbf where possible, else the relay)."""

    delay_s: float = 0.0
    bandwidth_bytes_per_s: float | None = None
    shaping: str = "auto"

    def __post_init__(self):
        if self.delay_s < 0:
            raise ValueError(f"Link: delay_s must be >= 0, got {self.delay_s!r}")
        if self.bandwidth_bytes_per_s is not None and not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"Link: bandwidth_bytes_per_s must be positive or None, got "
                             f"{self.bandwidth_bytes_per_s!r}")
        if self.shaping not in SHAPINGS:
            raise ValueError(f"Link: shaping: expected one of {', '.join(map(repr, SHAPINGS))}, got "
                             f"{self.shaping!r}")
        if self.shaping == "tbf" and self.bandwidth_bytes_per_s is None:
            raise ValueError("Link: shaping='tbf' shapes a bandwidth, but bandwidth_bytes_per_s is None; give a "
                             "bandwidth, or shaping='auto' (the relay adds the delay alone)")

    def describe(self) -> str:
        """What is asked (`LinkRelay.describe` says what is in force)."""
        shaping = "" if self.shaping == "auto" else f", shaping={self.shaping!r}"
        return f"relayed, {_delay(self)}, {_rate(self)}{shaping}"


def _delay(link: Link) -> str:
    return f"{link.delay_s * 1e3:g} ms one-way"


def _rate(link: Link) -> str:
    return f"{link.bandwidth_bytes_per_s / 1e6:g} MB/s" if link.bandwidth_bytes_per_s else "unlimited rate"


def _shape(link: Link, burst: float) -> tuple[netns.TbfVeth | None, str]:
    """The tbf-shaped veth pair the relay listens behind, or None; and why."""
    if link.bandwidth_bytes_per_s is None:
        return None, "no bandwidth limit: the relay adds the delay alone"
    if link.shaping == "relay":
        return None, "shaping='relay' asked for it"
    try:
        veth = netns.TbfVeth.create(link.bandwidth_bytes_per_s, int(burst))
    except netns.TbfUnavailable as error:
        if link.shaping == "tbf":
            raise LinkShapingError(
                f"Link(shaping='tbf'): expected to shape the link with tc tbf on a veth pair into a network "
                f"namespace, got: {error}; fix: run as root with iproute2 (`ip`, `tc`) on PATH, or use "
                f"shaping='auto' (falls back to the relay's token bucket) or shaping='relay'") from error
        return None, f"tbf not possible: {error}"
    return veth, (f"tc tbf on both ends of veth {veth.root_device} <-> {veth.ns_device} "
                  f"(namespace {veth.namespace})")


class _Direction:
    """Bytes read from one socket, waiting to be written to the other."""

    __slots__ = ("source", "sink", "target", "queue", "queued", "paused", "blocked", "tokens", "stamp", "closed")

    def __init__(self, source: socket.socket, sink: socket.socket, target: str = ""):
        self.source, self.sink, self.target = source, sink, target
        self.queue: collections.deque = collections.deque()   # (due time, bytes)
        self.queued = 0          # bytes in the queue
        self.paused = False      # its source is not read (the queue is full)
        self.blocked = False     # its sink took nothing at the last try (the destination reads slowly)
        self.tokens, self.stamp, self.closed = 0.0, time.monotonic(), False


class LinkRelay:
    """The relay thread and its ports; `add` one port per destination address.

    ``shaping`` is what sets the rate ("tbf" or "relay"), ``shaping_reason`` why; ``veth`` the shaped pair
    (None with the relay's bucket). ``bytes_relayed`` counts every byte delivered to the executors' sockets,
    both directions (``bytes_to``: by destination address), ``bytes_metered`` those the relay's own token
    bucket let through (0 when tbf sets the rate). ``queue_limit``: the bytes one direction may hold (two bursts,
    a burst being the bucket or, if more, what the delay keeps in flight at the rate); ``queue_high_water`` the
    most it ever held. ``listeners``: the ports listening now; ``failed_connections``: connections closed on an
    unexpected error."""

    def __init__(self, link: Link):
        self.link = link
        rate = link.bandwidth_bytes_per_s
        self._burst = max(float(_BURST), rate * 0.002) if rate else float(_BURST)
        self.queue_limit = int(2 * max(self._burst, link.delay_s * (rate or _NOMINAL_RATE)))
        self.queue_high_water = 0
        self.failed_connections = 0
        self.veth, self.shaping_reason = _shape(link, self._burst)
        self.shaping = "tbf" if self.veth is not None else "relay"
        self._metering = rate is not None and self.veth is None
        self.bytes_relayed = 0                                  # every byte written, both directions
        self.bytes_to: collections.Counter = collections.Counter()   # by destination address
        self.bytes_metered = 0
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._directions: list[_Direction] = []
        # Listeners are registered and removed on the relay thread (the selector is its alone): `add` and `remove`
        # queue the change and wake the thread.
        self._changes: collections.deque = collections.deque()   # ("listen", socket, target) or ("remove", target)
        self._listening: dict[str, list[socket.socket]] = {}      # target -> its listeners (relay thread)
        self._owners: dict[str, str] = {}                           # owner -> its target (under the lock)
        self._wake_reader, self._wake_writer = socket.socketpair()
        for s in (self._wake_reader, self._wake_writer):
            s.setblocking(False)
        self._selector.register(self._wake_reader, selectors.EVENT_READ, ("wake",))
        self._stopping = self._closed = False
        self._cut = threading.Event()          # set by `cut`, cleared by the relay thread once done
        self.cuts = 0
        self.refused: collections.Counter = collections.Counter()   # by target: connections it refused (gone)
        self._thread = threading.Thread(target=self._run, name="pathways-link", daemon=True)
        self._thread.start()

    def add(self, target: str, owner: str | None = None) -> str:
        """Listen for ``target`` (``tcp://host:port``); return the address to send to instead: on loopback, or
        with tbf on the namespace's end of the veth pair (reached from the root namespace over the pair).

        ``owner`` (an executor id): one port per owner; adding again for it removes its previous target's port
        and connections (a replaced executor's old address, which no one may reach any more)."""
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        listener = self.veth.listen() if self.veth is not None else _loopback_listener()
        listener.setblocking(False)
        with self._lock:
            previous = self._owners.get(owner) if owner is not None else None
            if owner is not None:
                self._owners[owner] = target
            if previous is not None:
                self._changes.append(("remove", previous))     # first: the new port may serve the same address
            self._changes.append(("listen", listener, target))
        self._wake()
        listen_host, listen_port = listener.getsockname()[:2]
        return f"tcp://{listen_host}:{listen_port}"

    def remove(self, target: str) -> None:
        """Stop listening for ``target`` and close its relayed connections (soon after, on the relay thread)."""
        with self._lock:
            self._changes.append(("remove", target))
        self._wake()

    @property
    def listeners(self) -> int:
        """The ports listening now (one per destination address)."""
        return sum(len(v) for v in list(self._listening.values()))

    def describe(self) -> str:
        """The shaping in force, e.g. "tbf on veth (namespace pathways-link-123-0), 5 ms one-way (relay), 10 MB/s"."""
        link = self.link
        if self.veth is not None:
            return f"tbf on veth (namespace {self.veth.namespace}), {_delay(link)} (relay), {_rate(link)}"
        if link.bandwidth_bytes_per_s is None:
            return f"relayed, {_delay(link)}, {_rate(link)}"
        return f"relayed, {_delay(link)}, {_rate(link)} (the relay's token bucket; {self.shaping_reason})"

    def cut(self, timeout_s: float = 5.0) -> None:
        """Cut the link once, as a failing network does: every relayed connection is reset at once and the
        bytes in flight are dropped. New connections are accepted again at once (ZeroMQ reconnects without a
        word): what was lost must be found by whoever waits for it (transfers are acknowledged)."""
        self._cut.set()
        self._wake()
        deadline = time.monotonic() + timeout_s
        while self._cut.is_set() and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = self._stopping = True
        self._wake()
        self._thread.join(2.0)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        for change in self._changes:      # listeners the thread never registered
            if change[0] == "listen":
                change[1].close()
        for s in (*(s for group in self._listening.values() for s in group), self._wake_writer):
            s.close()
        self._selector.close()
        if self.veth is not None:
            self.veth.close()          # after the sockets: each socket made in the namespace keeps it alive

    # ------------------------------------------------------------ the relay thread

    def _wake(self) -> None:
        try:
            self._wake_writer.send(b"x")
        except (BlockingIOError, OSError):
            pass     # a wake-up is pending already (or the relay is closed)

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._turn()
            except Exception:     # a bug of ours outside any one connection: keep relaying the others
                log.exception("link: the relay's loop failed; it goes on")
                time.sleep(0.01)

    def _turn(self) -> None:
        self._apply_changes()
        if self._cut.is_set():
            self._reset_all()
        for key, _ in self._selector.select(self._timeout()):
            kind, *rest = key.data
            if kind == "wake":
                _drain(key.fileobj)
            elif kind == "listen":
                self._accept(key.fileobj, *rest)
            else:
                direction = rest[0]
                try:
                    self._read(direction)
                except Exception:
                    self._fail(direction)
        self._write_due()

    def _fail(self, direction: _Direction) -> None:
        """An unexpected error while relaying one connection: close it (both directions), keep the others."""
        self.failed_connections += 1
        log.exception("link: relaying a connection to %s failed; closing that connection", direction.target)
        try:
            self._close(direction)
        except Exception:
            log.exception("link: closing the failed connection to %s failed too", direction.target)

    def _apply_changes(self) -> None:
        """Register new listeners and remove old targets' (queued by `add` and `remove`)."""
        while self._changes:
            change = self._changes.popleft()
            if change[0] == "listen":
                _, listener, target = change
                host, port = target.removeprefix("tcp://").rsplit(":", 1)
                self._selector.register(listener, selectors.EVENT_READ, ("listen", (host, int(port)), target))
                self._listening.setdefault(target, []).append(listener)
                continue
            target = change[1]
            for listener in self._listening.pop(target, []):
                self._selector.unregister(listener)
                listener.close()
            for direction in [d for d in self._directions if d.target == target]:
                direction.queue.clear()
                self._close(direction)
            self.refused.pop(target, None)

    def _timeout(self) -> float:
        due = [d.queue[0][0] if not d.blocked else time.monotonic() + _BLOCKED_RETRY_S
               for d in self._directions if d.queue]
        # At least half a millisecond: a queue held back by the rate limit is due but must not spin. A sink that
        # took nothing is tried again after a while, not every turn: back-pressure may hold it for seconds.
        return max(0.0005, min(due) - time.monotonic()) if due else 0.05

    def _accept(self, listener, address, target) -> None:
        try:
            inbound, _ = listener.accept()
        except (BlockingIOError, ConnectionAbortedError):
            return
        try:
            outbound = socket.create_connection(address, timeout=_CONNECT_TIMEOUT_S)
        except OSError as exc:
            # The destination is gone (a lost executor, whose peers' ZeroMQ sockets keep reconnecting to its old
            # address): refuse this connection as the destination would, and keep relaying the others.
            if target not in self.refused:
                log.warning("link: %s refused a relayed connection (%s); refusing its connections", target, exc)
            self.refused[target] += 1       # counted before the close its peer sees
            inbound.close()
            return
        forward, backward = _Direction(inbound, outbound, target), _Direction(outbound, inbound, target)
        try:
            for s in (inbound, outbound):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.setblocking(False)
            forward.tokens = backward.tokens = self._burst
            self._directions += [forward, backward]
            self._selector.register(inbound, selectors.EVENT_READ, ("data", forward, target))
            self._selector.register(outbound, selectors.EVENT_READ, ("data", backward, target))
        except Exception:
            self._fail(forward)

    def _read(self, direction: _Direction) -> None:
        room = self.queue_limit - direction.queued
        if room <= 0:
            self._pause(direction)
            return
        try:
            data = direction.source.recv(min(_CHUNK, room))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            if not direction.queue:
                self._close(direction)
                return
            # The sender is done: what it sent still goes out (`_write` closes once the queue is empty).
            direction.closed = True
            self._pause(direction)
            return
        direction.queue.append((time.monotonic() + self.link.delay_s, data))
        direction.queued += len(data)
        self.queue_high_water = max(self.queue_high_water, direction.queued)
        if direction.queued >= self.queue_limit:
            self._pause(direction)

    def _pause(self, direction: _Direction) -> None:
        """The queue is full: stop reading its source (TCP then holds the sender back) until it drains."""
        if not direction.paused:
            self._selector.unregister(direction.source)
            direction.paused = True

    def _resume(self, direction: _Direction) -> None:
        if direction.source.fileno() >= 0 and direction.sink.fileno() >= 0:
            self._selector.register(direction.source, selectors.EVENT_READ, ("data", direction, direction.target))
        direction.paused = False

    def _write_due(self) -> None:
        now = time.monotonic()
        for direction in list(self._directions):
            try:
                self._write(direction, now)
            except Exception:
                self._fail(direction)

    def _write(self, direction: _Direction, now: float) -> None:
        if direction.sink.fileno() < 0:      # closed with its reverse direction this turn
            return
        while direction.queue and direction.queue[0][0] <= now:
            due, data = direction.queue[0]
            allowed = self._allowed(direction, now, len(data))
            if allowed == 0:
                break
            try:
                sent = direction.sink.send(data[:allowed])
            except BlockingIOError:
                direction.blocked = True
                break
            except OSError:
                self._close(direction)
                return
            direction.blocked = False
            self.bytes_relayed += sent
            if self._metering:
                self.bytes_metered += sent
            self.bytes_to[direction.target] += sent
            direction.tokens -= sent
            direction.queued -= sent
            if sent < len(data):
                direction.queue[0] = (due, data[sent:])
            else:
                direction.queue.popleft()
        if direction.closed and not direction.queue:
            self._close(direction)
        # Read again once half the bound is free: not at every byte written, which would read in crumbs.
        elif direction.paused and not direction.closed and direction.queued <= self.queue_limit // 2:
            self._resume(direction)

    def _allowed(self, direction: _Direction, now: float, wanted: int) -> int:
        if not self._metering:                # no limit, or the kernel's tbf sets the rate
            return wanted
        rate = self.link.bandwidth_bytes_per_s
        direction.tokens = min(self._burst, direction.tokens + (now - direction.stamp) * rate)
        direction.stamp = now
        return max(0, min(wanted, int(direction.tokens)))

    def _reset_all(self) -> None:
        """Reset every relayed connection (RST: SO_LINGER 0), dropping what waits in the queues (`cut`)."""
        import struct

        for direction in list(self._directions):
            direction.queue.clear()
            direction.queued = 0
            for s in (direction.source, direction.sink):
                if s.fileno() >= 0:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self._close(direction)
        self.cuts += 1
        self._cut.clear()

    def _close(self, direction: _Direction) -> None:
        for s in (direction.source, direction.sink):
            try:
                self._selector.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()
        self._directions = [d for d in self._directions if d.source.fileno() >= 0 and d.sink.fileno() >= 0]


def _drain(reader: socket.socket) -> None:
    try:
        while reader.recv(4096):
            pass
    except (BlockingIOError, OSError):
        pass


def _loopback_listener() -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    return listener
