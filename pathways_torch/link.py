"""A shaped link between islands: every transfer from one island to another passes a relay that delays
and rate-limits it, and counts its bytes.

Tests and benchmarks need the inter-island network to be slower than the inside of an
island, on one machine and without privileges (``tc netem`` is not installed here, and
network namespaces need root). `LinkRelay` is a user-space TCP relay: one listening port
per executor on loopback, forwarding to that executor's data address. Executors of other
islands are told to send there (`ResourceManager` link addresses), so a cross-island
transfer crosses it and an in-island one never does. ZeroMQ's CURVE handshake and
encryption pass through untouched: the relay moves bytes it cannot read.

Shaping is per direction of each connection: a chunk read at time t is written no earlier
than ``t + delay_s``, and writes draw from a token bucket of ``bandwidth_bytes_per_s``
(burst: 2 ms of the rate, at least 64 KiB: a smaller bucket would cap fast links at what
one wake-up of the relay thread can write), so a transfer of n bytes takes about
``delay_s + n / bandwidth``.
"""

from __future__ import annotations

import collections
import dataclasses
import selectors
import socket
import threading
import time

__all__ = ["Link", "LinkRelay"]

_CHUNK = 256 * 1024
_BURST = 64 * 1024


@dataclasses.dataclass(frozen=True)
class Link:
    """How the link between islands is shaped: a one-way delay and a bandwidth (None: unlimited)."""

    delay_s: float = 0.0
    bandwidth_bytes_per_s: float | None = None

    def __post_init__(self):
        if self.delay_s < 0:
            raise ValueError(f"Link: delay_s must be >= 0, got {self.delay_s!r}")
        if self.bandwidth_bytes_per_s is not None and not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"Link: bandwidth_bytes_per_s must be positive or None, got "
                             f"{self.bandwidth_bytes_per_s!r}")

    def describe(self) -> str:
        rate = (f"{self.bandwidth_bytes_per_s / 1e6:g} MB/s" if self.bandwidth_bytes_per_s else "unlimited rate")
        return f"relayed, {self.delay_s * 1e3:g} ms one-way, {rate}"


class _Direction:
    """Bytes read from one socket, waiting to be written to the other."""

    __slots__ = ("source", "sink", "queue", "tokens", "stamp", "closed")

    def __init__(self, source: socket.socket, sink: socket.socket):
        self.source, self.sink = source, sink
        self.queue: collections.deque = collections.deque()   # (due time, bytes)
        self.tokens, self.stamp, self.closed = 0.0, time.monotonic(), False


class LinkRelay:
    """The relay thread and its ports; `add` one port per destination address."""

    def __init__(self, link: Link):
        self.link = link
        rate = link.bandwidth_bytes_per_s
        self._burst = max(float(_BURST), rate * 0.002) if rate else float(_BURST)
        self.bytes_relayed = 0                                  # every byte written, both directions
        self.bytes_to: collections.Counter = collections.Counter()   # by destination address
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._directions: list[_Direction] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="pathways-link", daemon=True)
        self._thread.start()

    def add(self, target: str) -> str:
        """Listen on loopback for ``target`` (``tcp://host:port``); return the address to send to instead."""
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        listener.setblocking(False)
        with self._lock:
            self._selector.register(listener, selectors.EVENT_READ, ("listen", (host, int(port)), target))
        return f"tcp://127.0.0.1:{listener.getsockname()[1]}"

    def close(self) -> None:
        self._stopping = True
        self._thread.join(2.0)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._selector.close()

    # ------------------------------------------------------------ the relay thread

    def _run(self) -> None:
        while not self._stopping:
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
        outbound = socket.create_connection(address)
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
                self._count(direction, sent)
                direction.tokens -= sent
                if sent < len(data):
                    direction.queue[0] = (due, data[sent:])
                else:
                    direction.queue.popleft()

    def _allowed(self, direction: _Direction, now: float, wanted: int) -> int:
        rate = self.link.bandwidth_bytes_per_s
        if rate is None:
            return wanted
        direction.tokens = min(self._burst, direction.tokens + (now - direction.stamp) * rate)
        direction.stamp = now
        return max(0, min(wanted, int(direction.tokens)))

    def _count(self, direction: _Direction, sent: int) -> None:
        key = self._selector.get_key(direction.source) if direction.source.fileno() >= 0 else None
        if key is not None:
            self.bytes_to[key.data[2]] += sent

    def _close(self, direction: _Direction) -> None:
        for s in (direction.source, direction.sink):
            try:
                self._selector.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()
        self._directions = [d for d in self._directions if d.source.fileno() >= 0 and d.sink.fileno() >= 0]
