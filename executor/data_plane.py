"""The data plane: tensor bytes in and out of this executor's store, never through the controller.

Clients put shards and fetch them; executors push copies to each other (`on_send_shard` → `_push`,
acknowledged by the receiver, reported lost past a deadline: `check_transfers`); a client asks for
shards to be written to disk (`_on_save`). A copy is tagged with the call that consumes it and may
arrive before that call's Run (another connection): it is kept as an *early* transfer, within bounds,
until the Run claims it (`accept_run`) or a later Run shows it late.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable

from pathways_torch.errors import TRANSFER_LOST
from pathways_torch.wire import pb
from pathways_torch.wire.checkpoint_paths import CheckpointPathError
from pathways_torch.wire.framing import body_name
from pathways_torch.wire.tensors import frame_to_tensor

from .data_roles import DataGate, OwnerCheck
from .messages import Outbox, remote_failure, shard_key
from .shard_writer import ShardWriter
from .store import ObjectStore
from .trace import TraceRecorder

__all__ = ["DataPlane"]

log = logging.getLogger(__name__)

_TRANSFER_TIMEOUT_S = 20.0        # until Welcome says (the controller's transfer_timeout_s)
_SLOWEST_LINK = 1e6               # bytes/s: a transfer's deadline allows this slow a link
_MAX_EARLY_TRANSFERS = 4096
# Service clients' puts that came before the controller's Welcome (its put secret) wait for it, this many at most
# (past them a put is refused, and its client told): a client can reach an executor as soon as it registered.
_MAX_EARLY_PUTS = 1024
_MAX_REFUSED_EARLY = 65536


class DataPlane:
    """Puts, transfers, fetches and saves of one executor's store."""

    def __init__(self, *, executor_id: str, backend, store: ObjectStore, outbox: Outbox, trace: TraceRecorder,
                 counters: collections.Counter, drop: Callable[[str], None]):
        self.executor_id = executor_id
        self.backend = backend
        self.store = store
        self.outbox = outbox
        self.trace = trace
        self.counters = counters        # the core's, reported with Stats
        self._drop = drop               # counts and logs a dropped message (the core's count)
        self.hop_bytes: collections.Counter = collections.Counter()
        self._last_run_call_id = 0      # Runs arrive in call-id order: a transfer tagged at or below it is late
        self._early: set[tuple] = set()  # transfers that arrived before their Run (another connection)
        # Early transfers refused for want of room (past _MAX_EARLY_TRANSFERS): their Run fails at once rather
        # than waiting forever for a copy that came and went. Bounded, oldest forgotten first.
        self._refused_early: collections.OrderedDict = collections.OrderedDict()
        self.writer = ShardWriter()      # checkpoint shards, on a thread of its own
        self.epoch = 0                   # this incarnation of the executor id (from Welcome)
        # Transfers sent and not yet acknowledged: (to address, copy key) → (deadline, copy ref, bytes, sent at).
        self.unacked: dict[tuple, tuple] = {}
        self.transfer_timeout_s = _TRANSFER_TIMEOUT_S   # from Welcome
        self.transfers_lost = 0
        self.data_gate = DataGate()      # who may send what on the data socket
        self.owners = OwnerCheck()       # whose arrays a client may put, fetch and save (its secret: from Welcome)
        self._early_puts: list = []      # (identity, Put, payload, role) that came before the Welcome
        # (invite, role, key) -> None: a peer offers a shared-memory ring with a copy (executor/host_rings.py)
        self.on_ring_invite: Callable | None = None

    def welcomed(self) -> None:
        """The controller's Welcome (and its put secret) came: the puts that arrived before it are taken now."""
        early, self._early_puts = self._early_puts, []
        for identity, msg, payload, role in early:
            self._on_put(identity, msg, payload, role)

    def on_data(self, identity: bytes, envelope: pb.Envelope, payload: list, *, role: str | None,
                key: bytes | None = None, reply=None) -> None:
        """A put, transfer or fetch sent with a key of ``role`` (its connection's User-Id); one whose handling raises
        still ends its request (never a silent drop). One from a sender its kind does not admit (`DataGate`) is
        dropped unanswered: it came from no one we would answer."""
        if self.refuses(role, envelope, key):
            return
        kind = body_name(envelope)
        handlers = {"put": lambda: self._on_put(identity, envelope.put, payload, role),
                    "transfer": lambda: self._on_peer_copy(envelope.transfer, payload, identity, reply, role, key),
                    "fetch": lambda: self._on_fetch(identity, envelope.fetch, role),
                    "save_shards": lambda: self._on_save(identity, envelope.save_shards, role)}
        if kind not in handlers:
            self._drop(f"data message of type {kind!r} not expected")
            return
        self.counters[f"handled:data:{kind}"] += 1
        try:
            handlers[kind]()
        except Exception as exc:
            self._refuse_data(identity, kind, getattr(envelope, kind), exc)

    def refuses(self, role: str | None, envelope: pb.Envelope, key: bytes | None = None) -> bool:
        """Whether the data socket's ``envelope`` from a key of ``role`` is refused (`DataGate`): counted and dropped
        unanswered if so."""
        refused = self.data_gate.refusal(role, envelope, key)
        if refused:
            self.counters["refused_data_messages"] += 1
            self._drop(refused)
        return bool(refused)

    def _refuse_data(self, identity: bytes, kind: str, msg, exc: BaseException) -> None:
        """Handling a data message raised: answer the client's request with the failure, or fail the run
        waiting for a transfer (its copy could not be kept), so no future waits for it."""
        self._drop(f"{kind} refused: {exc}")
        failure = remote_failure(exc, self.executor_id, origin_call_id=msg.shard.tag if kind == "transfer" else 0)
        if kind == "put":
            ack = pb.PutAck(request_id=msg.request_id, failed=True, failure=failure)
            ack.shard.CopyFrom(msg.shard)
            self.outbox.to_client(identity, pb.Envelope(put_ack=ack))
        elif kind == "fetch":
            reply = pb.FetchReply(request_id=msg.request_id, failed=True, failure=failure)
            self.outbox.to_client(identity, pb.Envelope(fetch_reply=reply))
        elif kind == "save_shards":
            reply = pb.SaveReply(request_id=msg.request_id, failed=True, failure=failure)
            self.outbox.to_client(identity, pb.Envelope(save_reply=reply))
        elif self._expects_transfer(shard_key(msg.shard)):
            self.store.fill(shard_key(msg.shard), failure=failure)

    # ------------------------------------------------------------ into the store

    def _on_put(self, identity: bytes, msg: pb.Put, payload, role: str | None) -> None:
        if self.owners.awaits_secret(role) and len(self._early_puts) < _MAX_EARLY_PUTS:
            self._early_puts.append((identity, msg, payload, role))   # taken once the Welcome comes (`welcomed`)
            return
        ack = pb.PutAck(request_id=msg.request_id)
        ack.shard.CopyFrom(msg.shard)
        items = (msg, *msg.more)
        # Every shard is the sender's to put, exactly as its token says, or none is stored.
        refused = self.owners.admit_put(role, items, entry_of=lambda item: self.store.get(shard_key(item.shard)),
                                        nbytes_of=lambda item: _frame_bytes(payload, item.tensor.frame),
                                        executor_id=self.executor_id, epoch=self.epoch)
        if refused:
            self.counters["refused_not_owner"] += 1
            self.counters["refused_data_messages"] += 1
            self._drop(refused)
            ack.failed = True
            ack.failure.CopyFrom(pb.RemoteFailure(type="PermissionError", message=refused,
                                                  executor_id=self.executor_id))
            self.outbox.to_client(identity, pb.Envelope(put_ack=ack))
            return
        owner = self.owners.as_owner(role)
        for item in items:
            try:
                tensor = self.backend.from_frame(item.tensor, payload)
            except Exception as exc:   # a frame that does not match its header: the put fails, and says why
                self._drop(f"put {msg.request_id} refused: {exc}")   # nothing is stored: still a dropped message
                ack.failed = True
                ack.failure.CopyFrom(remote_failure(exc, self.executor_id, origin_call_id=0))
                break
            self.hop_bytes["client->executor"] += tensor.nbytes
            if owner:   # a service client's put (its token checked): the array is its own here from now on
                self.store.claim(shard_key(item.shard), owned=True).owner = owner
            self.store.fill(shard_key(item.shard), tensor)
        self.outbox.to_client(identity, pb.Envelope(put_ack=ack))

    def spend_puts(self, spent_puts) -> None:
        """A Free's spent put tokens (`pb.SpentPut`): their arrays are gone, so none of them may store anything."""
        self.owners.spend(spent_puts)

    def _on_peer_copy(self, msg: pb.Transfer, payload, identity: bytes, reply, role: str | None,
                      key: bytes | None) -> None:
        """A peer's copy; one carrying a ring invite is answered too (`on_ring_invite`), with the role and key it
        came with: what comes through that ring is admitted as that peer's."""
        if msg.HasField("ring_invite") and self.on_ring_invite is not None:
            self.on_ring_invite(msg.ring_invite, role, key)
        self.on_transfer(msg, payload, identity, reply)

    def on_transfer(self, msg: pb.Transfer, payload, identity: bytes | None = None, reply=None) -> None:
        """A copy from a peer (``identity`` its connection; ``reply(identity, envelope)`` acknowledges it where it
        came: the transfer inbox, or by default the data socket), or the controller's failed copy (no identity)."""
        key = shard_key(msg.shard)
        if not self._expects_transfer(key):
            self._drop(f"transfer of array {key[0]} shard {key[1]} for call {key[2]}: no run waits for it")
            return
        if msg.failed:
            self.store.fill(key, failure=msg.failure)
            if identity is None and msg.failure.type == TRANSFER_LOST:
                # A copy the sender's link lost, which a run here did wait for: say so (the controller abandons the
                # island's groups only then; a copy that had arrived lost only its acknowledgement).
                confirm = pb.TransferLost(shard=msg.shard, missing=True, failure=msg.failure)
                self.outbox.to_controller(pb.Envelope(transfer_lost=confirm))
        else:
            tensor = self.backend.from_frame(msg.tensor, payload)
            self.hop_bytes["executor->executor received"] += tensor.nbytes
            self.trace.record("receive", "transfer", call_id=msg.shard.tag, detail=f"array {msg.shard.array_id}")
            self.store.fill(key, tensor)
        if identity is not None:   # from a peer (not the controller's failed copy), and kept: say so
            ack = pb.TransferAck()
            ack.shard.CopyFrom(msg.shard)
            (reply or self.outbox.to_client)(identity, pb.Envelope(transfer_ack=ack))

    # ------------------------------------------------------------ out of the store

    def _on_fetch(self, identity: bytes, msg: pb.Fetch, role: str | None) -> None:
        key = shard_key(msg.shard)
        entry = self.store.get(key)
        if entry is None or not self.owners.reads(role, entry):
            # Another client's shard is answered as one never held here: its owner is not revealed.
            reply = pb.FetchReply(request_id=msg.request_id, failed=True)
            reply.failure.CopyFrom(pb.RemoteFailure(
                type="KeyError", executor_id=self.executor_id,
                message=f"executor {self.executor_id} holds no shard {msg.shard.shard} of array {msg.shard.array_id}"))
            self.outbox.to_client(identity, pb.Envelope(fetch_reply=reply))
            return
        self.store.claim(key, pin=True)
        self.store.when_ready(key, lambda entry: self._reply_fetch(identity, msg, key, entry))

    def _reply_fetch(self, identity: bytes, msg: pb.Fetch, key: tuple, entry) -> None:
        reply = pb.FetchReply(request_id=msg.request_id)
        payload = self._shard_frames(reply, entry, "executor->client")
        self.outbox.to_client(identity, pb.Envelope(fetch_reply=reply), payload)
        self.store.unpin(key)

    def _on_save(self, identity: bytes, msg: pb.SaveShards, role: str | None) -> None:
        """Write shards of this store to one file, once each is ready (checkpoints written by the executors). Where
        is checked first (`ShardWriter.target`: a service client's under its own folder of the checkpoint root)."""
        try:
            target = self.writer.target(role, msg.path)
        except ValueError:   # refused before a byte is written: the client is told why (`_refuse_data`)
            self.counters["refused_checkpoint_paths"] += 1
            raise
        if len(msg.names) != len(msg.shards) or len(set(msg.names)) != len(msg.names):
            raise ValueError(f"save: expected one distinct name per shard, got {len(msg.names)} names for "
                             f"{len(msg.shards)} shards")
        keys = [shard_key(ref) for ref in msg.shards]
        absent = [k for k in keys if (e := self.store.get(k)) is None or not self.owners.reads(role, e)]
        if absent:
            raise KeyError(f"executor {self.executor_id} holds no shard {absent[0][1]} of array {absent[0][0]}")
        tensors: dict = {}

        def ready(name: str, key: tuple, entry) -> None:
            if name in tensors:
                return
            if entry.failure is not None:
                tensors[name] = entry.failure
            else:   # a host copy: the store may free the shard at once, the write takes its time
                meta = pb.TensorMeta()
                frame = self.backend.to_frame(entry.value, meta, 1)
                tensors[name] = frame_to_tensor(meta, [frame]).clone()
            self.store.unpin(key)
            if len(tensors) == len(keys):
                self._write_shards(identity, msg, tensors, target)

        # The span covers the wait for the shards, their host copy and the write (the request is the save's start).
        # The trace is every client's to read: a service client's path is not shown (`SaveTarget.shown`).
        self.trace.record("save_start", "save shards", call_id=msg.request_id, detail=target.shown)
        for name, key in zip(msg.names, keys):
            self.store.claim(key, pin=True)
        for name, key in zip(msg.names, keys):
            self.store.when_ready(key, lambda entry, name=name, key=key: ready(name, key, entry))

    def _write_shards(self, identity: bytes, msg: pb.SaveShards, tensors: dict, target) -> None:
        failed = next((t for t in tensors.values() if isinstance(t, pb.RemoteFailure)), None)
        if failed is not None:   # a shard that never came: its producer's failure is the save's
            reply = pb.SaveReply(request_id=msg.request_id, failed=True, failure=failed)
            self.trace.record("save_end", "save shards", call_id=msg.request_id, detail="failed")
            self.outbox.to_client(identity, pb.Envelope(save_reply=reply))
            return

        def done(nbytes: int, error) -> None:   # on the writer thread; the outbox is safe from any thread
            reply = pb.SaveReply(request_id=msg.request_id, bytes=nbytes)
            if error is not None:
                reply.failed = True
                reply.failure.CopyFrom(remote_failure(error, self.executor_id, origin_call_id=0))
                if isinstance(error, CheckpointPathError):   # a link met while writing: refused as a path too
                    self.counters["refused_checkpoint_paths"] += 1
            shown = f" -> {target.shown}" if target.shown else ""
            self.trace.record("save_end", "save shards", call_id=msg.request_id,
                              detail=f"{len(tensors)} shards, {nbytes} B{shown}")
            self.outbox.to_client(identity, pb.Envelope(save_reply=reply))

        self.hop_bytes["executor->disk"] += sum(t.numel() * t.element_size() for t in tensors.values())
        self.writer.write(target, tensors, done)

    # ------------------------------------------------------------ to peers

    def on_send_shard(self, msg: pb.SendShard, payload) -> None:
        """Push a shard to a peer once it is ready here (the controller's request, or a program run's send)."""
        key = shard_key(msg.shard)
        self.store.claim(key, pin=True)
        self.store.when_ready(key, lambda entry: self._push(msg, key, entry))

    def _shard_frames(self, message, entry, hop: str) -> list:
        """A stored shard into a reply or a transfer (``message``: its ``tensor`` header, or ``failed`` and the
        failure); the frames to send with it, counted on ``hop``."""
        if entry.failure is not None:
            message.failed = True
            message.failure.CopyFrom(entry.failure)
            return []
        frames = [self.backend.to_frame(entry.value, message.tensor, 1)]
        self.hop_bytes[hop] += entry.nbytes
        return frames

    def _push(self, msg: pb.SendShard, key: tuple, entry) -> None:
        transfer = pb.Transfer()
        transfer.shard.CopyFrom(msg.as_ref)
        payload = self._shard_frames(transfer, entry, "executor->executor")
        self.trace.record("send", "transfer", call_id=msg.call_id, detail=f"array {msg.shard.array_id} -> {msg.to_address}")
        nbytes = 0 if entry.failure is not None else entry.nbytes
        now = time.monotonic()
        # The epoch names this incarnation: once it is replaced, the receiver refuses what it still sends.
        # To a transfer inbox (a copy inside the island) it may leave from the compute thread, through a shared-memory
        # ring to a peer of this host; over a link it goes through the I/O thread (a relayed link's copies sent from
        # the compute thread were seen held back past a cut and delivered seconds later, where through the I/O
        # thread they were lost: not understood yet).
        by_ring = self.outbox.to_peer(msg.to_address, pb.Envelope(transfer=transfer, epoch=self.epoch), payload,
                                      msg.to_public_key, direct=msg.to_inbox, tag=(msg.as_ref, nbytes, now))
        if not by_ring:   # acknowledged when it lands; a link may take a while for big shards (1 MB/s at worst)
            self.unacked[(msg.to_address, shard_key(msg.as_ref))] = (
                now + self.transfer_timeout_s + nbytes / _SLOWEST_LINK, msg.as_ref, nbytes, now)
        self.store.unpin(key)

    def report_ring_lost(self, address: str, tags: list) -> None:
        """Copies a broken shared-memory ring did not deliver (``tags``: (ref, bytes, sent at) each): reported to the
        controller as a copy not acknowledged in time is, so the runs waiting for them fail."""
        now = time.monotonic()
        for ref, nbytes, sent_at in tags:
            self._report_lost(address, ref, nbytes, sent_at, now)

    def on_peer_reply(self, address: str, envelope: pb.Envelope) -> None:
        """A message back on the connection to a peer: the acknowledgement of a transfer we sent it."""
        if body_name(envelope) != "transfer_ack":
            self._drop(f"{body_name(envelope)!r} from the peer at {address}")
            return
        self.unacked.pop((address, shard_key(envelope.transfer_ack.shard)), None)

    def check_transfers(self, now: float) -> None:
        """Report each transfer not acknowledged by its deadline (run every second): the controller fails the run
        that waits for it, which would otherwise wait forever (a frame lost on a cut link)."""
        expired = [k for k, (deadline, *_rest) in self.unacked.items() if deadline <= now]
        for address, key in expired:
            _, ref, nbytes, sent_at = self.unacked.pop((address, key))
            log.warning("%s: the transfer of array %d shard %d to %s was not acknowledged within %.0f s",
                        self.executor_id, ref.array_id, ref.shard, address, now - sent_at)
            self._report_lost(address, ref, nbytes, sent_at, now)

    def _report_lost(self, address: str, ref: pb.ShardRef, nbytes: int, sent_at: float, now: float) -> None:
        """Tell the controller a copy to ``address`` was lost (it fails the run that waits for it)."""
        self.transfers_lost += 1
        lost = pb.TransferLost(to_address=address, waited_s=now - sent_at, nbytes=nbytes)
        lost.shard.CopyFrom(ref)
        self.outbox.to_controller(pb.Envelope(transfer_lost=lost))

    # ------------------------------------------------------------ copies and their Runs

    def accept_run(self, input_keys: list, output_keys: list, last_call_id: int, owner: str = "",
                   donated=(), budgets=()) -> None:
        """A run's inputs are pinned until it ends, its outputs owned until freed; copies for calls
        up to ``last_call_id`` that arrive from now on are late. ``owner``: the role of the client whose run it
        is (the controller's word), which its outputs and the copies made for it belong to. ``donated``: input
        positions the client gave up with the run, freed now (the run alone holds them: `ObjectStore.hand_over`).
        ``budgets``: per output key, the bytes the controller counts for it (None: unchecked); empty: no limit."""
        owner = self.owners.as_owner(owner)
        for key in input_keys:
            entry = self.store.claim(key, pin=True)
            if owner and key[2]:   # a copy of one of the run's inputs: the run's client's, as its array is
                entry.owner = owner
            if self._refused_early and key in self._refused_early:
                self.store.fill(key, failure=self._refused_early.pop(key))
        for position in donated:
            if position < len(input_keys):
                self.store.free(input_keys[position])
        for key in output_keys:
            entry = self.store.claim(key, owned=True)
            if owner:
                entry.owner = owner
        if budgets:   # checked as the outputs are stored (`executor.output_budget`)
            for key, budget in zip(output_keys, budgets):
                self.store.get(key).budget = budget
        self._last_run_call_id = max(self._last_run_call_id, last_call_id)
        if self._early:
            self._forget_early(last_call_id)

    def _expects_transfer(self, key: tuple) -> bool:
        """Whether a transfer for ``key`` fills a copy a run waits for (or may soon wait for).

        A copy is tagged with its consuming call. Its Run may arrive after it (the
        copy comes on another connection), but Runs arrive in call-id order: once
        a later Run has come, an unclaimed copy is late or bogus, and is refused
        rather than kept forever.
        """
        entry = self.store.get(key)
        if entry is not None:
            return not entry.ready
        if key[2] <= self._last_run_call_id:
            return False
        if len(self._early) >= _MAX_EARLY_TRANSFERS:
            self._refuse_early(key)
            return False
        self._early.add(key)
        return True

    def _refuse_early(self, key: tuple) -> None:
        """Remember a refused early copy, so that its Run fails (with this reason) instead of waiting for it."""
        self._refused_early[key] = pb.RemoteFailure(
            type="TransferRefused", executor_id=self.executor_id, origin_call_id=key[2],
            message=f"executor {self.executor_id} refused the copy of array {key[0]} shard {key[1]} for call "
                    f"{key[2]}: it arrived before its Run with {_MAX_EARLY_TRANSFERS} early copies already kept")
        while len(self._refused_early) > _MAX_REFUSED_EARLY:
            self._refused_early.popitem(last=False)

    def _forget_early(self, call_id: int) -> None:
        """Release early copies for calls up to ``call_id``: their Run has come and pinned what it needs."""
        for key in [k for k in self._early if k[2] <= call_id]:
            self._early.discard(key)
            self.store.free(key)


def _frame_bytes(payload: list, frame: int) -> int:
    """The bytes of frame ``frame`` (1-based) of a message's ``payload``; -1 if it has none."""
    if not 1 <= frame <= len(payload):
        return -1
    data = payload[frame - 1]
    return (data.buffer if hasattr(data, "buffer") else memoryview(data)).nbytes
