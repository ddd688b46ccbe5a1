"""What the executor's parts share about the wire: the outbox they send through, a shard's store key, failures.

`ExecutorCore` and its parts (`RunQueue`, `StepInterpreter`, `DataPlane`) all answer through one
`Outbox`, name stored shards by the same key, and write failures the same way: a failure is a
value (`pb.RemoteFailure`) that travels where the tensor would have gone.
"""

from __future__ import annotations

import traceback
from typing import Protocol, Sequence

from pathways_torch.wire import pb
from pathways_torch.wire.framing import PROGRAM_RUN_REFUSED

__all__ = ["Outbox", "shard_key", "remote_failure", "with_origin", "value_or_failure", "program_run_refused"]


class Outbox(Protocol):
    """Where the executor's messages go: the controller, a peer executor, or a client's connection."""

    def to_controller(self, envelope: pb.Envelope, payload: Sequence = ()) -> None: ...
    def to_peer(self, address: str, envelope: pb.Envelope, payload: Sequence = (), public_key: bytes = b"",
                direct: bool = False, tag=None) -> bool | None: ...   # True: through a shared-memory ring (no ack)
    def to_client(self, identity: bytes, envelope: pb.Envelope, payload: Sequence = ()) -> None: ...


def shard_key(ref: pb.ShardRef) -> tuple:
    """The store key of a shard reference: ``(array_id, shard, tag)`` (see `executor.store`)."""
    return (ref.array_id, ref.shard, ref.tag)


def remote_failure(exc: BaseException, executor_id: str, *, origin_call_id: int) -> pb.RemoteFailure:
    """An exception raised here, as the failure that takes the place of the values it kept from being made."""
    return pb.RemoteFailure(type=type(exc).__name__, message=str(exc), executor_id=executor_id,
                            traceback="".join(traceback.format_exception(exc)), origin_call_id=origin_call_id,
                            op=getattr(exc, "op", ""), node_index=getattr(exc, "node_index", 0))


def with_origin(failure: pb.RemoteFailure, call_id: int) -> pb.RemoteFailure:
    """A copy of ``failure`` charged to ``call_id``."""
    copy = pb.RemoteFailure()
    copy.CopyFrom(failure)
    copy.origin_call_id = call_id
    return copy


def value_or_failure(entry):
    """An input's value, or the failure its producer stored instead."""
    return entry.failure if entry.failure is not None else entry.value


def program_run_refused(executor_id: str, msg: pb.RunProgram, why: str) -> pb.Envelope:
    """The Done telling the controller a program run cannot be taken here: it treats this executor as lost."""
    failure = pb.RemoteFailure(type=PROGRAM_RUN_REFUSED, executor_id=executor_id, origin_call_id=msg.base_call_id,
                               message=why)
    return pb.Envelope(done=pb.Done(call_id=msg.base_call_id, seq=msg.base_seq, ok=False, failure=failure))
