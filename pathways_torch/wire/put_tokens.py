"""Put tokens: what lets a service client put ONE shard on an executor, and nothing more.

A remote client sends its tensors' bytes straight to the executors, so the controller cannot count them as they
pass. It counts what it reserved instead (`controller.memory.MemoryBudget`), and hands the client, with each new
array, one token per (executor, shard) that binds what was reserved: array, shard, tag, byte count, executor (and its
incarnation), client, and a sequence number. The executor checks the token with the secret it shares with the
controller (Welcome), compares the put with what the token names, and takes each token once
(`executor.data_roles.PutLedger`): so what an executor stores from a client's puts is what the budget counts.

This module imports no torch and no zmq.
"""

from __future__ import annotations

import hmac
import struct
import zlib
from typing import NamedTuple

__all__ = ["PUT_SECRET_BYTES", "PUT_TOKEN_BYTES", "PutClaim", "put_token", "put_token_claim", "checked_put_claim",
           "is_for_executor", "shard_put_token"]

PUT_SECRET_BYTES = 32   # the controller's put secret (`put_token`), given to every executor in Welcome
_PUT_MAC_BYTES = 16
# What a put token names in the clear (the MAC covers it), so that an executor can say which part of a put does not
# match: its sequence number (per client and executor), array id, shard, tag, bytes, the executor's incarnation,
# and a checksum of the executor's id (the id itself is in the MAC).
_PUT_CLAIM = struct.Struct("<QQIQQII")
PUT_TOKEN_BYTES = _PUT_CLAIM.size + _PUT_MAC_BYTES


class PutClaim(NamedTuple):
    """What a put token allows: one put of ``nbytes`` bytes as shard ``shard`` (tag ``tag``) of ``array_id`` on
    incarnation ``epoch`` of the executor whose id has checksum ``executor_crc``; ``sequence`` tells tokens apart."""

    sequence: int
    array_id: int
    shard: int
    tag: int
    nbytes: int
    epoch: int
    executor_crc: int


def _executor_crc(executor_id: str) -> int:
    return zlib.crc32(executor_id.encode())


def _put_mac(secret: bytes, claim: bytes, executor_id: str, role: str) -> bytes:
    message = b"put\0" + claim + executor_id.encode() + b"\0" + role.encode()
    return hmac.new(secret, message, "sha256").digest()[:_PUT_MAC_BYTES]


def put_token(secret: bytes, *, sequence: int, array_id: int, shard: int, nbytes: int, executor_id: str, epoch: int,
              role: str, tag: int = 0) -> bytes:
    """The capability to put ONE shard: shard ``shard`` (tag ``tag``) of array ``array_id``, exactly ``nbytes`` bytes,
    on incarnation ``epoch`` of executor ``executor_id``, as the client of ``role``. The controller makes one per
    (executor, shard) of a client's new array, from the bytes its memory budget reserved; the executor checks it
    (`executor.data_roles.OwnerCheck`) with the secret both share and takes it once (``sequence``). No one without
    the secret can make one, and one names no other array, shard, size, executor or client."""
    claim = _PUT_CLAIM.pack(sequence, array_id, shard, tag, nbytes, epoch, _executor_crc(executor_id))
    return claim + _put_mac(secret, claim, executor_id, role)


def put_token_claim(token: bytes) -> PutClaim | None:
    """What ``token`` says it allows, unchecked (None: not a put token's length)."""
    if len(token) != PUT_TOKEN_BYTES:
        return None
    return PutClaim(*_PUT_CLAIM.unpack(token[:_PUT_CLAIM.size]))


def checked_put_claim(secret: bytes, token: bytes, executor_id: str, role: str) -> PutClaim | None:
    """What ``token`` allows if the controller (its ``secret``) made it for the client of ``role`` on
    ``executor_id``; None otherwise."""
    claim = put_token_claim(token)
    if claim is None or not secret:
        return None
    expected = _put_mac(secret, token[:_PUT_CLAIM.size], executor_id, role)
    return claim if hmac.compare_digest(token[_PUT_CLAIM.size:], expected) else None


def is_for_executor(claim: PutClaim, executor_id: str) -> bool:
    """Whether ``claim`` names ``executor_id`` (by its checksum: to say so when a token was sent elsewhere)."""
    return claim.executor_crc == _executor_crc(executor_id)


def shard_put_token(tokens: bytes, shard: int) -> bytes:
    """Shard ``shard``'s token among an array's ``tokens`` (one per shard, in shard order: `ArrayRecord.put_token`);
    b"" if there is none."""
    return bytes(tokens[shard * PUT_TOKEN_BYTES:(shard + 1) * PUT_TOKEN_BYTES])
