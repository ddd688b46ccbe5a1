"""`CallFailures`: the error each failed call raised, kept while an output of it is held.

A call downstream of a failed one fails with its origin's error (`Completion`), and a Done naming the origin can
come after the dependent's: so the error is kept until the last output of the failed call is forgotten
(`Lifetimes`). A call fails from three places (a Done, a lost executor, a lost transfer): `Completion` and
`Membership` both fail calls here, and `Lifetimes` tells it of the outputs it forgets.
"""

from __future__ import annotations

from pathways_torch.wire import pb

from .arrays import FAILED

__all__ = ["CallFailures", "failed_copy"]


class CallFailures:
    """Failed calls' errors by call id, and how many of each one's outputs are still held (under the controller's
    lock)."""

    def __init__(self):
        self._errors: dict[int, BaseException] = {}   # call id → the error it raised
        self._holders: dict[int, int] = {}            # call id → its outputs still held

    def fail(self, call, error: BaseException) -> None:
        """Fail the call's outputs with ``error`` (its first failure wins); the error is kept while they are held,
        for the calls downstream that fail because of it."""
        if call.failed:
            return
        call.failed = True
        self._errors.setdefault(call.call_id, error)
        holders = sum(1 for r in call.outputs if not r.released)
        if holders:
            self._holders[call.call_id] = holders
        for record in call.outputs:
            record.settle(FAILED, error)

    def error_of(self, call_id: int) -> BaseException | None:
        """The error ``call_id`` failed with, while an output of it is held; None otherwise."""
        return self._errors.get(call_id)

    def output_forgotten(self, producer_call: int) -> None:
        """An output of ``producer_call`` was forgotten: once none of a failed call's is left, forget its error."""
        if producer_call in self._holders:
            self._holders[producer_call] -= 1
            if self._holders[producer_call] == 0:
                del self._holders[producer_call]
                self._errors.pop(producer_call, None)


def failed_copy(copy: pb.ShardRef, failure: pb.RemoteFailure) -> pb.Envelope:
    """The message that tells an executor the copy ``copy`` it may wait for will not come (it fails)."""
    return pb.Envelope(transfer=pb.Transfer(failed=True, shard=copy, failure=failure))
