"""Multipart framing: frame 0 is an `Envelope`, frames 1.. are raw tensor bytes."""

from __future__ import annotations

from typing import Sequence

from . import pathways_pb2 as pb

__all__ = ["encode", "decode", "body_name", "log_dropped", "FramingError", "MAX_ENVELOPE_BYTES", "PROGRAM_RUN_REFUSED"]

# The failure type of an executor's Done for a program run it could not take (it does not hold the
# program, or handling the run raised): the controller then treats the executor as lost, since none
# of the run's calls can end there.
PROGRAM_RUN_REFUSED = "ProgramRunRefused"

# A control message is small; anything bigger than this in frame 0 is hostile or a bug.
MAX_ENVELOPE_BYTES = 64 << 20


class FramingError(ValueError):
    """A message that cannot be decoded; the receiver logs and drops it."""


def encode(envelope: pb.Envelope, payload: Sequence = ()) -> list:
    """Return the frames of one message: the envelope, then the raw payload frames."""
    return [envelope.SerializeToString(), *payload]


def decode(frames: Sequence) -> tuple[pb.Envelope, list]:
    """Parse frame 0 as an `Envelope`; return it and the payload frames (as received)."""
    if not frames:
        raise FramingError("expected at least one frame (the envelope), got none")
    head = frames[0]
    raw = head.bytes if hasattr(head, "bytes") else bytes(head)
    if len(raw) > MAX_ENVELOPE_BYTES:
        raise FramingError(f"envelope of {len(raw)} bytes exceeds {MAX_ENVELOPE_BYTES}")
    envelope = pb.Envelope()
    try:
        envelope.ParseFromString(raw)
    except Exception as exc:  # protobuf raises DecodeError and others
        raise FramingError(f"frame 0 is not an Envelope: {exc}") from None
    if envelope.WhichOneof("body") is None:
        raise FramingError("envelope carries no known message type")
    return envelope, list(frames[1:])


def log_dropped(logger, count: int, who: str, why: str) -> None:
    """Log the ``count``-th dropped message: the first ten, then every thousandth (a peer must not flood the log)."""
    if count <= 10 or count % 1000 == 0:
        logger.warning("%s: dropped a message (%d so far): %s", who, count, why)


def body_name(envelope: pb.Envelope) -> str:
    """The name of the message inside an envelope, e.g. ``"run"``."""
    return envelope.WhichOneof("body") or ""
