"""Copies between compute threads (executor/direct_peers.py, executor/transfer_inbox.py), over real CURVE sockets on
loopback in one process: a copy sent from the sender's compute thread lands on the receiver's inbox, its
acknowledgement goes back where it came from, and the inbox is read by whichever thread holds it (the I/O thread only
when the lock is free: the compute thread sleeps on it while idle)."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from executor.direct_peers import DirectPeers
from executor.transfer_inbox import TransferInbox
from pathways_torch.wire import decode, encode, pb
from pathways_torch.wire.security import Gatekeeper, KeyDirectory

pytestmark = pytest.mark.timeout(60)


class _OnItsThread:
    """The sender's compute loop, as DirectPeers sees it: the caller is always on it."""

    def __init__(self):
        self.watched, self.held = set(), []

    def on_loop_thread(self) -> bool:
        return True

    def hold_while_idle(self, lock) -> None:
        self.held.append(lock)

    def watch(self, socket) -> None:
        self.watched.add(socket)

    def unwatch(self, socket) -> None:
        self.watched.remove(socket)

    def call_soon(self, fn) -> None:
        fn()


@pytest.fixture
def pair():
    keys = KeyDirectory.create(["e0", "e1"])
    context = zmq.Context()
    gatekeeper = Gatekeeper(context, keys.public_keys())
    received, replies = [], []
    inbox = TransferInbox(context, keys.credentials("e1"), "127.0.0.1", received.append)
    sender = DirectPeers(_OnItsThread(), context, keys.credentials("e0"), lambda address, f: replies.append((address, f)))
    yield sender, inbox, received, replies, keys.keypair("e1").public
    sender.close_all()
    inbox.close()
    gatekeeper.stop()
    context.term()
    keys.remove()


def _until(predicate, step, seconds=10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        step()
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_a_copy_lands_on_the_inbox_and_its_acknowledgement_returns_on_the_senders_socket(pair):
    sender, inbox, received, replies, receiver_key = pair
    transfer = pb.Transfer()
    transfer.shard.array_id = 7
    assert sender.send(inbox.address, encode(pb.Envelope(transfer=transfer)), receiver_key)
    assert _until(lambda: received, inbox.read)
    identity, (envelope, _) = received[0][0].bytes, decode(received[0][1:])
    assert envelope.transfer.shard.array_id == 7
    inbox.reply(identity, pb.Envelope(transfer_ack=pb.TransferAck(shard=envelope.transfer.shard)))
    inbox.read()                                                    # the queued reply leaves with the next read
    assert _until(lambda: replies, sender.read_replies)
    address, frames = replies[0]
    assert address == inbox.address and decode(frames)[0].transfer_ack.shard.array_id == 7
    assert sender.sent == 1 and sender.keys == {inbox.address: receiver_key}


def test_the_io_thread_reads_the_inbox_only_while_the_compute_thread_does_not_hold_it(pair):
    sender, inbox, received, _, receiver_key = pair
    assert sender.send(inbox.address, encode(pb.Envelope(transfer=pb.Transfer())), receiver_key)
    with inbox.lock:                                                # the compute thread sleeps in its poll
        held = threading.Thread(target=lambda: received.append(inbox.read(by_io=True)))
        held.start()
        held.join()
    assert received == [False] and inbox.read_by_io == 0           # the I/O thread left it alone
    received.clear()
    assert _until(lambda: received, lambda: inbox.read(by_io=True))   # a job runs: the I/O thread reads
    assert inbox.read_by_io == 1


def test_a_revoked_keys_connection_is_closed_and_a_later_send_opens_a_fresh_one(pair):
    sender, inbox, _, _, receiver_key = pair
    assert sender.send(inbox.address, encode(pb.Envelope(transfer=pb.Transfer())), receiver_key)
    assert len(sender._compute.watched) == 1                       # polled by the compute thread while idle
    sender.close_not_admitted(lambda key: key != receiver_key)
    assert sender.keys == {} and not sender._compute.watched
    assert sender.send(inbox.address, encode(pb.Envelope(transfer=pb.Transfer())), receiver_key)
    assert list(sender.keys.values()) == [receiver_key]
