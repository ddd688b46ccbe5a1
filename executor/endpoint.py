"""What an executor does with the frames its sockets receive: decode them, check who sent them, hand them to its
`ExecutorCore`.

Shared by the executor process (which calls these under its core lock, from the thread that read the frames) and
the simulating host's executors (all on one loop thread). Imports no torch.
"""

from __future__ import annotations

import logging
import time

from pathways_torch.wire import body_name, decode, encode, pb
from pathways_torch.wire.framing import FramingError
from pathways_torch.wire.security import CONTROLLER, peer_key, peer_role

__all__ = ["CoreEndpoint"]

log = logging.getLogger(__name__)


class CoreEndpoint:
    """Mixed into an executor host: it has ``core`` (`ExecutorCore`), ``outbox`` (`SocketOutbox`),
    ``collectives`` and ``executor_id``, and says what Stats adds (`_socket_counters`)."""

    core = outbox = collectives = None
    executor_id = ""
    lost_peers_told = 0   # the island's faults the controller has told this executor of (its answers name later ones)

    def heartbeat(self) -> bytes:
        """A ping: this incarnation, and how many of its island's faults it knows."""
        return encode(pb.Envelope(heartbeat=pb.Heartbeat(sent_at=time.time(), epoch=self.outbox.epoch,
                                                         lost_peers_told=self.lost_peers_told)))[0]

    def _socket_counters(self) -> dict[str, int]:
        """Counts only the sockets know (send backlog, heartbeats sent ...), added to Stats."""
        return {}

    def _control_frames(self, frames) -> None:
        """A message on the command socket: only the controller's are read."""
        role = peer_role(frames[-1])
        if len(frames) < 2 or role != CONTROLLER:
            self.core.drop(f"a message on the command socket from {role!r}, not the controller")
            return
        try:
            envelope, payload = decode(frames[1:])
        except FramingError as exc:
            self.core.drop(str(exc))
            return
        if envelope.HasField("stats_request"):
            for key, value in self._socket_counters().items():   # set, not added: counters is a Counter
                self.core.counters[key] = value
            self.core.counters["peer_connections"] = self.outbox.peer_connections()   # open now, to peers
        self.core.on_control(envelope, payload)
        if envelope.HasField("welcome"):
            self.outbox.epoch = envelope.welcome.epoch

    def _peer_frames(self, address: str, frames) -> None:
        """What a peer sent back on the connection this executor opened to it (transfer acknowledgements)."""
        try:
            envelope, _ = decode(frames)
        except FramingError as exc:
            self.core.drop(str(exc))
            return
        self.core.on_peer_reply(address, envelope)

    def _data_frames(self, frames, reply=None) -> None:
        """A message on the data socket: the role of the key that sent it decides what it may do here
        (executor/data_roles.py). ``reply``: the transfer inbox's, for a message that came there (only copies may)."""
        if len(frames) < 2:
            self.core.drop("data message without identity and envelope")
            return
        self._data_message(frames[0].bytes, frames[1:], peer_role(frames[-1]), peer_key(frames[-1]), reply,
                           copies_only="the transfer inbox" if reply is not None else "")

    def _data_message(self, identity: bytes, frames, role: str | None, key: bytes | None, reply,
                      copies_only: str = "") -> None:
        """A data message (its envelope and payload ``frames``) from a key of ``role``; ``copies_only``: where it
        came, if only copies from peers may come there (anything else is dropped and counted)."""
        try:
            envelope, payload = decode(frames)
            if copies_only and body_name(envelope) != "transfer":
                self.core.drop(f"a {body_name(envelope)!r} on {copies_only} (only copies from peers go there)")
                return
            self.core.on_data(identity, envelope, payload, role=role, key=key, reply=reply)
        except (FramingError, ValueError) as exc:
            self.core.drop(str(exc))

    def _heartbeat_answer(self, frames) -> str | None:
        """The controller's answer to a ping: the reason it gives for this executor to stop, or None. The lost
        peers it names are retired here (their process groups abandoned)."""
        try:
            envelope, _ = decode(frames)
        except FramingError as exc:
            log.warning("executor %s: bad heartbeat answer dropped: %s", self.executor_id, exc)
            return None
        if body_name(envelope) == "shutdown":
            return f"the controller says: {envelope.shutdown.reason}"
        for entry in envelope.heartbeat.lost_peers:
            # "executor-1@1<7": groups 1..6 were made before the loss; "transfer:<array>.<shard>:<from>-><to><7": a
            # transfer to or from this island was lost on a link (both ends alive, but a run failed at it).
            peer, _, before = entry.partition("<")
            self.core.data_gate.retire(peer)   # what the lost incarnation still sends on its connections is refused
            if peer not in self.collectives.abandoned:
                link = peer.startswith("transfer:")
                # On this thread, not the compute thread: that one may be blocked in a collective with the peer.
                retired = self.collectives.abandon(
                    peer, "a link lost it; a run of this island failed at it" if link else "the controller declared "
                    "it lost", before_group=int(before) if before.isdigit() else None)
                log.warning("executor %s: %s lost; abandoned its process groups %s", self.executor_id, peer,
                            retired)
        self.lost_peers_told = envelope.heartbeat.lost_peers_told
        self.core.asked_heartbeat_interval_s = envelope.heartbeat.interval_s
        return None
