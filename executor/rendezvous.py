"""The executor's side of the controller's rendezvous store: a ``torch.distributed.Store`` over CURVE.

Gloo (and NCCL) call it while a group forms, on the thread forming it; each call is one
request and its reply on this executor's store connection to the controller (identity
``<id>#store``). Keys are prefixed with the group's ``group-G/epoch-E`` by the caller
(a ``PrefixStore``); a ``get`` of a key not yet set waits, at most the store's timeout.
"""

from __future__ import annotations

import datetime
import itertools
import threading
import time

import torch.distributed as dist
import zmq

from pathways_torch.wire import decode, encode, pb

__all__ = ["ControllerStore"]


class ControllerStore(dist.Store):
    """set/get/add/check/wait/delete_key against the controller, for one executor (thread-safe)."""

    def __init__(self, socket: zmq.Socket, timeout_s: float):
        super().__init__()
        self._socket, self._lock = socket, threading.Lock()
        self._timeout_s = timeout_s
        self._ids = itertools.count(1)

    # ------------------------------------------------------------ the Store interface

    def set(self, key: str, value) -> None:
        self._ask("set", key, value=_bytes(value))

    def get(self, key: str) -> bytes:
        return self._ask("get", key).value

    def add(self, key: str, amount: int) -> int:
        return self._ask("add", key, amount=int(amount)).number

    def check(self, keys: list[str]) -> bool:
        return self._ask("check", keys[0] if keys else "", keys=list(keys)).found

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        for key in keys:
            self._ask("get", key, timeout_s=timeout.total_seconds() if timeout else None)

    def delete_key(self, key: str) -> bool:
        return self._ask("delete", key).found

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    # ------------------------------------------------------------ transport

    def _ask(self, op: str, key: str, *, value: bytes = b"", amount: int = 0, keys=(), timeout_s=None):
        request = pb.StoreRequest(request_id=next(self._ids), op=op, key=key, value=value, amount=amount,
                                  keys=list(keys))
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self._timeout_s)
        with self._lock:
            self._socket.send_multipart(encode(pb.Envelope(store_request=request)))
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self._socket.poll(int(left * 1000) + 1):
                    raise TimeoutError(f"rendezvous store: no answer to {op} {key!r} from the controller within "
                                       f"{timeout_s if timeout_s is not None else self._timeout_s:g} s (a group "
                                       f"member missing, or the controller gone)")
                envelope, _ = decode(self._socket.recv_multipart())
                reply = envelope.store_reply
                if reply.request_id != request.request_id:
                    continue   # the late answer to an earlier request that timed out
                if not reply.ok:
                    raise RuntimeError(f"rendezvous store refused {op} {key!r}: {reply.error}")
                return reply


def _bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)
