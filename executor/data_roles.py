"""Who may send what on an executor's data socket.

The CURVE handshake admits every key on the allow-list, the client's and every executor's. Were that all, one
executor's key could fetch any array from another executor, put under any id (the first fill wins, so it could
pre-empt a computed result), or make another host write a ``.safetensors`` file. So each message is also checked
against the role of the key that sent it (its connection's ``User-Id``, `pathways_torch.wire.security.peer_role`):
puts, fetches and saves come from the client alone; transfers from executors alone, and only from an incarnation
that was not replaced. Transfer acknowledgements never arrive here: they come back on the DEALER the sender opened,
which talks only to the holder of the receiver's key.

A controller serving many clients (``client-<name>`` keys) also keeps each client to its own arrays (`OwnerCheck`).
Every store entry carries the role of the client it belongs to (`executor.store.Entry.owner`), as the controller
announced it: a Run's or a RunProgram's ``owner`` for what the run makes (a copy made for a run is its inputs'
owner's, who is the run's: the controller lets no client call on another's arrays), and for a put, the client whose
put token (`pathways_torch.wire.put_tokens.put_token`, made with the secret of the controller's Welcome) names the
shard. A token names one put exactly (array, shard, tag, bytes, this executor's id and incarnation, client) and is
taken once (`PutLedger`; the controller's Free spends the tokens of the arrays it frees), so what a client stores
here is what the controller's memory budget counted; a put that does not match is refused, saying what differs. A client's fetch or save of an array that is not its own is answered as one of an array this executor never
held: its owner is not revealed. An entry with no owner recorded belongs to the embedded run's one client
(``client``), whose path is unchanged and costs one look at the entry: no token, no HMAC. The service's key folders
never hold a plain ``client`` key (`pathways_torch.launch.service_keys`), so that role never shares an executor with
a service client.

This module imports no torch (the simulated executor uses it).
"""

from __future__ import annotations

import threading
from typing import Callable

from pathways_torch.wire import pb
from pathways_torch.wire.framing import body_name
from pathways_torch.wire.put_tokens import checked_put_claim, is_for_executor, put_token_claim
from pathways_torch.wire.security import CLIENT, CONTROLLER, is_client, spare_of

__all__ = ["DataGate", "OwnerCheck", "PutLedger", "CLIENT_KINDS", "EXECUTOR_KINDS", "executor_of_role"]

CLIENT_KINDS = frozenset({"put", "fetch", "save_shards"})   # data messages only the client may send
# Data messages only executors may send: a transfer, and a launch tree's launches (down) and Dones (up), which the
# tree checks come from this executor's parent or children (executor/launch_tree.py).
EXECUTOR_KINDS = frozenset({"transfer", "tree_launch", "done_batch"})


def executor_of_role(role: str | None) -> str | None:
    """The executor id a key's role speaks for (``executor-1``; a spare ``executor-1.r2`` → ``executor-1``), or None
    for the client, the controller, or a message without a role."""
    if not role or role == CONTROLLER or is_client(role):
        return None
    return spare_of(role) or role


class DataGate:
    """Checks each data message's sender; one per executor. Thread-safe: the I/O thread checks, the heartbeat and
    compute threads tell it of replaced incarnations.

    A replaced incarnation is told apart in two ways. Its key: every executor revokes it when the controller admits
    the replacement's (``AdmitKey``, sent to every live executor of every island), and each message carries the key
    its connection authenticated with (`peer_key`), so what the old incarnation still sends on a connection made
    before is refused. Its epoch, as a second line: the controller names the lost incarnation (``executor-1@2`` in
    a heartbeat answer's lost peers or a ``Cancel``), and a transfer claiming that epoch or an earlier one is
    refused. The epoch is the sender's own word, so it never raises the floor: only the controller does.
    """

    def __init__(self, admits_key: Callable[[bytes], bool] | None = None) -> None:
        self._lock = threading.Lock()
        self._floor: dict[str, int] = {}   # executor id → its earliest incarnation still admitted
        # Whether a key is on this executor's allow-list now (`Gatekeeper.admits`); None in tests without one.
        self._admits_key = admits_key

    def refusal(self, role: str | None, envelope: pb.Envelope, key: bytes | None = None) -> str | None:
        """Why the message in ``envelope``, sent with a key of ``role`` (the key itself: ``key``, when the
        connection carries it), is refused here; None if it is not."""
        kind = body_name(envelope)
        if kind in CLIENT_KINDS:
            if not is_client(role):
                return f"{kind} from {role!r}: expected it from a client alone (refused)"
            return None
        if kind not in EXECUTOR_KINDS:
            return None   # not a data message at all: the executor drops it as unexpected
        executor_id = executor_of_role(role)
        if executor_id is None:
            return f"{kind} from {role!r}: expected it from an executor (refused)"
        if key is not None and self._admits_key is not None and not self._admits_key(key):
            # The authenticated key, not anything the message says: a replaced incarnation shares its role with
            # its replacement, and its connections made before the revocation still deliver.
            return (f"{kind} from {executor_id} with a key revoked when that executor was replaced: expected its "
                    f"current incarnation's key (refused)")
        with self._lock:
            floor = self._floor.get(executor_id, 0)
        if envelope.epoch < floor:
            # The epoch is what the sender says; it only ever lowers what a message may do (the floor is raised by
            # the controller's word alone, `retire`), so a false one cannot shut a real incarnation out.
            return (f"{kind} from incarnation {envelope.epoch} of {executor_id}: expected incarnation {floor} or "
                    f"later, the earlier ones were replaced (refused)")
        return None

    def retire(self, incarnation: str) -> None:
        """The controller declared ``incarnation`` (``"executor-1@2"``) lost: refuse its transfers, and its
        predecessors', from now on. Anything else (a lost transfer ``"transfer:..."``) is ignored."""
        executor_id, at, epoch = incarnation.rpartition("@")
        if not at or not executor_id or not epoch.isdigit() or incarnation.startswith("transfer:"):
            return
        with self._lock:
            self._floor[executor_id] = max(self._floor.get(executor_id, 0), int(epoch) + 1)

    def floor(self, executor_id: str) -> int:
        """The earliest incarnation of ``executor_id`` whose transfers are admitted (0: none was replaced)."""
        with self._lock:
            return self._floor.get(executor_id, 0)


_PUT_WINDOW = 1 << 14   # a client's put may arrive behind this many later ones of its own to this executor


class PutLedger:
    """The put tokens of one client taken (or spent by the controller's Free) on this executor: each is good once.

    Its tokens carry sequence numbers the controller counts up per (client, executor). Those within ``window`` of
    the highest seen are remembered one by one; older ones are all refused (their arrays are long made). So it
    holds at most ``window`` numbers however long the client puts, and puts may arrive out of order within it (two
    threads of a client putting at once)."""

    __slots__ = ("window", "highest", "taken")

    def __init__(self, window: int = _PUT_WINDOW):
        self.window, self.highest, self.taken = window, 0, set()

    def refusal(self, sequence: int) -> str | None:
        if sequence in self.taken:
            return "its put token was used already (each is good for one put)"
        if sequence + self.window <= self.highest:
            return (f"its put token is too old (number {sequence}, {self.highest - sequence} puts behind this "
                    f"client's latest here)")
        return None

    def take(self, sequence: int) -> None:
        self.taken.add(sequence)
        if sequence > self.highest:
            self.highest = sequence
            if len(self.taken) > 2 * self.window:   # now and then: forget the numbers below the window
                self.taken = {n for n in self.taken if n + self.window > self.highest}


class OwnerCheck:
    """Which client's arrays a client may put, fetch and save here (see the module's docstring); one per executor.

    ``put_secret`` is the controller's (its Welcome): until it came, no service client's put is taken. A new secret
    (another controller) starts every client's `PutLedger` afresh: the old tokens no longer check.
    """

    def __init__(self) -> None:
        self._put_secret = b""
        self._ledgers: dict[str, PutLedger] = {}   # client role → its put tokens taken here

    @property
    def put_secret(self) -> bytes:
        return self._put_secret

    @put_secret.setter
    def put_secret(self, secret: bytes) -> None:
        if secret != self._put_secret:
            self._put_secret, self._ledgers = secret, {}

    @staticmethod
    def as_owner(role: str | None) -> str:
        """What an entry of the client of ``role`` (a run's owner, a put's sender) records as its owner: "" for the
        embedded client, whose entries need none."""
        return "" if role == CLIENT or not role else role

    @staticmethod
    def reads(role: str | None, entry) -> bool:
        """Whether the client of ``role`` may fetch or save ``entry``."""
        owner = entry.owner
        return owner == role if owner else role == CLIENT

    def awaits_secret(self, role: str | None) -> bool:
        """Whether a put from ``role`` must wait for the controller's Welcome (a service client's, none yet):
        the client may have heard of this executor, and sent to it, before the Welcome arrived here."""
        return role != CLIENT and not self._put_secret

    def admit_put(self, role: str | None, items, *, entry_of: Callable, nbytes_of: Callable, executor_id: str,
                  epoch: int) -> str | None:
        """Why the put of ``items`` (a Put and its PutItems: shard, token, frame) from ``role`` is refused here; None
        if every shard is taken, its token spent. ``entry_of(item)``: the store's entry for its key (None if none);
        ``nbytes_of(item)``: the bytes of its frame. All or nothing: one refused shard refuses the message."""
        sequences = []
        for item in items:
            refused = self._item_refusal(role, item, entry_of(item), nbytes_of(item), executor_id, epoch, sequences)
            if refused:
                return refused
        if sequences:
            ledger = self._ledgers.setdefault(role, PutLedger())
            for sequence in sequences:
                ledger.take(sequence)
        return None

    def spend(self, spent_puts) -> None:
        """The controller freed arrays whose tokens these are (``SpentPut``: role, sequence): none of them may put
        from now on, whether or not its put came."""
        for spent in spent_puts:
            self._ledgers.setdefault(spent.role, PutLedger()).take(spent.sequence)

    def _item_refusal(self, role, item, entry, nbytes: int, executor_id: str, epoch: int, sequences: list
                      ) -> str | None:
        array_id, shard, tag = item.shard.array_id, item.shard.shard, item.shard.tag
        what = f"put of array {array_id} shard {shard}" + (f" tag {tag}" if tag else "")
        if entry is not None and entry.owner and entry.owner != role:
            return f"{what}: array {array_id} is not this client's (refused)"
        if role != CLIENT:   # a service client: the controller's token for exactly this put, or nothing
            refused = self._token_refusal(role, item, nbytes, executor_id, epoch, sequences)
            if refused:
                return f"{what} ({nbytes} bytes) on {executor_id}: {refused} (refused)"
        return None

    def _token_refusal(self, role, item, nbytes: int, executor_id: str, epoch: int, sequences: list) -> str | None:
        if not self._put_secret:
            return "this executor has no put secret from the controller yet, so it cannot tell whose array it is"
        token = bytes(item.token)
        claim = checked_put_claim(self._put_secret, token, executor_id, role)
        if claim is None:
            told = put_token_claim(token)
            if told is not None and not is_for_executor(told, executor_id):
                return "its put token is for another executor (put each shard where the controller placed it)"
            return (f"array {item.shard.array_id} is not this client's (its put token is not one the controller gave "
                    f"this client; put to the arrays your own ctx.put made)")
        if claim.array_id != item.shard.array_id:
            return (f"array {item.shard.array_id} is not this client's (its put token is for array {claim.array_id}; "
                    f"put to the arrays your own ctx.put made)")
        asked = (item.shard.shard, item.shard.tag, nbytes, epoch)
        allowed = (claim.shard, claim.tag, claim.nbytes, claim.epoch)
        for name, want, got in zip(("shard", "tag", "byte count", "executor incarnation"), allowed, asked):
            if want != got:
                return f"its put token is for {name} {want}, not {got} (the token binds what the controller counted)"
        ledger = self._ledgers.get(role)
        refused = ledger.refusal(claim.sequence) if ledger is not None else None
        if refused is None and claim.sequence in sequences:
            refused = "its put token is used twice in one message (each is good for one put)"
        sequences.append(claim.sequence)
        return refused
