"""An executor's shared-memory rings to and from the peers of its host, on its compute thread (executor/shm_ring.py
says how a ring is offered, made and checked).

- Out: a copy to a peer with a ring goes into it (`send`); one to a peer without is sent over ZeroMQ, carrying an
  invite (`invite_for`) for its first `MAX_INVITES` copies: a peer on this host answers with a ring, one elsewhere
  cannot, and stays on ZeroMQ.
- In: an invite read with a copy makes a ring back (`on_invite`); its messages are handed to ``on_message(envelope
  bytes, frames, role, key)`` with the role and key of the connection the invite came on, so the data plane admits
  them exactly as it would that peer's copies over ZeroMQ (a revoked key's ring messages are refused too).
- The compute thread polls `fds` while idle, asks `before_sleep` whether it may sleep, and calls `service` between
  jobs: rings that came back are taken, waiting copies flushed, committed ones read.

A ring copy needs no acknowledgement: once committed it is in the receiver's memory, and a receiver that dies is
declared lost by the controller, which fails what waited on it.
"""

from __future__ import annotations

import logging
import os

from pathways_torch.wire import pathways_pb2 as pb

from .ring_offers import RingInviter, make_ring_for
from .shm_ring import RingReader, RingWriter

__all__ = ["HostRings", "MAX_INVITES", "RINGS_ENV", "rings_enabled"]

log = logging.getLogger(__name__)

MAX_INVITES = 4   # copies to a peer that carry an invite before it counts as on another host
MAX_RINGS_IN = 64   # rings made for peers at most (each holds RING_BYTES of memory): more invites are not answered
RINGS_ENV = "PATHWAYS_SHM_RINGS"


def rings_enabled() -> bool:
    """Whether copies inside a host go through shared-memory rings (unless the environment says ``0``: to measure
    what they change; copies then go over ZeroMQ as between hosts)."""
    return os.environ.get(RINGS_ENV, "1") != "0"


class HostRings:
    """The compute thread's rings (all methods on it), for the executor incarnation ``epoch``."""

    def __init__(self, epoch: int, on_message, *, on_lost, watch, unwatch):
        self._epoch = epoch
        self._on_message = on_message
        self._on_lost = on_lost   # (address, tags) -> None: copies a broken ring did not deliver (reported lost)
        self._watch, self._unwatch = watch, unwatch
        self._inviter = RingInviter(epoch)
        watch(self._inviter.socket)
        self._writers: dict[str, RingWriter] = {}
        self._readers: dict[RingReader, bytes | None] = {}   # each with the key of the connection its invite came on
        self._invites_sent: dict[tuple[str, bytes], int] = {}   # (address, key) -> invites sent
        self._answered: set[bytes] = set()     # tokens of invites this executor made a ring for
        self._keys: dict[str, bytes] = {}       # peer address -> the key its copies are sent for now
        self._gone_received = self._gone_refused = 0   # what closed readers had counted
        self.counters = {"ring_copies_sent": 0, "rings_out": 0, "rings_in": 0, "ring_copies_lost": 0}

    # ------------------------------------------------------------ out

    def send(self, address: str, envelope: pb.Envelope, payload: list, public_key: bytes, tag=None) -> bool:
        """Write a copy to ``address`` into its ring; False if there is none (send it over ZeroMQ). A peer there
        with another key than the ring's (a replacement at the same address) gets no more through that ring (its
        copies were the replaced incarnation's) and is offered a fresh one. ``tag``: what `on_lost` reports if a
        broken ring does not deliver it."""
        if self._keys.get(address) != public_key:
            self.forget(address)
            self._keys[address] = public_key
        writer = self._writers.get(address)
        if writer is None:
            return False
        if writer.broken:
            self._give_up(address)
            return False
        writer.send(envelope.SerializeToString(), payload, tag)
        self.counters["ring_copies_sent"] += 1
        return True

    def invite_for(self, address: str, public_key: bytes) -> pb.RingInvite | None:
        """The invite a ZeroMQ copy to ``address`` carries, while one may still be answered."""
        peer = (address, public_key)
        if address in self._writers or self._invites_sent.get(peer, 0) >= MAX_INVITES:
            return None
        self._invites_sent[peer] = self._invites_sent.get(peer, 0) + 1
        name, token = self._inviter.invite(address, public_key)
        return pb.RingInvite(socket=name, token=token, writer_epoch=self._epoch)

    def forget(self, address: str) -> None:
        """The peer at ``address`` was replaced or is gone: its ring is closed, its offers withdrawn (what was in
        the ring was the replaced incarnation's, whose loss already failed what waited on it)."""
        writer = self._writers.pop(address, None)
        if writer is not None:
            self._close_writer(writer)
        key = self._keys.pop(address, None)
        if key is not None:
            self._inviter.forget(address, key)
            self._invites_sent.pop((address, key), None)

    def _give_up(self, address: str) -> None:
        """A broken ring to a live peer: what it had not delivered is reported lost (the runs waiting for it fail
        instead of waiting forever); later copies go over ZeroMQ."""
        writer = self._writers.pop(address)
        lost = writer.unread()
        self._close_writer(writer)
        log.warning("the ring to %s broke (%s): %d copies reported lost", address, writer.broken, len(lost))
        self.counters["ring_copies_lost"] += len(lost)
        if lost:
            self._on_lost(address, lost)

    def _close_writer(self, writer: RingWriter) -> None:
        self._unwatch(writer.ring.space_fd)
        writer.ring.close()

    # ------------------------------------------------------------ in

    def on_invite(self, invite: pb.RingInvite, role: str | None, key: bytes | None) -> None:
        """An invite read with a copy: answer it with a ring (once), if its inviter is on this host."""
        if bytes(invite.token) in self._answered or len(self._readers) >= MAX_RINGS_IN or \
                len(self._answered) >= 64 * MAX_RINGS_IN:   # a peer that invites without end is not answered
            return
        self._answered.add(bytes(invite.token))
        ring = make_ring_for(bytes(invite.socket), bytes(invite.token), invite.writer_epoch, self._epoch)
        if ring is None:
            return
        reader = RingReader(ring, lambda envelope, frames: self._on_message(envelope, frames, role, key))
        self._readers[reader] = key
        self._watch(ring.data_fd)
        self.counters["rings_in"] += 1

    # ------------------------------------------------------------ the compute thread's turns

    def service(self) -> None:
        """Take rings that came back, flush waiting copies, read committed ones."""
        for address, key, ring in self._inviter.take():
            if self._keys.get(address) != key or address in self._writers:   # for an incarnation gone since
                ring.close()
                continue
            self._writers[address] = RingWriter(ring)
            self._watch(ring.space_fd)
            self.counters["rings_out"] += 1
        for address, writer in list(self._writers.items()):
            if writer.waiting:
                writer.flush()
            if not writer.check():
                self._give_up(address)
        for reader in list(self._readers):
            reader.read()
            if reader.broken:
                self._drop_reader(reader)

    def counts(self) -> dict[str, int]:
        """The counters, with what the readers received and refused (read for Stats, on another thread: a snapshot
        of the readers, taken at once under the GIL)."""
        readers = list(self._readers)
        return {**self.counters, "ring_copies_received": self._gone_received + sum(r.received for r in readers),
                "ring_messages_refused": self._gone_refused + sum(r.refused for r in readers)}

    def before_sleep(self) -> bool:
        """Whether the compute thread may sleep: every reader is asked to be woken (False if one has a message).
        Each writer's wake-up is taken first (a late one would keep the poll from sleeping)."""
        for writer in self._writers.values():
            writer.flush() if writer.waiting else writer.ring.drain(writer.ring.space_fd)
        may = True
        for reader in self._readers:
            if not reader.sleep():
                may = False
        return may

    def awake(self) -> None:
        for reader in self._readers:
            reader.awake()

    def drop_not_admitted(self, admits) -> None:
        """Close the rings of replaced incarnations (their keys, ``admits(key)`` False, were revoked)."""
        for address in [a for a, key in self._keys.items() if key and not admits(key)]:
            self.forget(address)
        for reader in [r for r, key in self._readers.items() if key and not admits(key)]:
            self._drop_reader(reader)

    def _drop_reader(self, reader: RingReader) -> None:
        del self._readers[reader]
        self._gone_received += reader.received
        self._gone_refused += reader.refused
        self._unwatch(reader.ring.data_fd)
        reader.ring.close()

    def close(self) -> None:
        for address in list(self._keys):
            self.forget(address)
        for reader in list(self._readers):
            self._drop_reader(reader)
        self._unwatch(self._inviter.socket)
        self._inviter.close()
