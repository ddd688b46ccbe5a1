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
  veth pair with ``tc tbf`` on both ends (`pathways_torch.netns`) and listens inside it, on
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
from .errors import PathwaysError

__all__ = ["Link", "LinkRelay", "LinkShapingError", "SHAPINGS"]

log = logging.getLogger(__name__)

_CHUNK = 256 * 1024
# Loopback or the veth pair: a live destination answers at once, a gone one refuses at once. Short, since the relay
# thread waits it out (every direction holds meanwhile).
_CONNECT_TIMEOUT_S = 0.5
_BURST = 64 * 1024
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

    __slots__ = ("source", "sink", "queue", "tokens", "stamp", "closed")

    def __init__(self, source: socket.socket, sink: socket.socket):
        self.source, self.sink = source, sink
        self.queue: collections.deque = collections.deque()   # (due time, bytes)
        self.tokens, self.stamp, self.closed = 0.0, time.monotonic(), False


class LinkRelay:
    """The relay thread and its ports; `add` one port per destination address.

    ``shaping`` is what sets the rate ("tbf" or "relay"), ``shaping_reason`` why; ``veth`` the shaped pair
    (None with the relay's bucket). ``bytes_relayed`` counts every byte delivered to the executors' sockets,
    both directions (``bytes_to``: by destination address), ``bytes_metered`` those the relay's own token
    bucket let through (0 when tbf sets the rate)."""

    def __init__(self, link: Link):
        self.link = link
        rate = link.bandwidth_bytes_per_s
        self._burst = max(float(_BURST), rate * 0.002) if rate else float(_BURST)
        self.veth, self.shaping_reason = _shape(link, self._burst)
        self.shaping = "tbf" if self.veth is not None else "relay"
        self._metering = rate is not None and self.veth is None
        self.bytes_relayed = 0                                  # every byte written, both directions
        self.bytes_to: collections.Counter = collections.Counter()   # by destination address
        self.bytes_metered = 0
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._directions: list[_Direction] = []
        self._stopping = self._closed = False
        self._cut = threading.Event()          # set by `cut`, cleared by the relay thread once done
        self.cuts = 0
        self.refused: collections.Counter = collections.Counter()   # by target: connections it refused (gone)
        self._thread = threading.Thread(target=self._run, name="pathways-link", daemon=True)
        self._thread.start()

    def add(self, target: str) -> str:
        """Listen for ``target`` (``tcp://host:port``); return the address to send to instead: on loopback, or
        with tbf on the namespace's end of the veth pair (reached from the root namespace over the pair)."""
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        listener = self.veth.listen() if self.veth is not None else _loopback_listener()
        listener.setblocking(False)
        with self._lock:
            self._selector.register(listener, selectors.EVENT_READ, ("listen", (host, int(port)), target))
        listen_host, listen_port = listener.getsockname()[:2]
        return f"tcp://{listen_host}:{listen_port}"

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
        deadline = time.monotonic() + timeout_s
        while self._cut.is_set() and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = self._stopping = True
        self._thread.join(2.0)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._selector.close()
        if self.veth is not None:
            self.veth.close()          # after the sockets: each socket made in the namespace keeps it alive

    # ------------------------------------------------------------ the relay thread

    def _run(self) -> None:
        while not self._stopping:
            if self._cut.is_set():
                self._reset_all()
            with self._lock:
                events = self._selector.select(self._timeout())
            for key, _ in events:
                kind, *rest = key.data
                if kind == "listen":
                    self._accept(key.fileobj, *rest)
                else:
                    self._read(rest[0])
            self._write_due()

    def _timeout(self) -> float:
        due = [d.queue[0][0] for d in self._directions if d.queue]
        # At least half a millisecond: a queue held back by the rate limit is due but must not spin.
        return max(0.0005, min(due) - time.monotonic()) if due else 0.05

    def _accept(self, listener, address, target) -> None:
        try:
            inbound, _ = listener.accept()
        except BlockingIOError:
            return
        try:
            outbound = socket.create_connection(address, timeout=_CONNECT_TIMEOUT_S)
        except OSError as exc:
            # The destination is gone (a lost executor, whose peers' ZeroMQ sockets keep reconnecting to its old
            # address): refuse this connection as the destination would, and keep relaying the others.
            inbound.close()
            if target not in self.refused:
                log.warning("link: %s refused a relayed connection (%s); refusing its connections", target, exc)
            self.refused[target] += 1
            return
        for s in (inbound, outbound):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setblocking(False)
        forward, backward = _Direction(inbound, outbound), _Direction(outbound, inbound)
        forward.tokens = backward.tokens = self._burst
        self._directions += [forward, backward]
        self._selector.register(inbound, selectors.EVENT_READ, ("data", forward, target))
        self._selector.register(outbound, selectors.EVENT_READ, ("data", backward, target))

    def _read(self, direction: _Direction) -> None:
        try:
            data = direction.source.recv(_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(direction)
            return
        direction.queue.append((time.monotonic() + self.link.delay_s, data))

    def _write_due(self) -> None:
        now = time.monotonic()
        for direction in list(self._directions):
            while direction.queue and direction.queue[0][0] <= now:
                due, data = direction.queue[0]
                allowed = self._allowed(direction, now, len(data))
                if allowed == 0:
                    break
                try:
                    sent = direction.sink.send(data[:allowed])
                except BlockingIOError:
                    break
                except OSError:
                    self._close(direction)
                    break
                self.bytes_relayed += sent
                if self._metering:
                    self.bytes_metered += sent
                self._count(direction, sent)
                direction.tokens -= sent
                if sent < len(data):
                    direction.queue[0] = (due, data[sent:])
                else:
                    direction.queue.popleft()

    def _allowed(self, direction: _Direction, now: float, wanted: int) -> int:
        if not self._metering:                # no limit, or the kernel's tbf sets the rate
            return wanted
        rate = self.link.bandwidth_bytes_per_s
        direction.tokens = min(self._burst, direction.tokens + (now - direction.stamp) * rate)
        direction.stamp = now
        return max(0, min(wanted, int(direction.tokens)))

    def _count(self, direction: _Direction, sent: int) -> None:
        key = self._selector.get_key(direction.source) if direction.source.fileno() >= 0 else None
        if key is not None:
            self.bytes_to[key.data[2]] += sent

    def _reset_all(self) -> None:
        """Reset every relayed connection (RST: SO_LINGER 0), dropping what waits in the queues (`cut`)."""
        import struct

        for direction in list(self._directions):
            direction.queue.clear()
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


def _loopback_listener() -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    return listener
