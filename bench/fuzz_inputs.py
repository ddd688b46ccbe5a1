"""The fuzzer's inputs: an `Envelope` of every body kind the wire schema has, filled field by field from its
descriptor (so a kind added to pathways.proto is fuzzed without a change here), then mostly mutated.

Values are drawn from pools that mix edge values with real ones from the running cluster (`Hints`: its
executor ids, addresses, keys, epochs, array and call ids, rendezvous prefixes), so that a message from an
authenticated peer gets past the checks that only look at whether an id exists and reaches the code
behind them. Two choices are held back on purpose: no ``Register`` names an executor's real data address
(that is a restart of the executor by its key holder, which the cluster must accept), and a ``SaveShards``
path is either invalid or inside the fuzzer's own folder (an executor writes where it is told).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from google.protobuf.descriptor import FieldDescriptor as F

from pathways_torch.wire import pb
from tests.handles import controller_of

__all__ = ["RandomChooser", "Hints", "BODY_KINDS", "body", "message", "hints_of"]

# Every kind an Envelope can carry, from the schema itself.
BODY_KINDS: tuple[str, ...] = tuple(f.name for f in pb.Envelope.DESCRIPTOR.oneofs_by_name["body"].fields)

_MAX_DEPTH = 4        # nested messages (a Graph's nodes' args ...) stop here


class RandomChooser:
    """The choices a generator makes, from `random.Random` (the bench); the test draws them from hypothesis."""

    def __init__(self, rng):
        self.rng = rng

    def integer(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)

    def choice(self, options):
        return options[self.rng.randrange(len(options))]

    def raw(self, size: int) -> bytes:
        return self.rng.randbytes(size)


@dataclasses.dataclass(frozen=True)
class Hints:
    """Real values of the cluster under test: what an authenticated peer would know."""

    executor_ids: tuple[str, ...] = ()
    addresses: tuple[str, ...] = ()        # data, link and command addresses
    public_keys: tuple[bytes, ...] = ()
    epochs: tuple[int, ...] = ()
    array_ids: tuple[int, ...] = ()
    call_ids: tuple[int, ...] = ()
    store_prefixes: tuple[str, ...] = ()   # "group-G/epoch-E" the rendezvous store knows
    save_dir: str = "/nonexistent"         # the only folder a fuzzed SaveShards may name that exists


def hints_of(ctx, save_dir: str) -> Hints:
    """The hints of a running `pw.Context` (read in the client's process)."""
    infos = controller_of(ctx).resources.ordered()
    last_call = controller_of(ctx).call_dispatch.last_call_id
    return Hints(executor_ids=tuple(i.executor_id for i in infos),
                 addresses=tuple(a for i in infos for a in (i.data_address, i.link_address, i.command_address) if a),
                 public_keys=tuple(i.public_key for i in infos), epochs=tuple(i.epoch for i in infos),
                 array_ids=tuple(sorted(r.array_id for r in controller_of(ctx).arrays.records())[-8:]),
                 call_ids=tuple(range(max(1, last_call - 3), last_call + 3)),
                 store_prefixes=tuple(controller_of(ctx).rendezvous._members)[-4:], save_dir=save_dir)


_UINT_EDGES = (0, 1, 2, 7, 2**31 - 1, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1)
_SINT_EDGES = (0, 1, -1, 2, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63))
_FLOATS = (0.0, 1.0, -1.0, 0.5, 1e300, -1e-300, math.inf, math.nan)
_RANGES = {F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1), F.TYPE_UINT64: (0, 2**64 - 1),
           F.TYPE_FIXED64: (0, 2**64 - 1), F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1),
           F.TYPE_SFIXED32: (-(2**31), 2**31 - 1), F.TYPE_INT64: (-(2**63), 2**63 - 1),
           F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1)}
_JUNK_ADDRESSES = ("tcp://127.0.0.1:1", "", "junk", "ipc:///tmp/pathways-fuzz", "tcp://[::1]:0", "tcp://0.0.0.0:*")
_DTYPES = ("float32", "float64", "int64", "bool", "bfloat16", "__class__", "", "float32\x00", "complex128")
_SHAPES = ((), (2,), (0,), (3, 5), (1000,), (1 << 31, 1 << 31), (2**62,), (2**63 - 1,), (-1,))
_OPS = ("aten.add.Tensor", "aten.from_file.default", "os.system", "builtins.eval", "pathways::all_reduce", "",
        "aten.x.y", "set", "get", "add", "check", "delete", "wait", "call_function", "placeholder", "output")
_STRINGS = ("", "x", "x" * 300, "\x00", "../../etc/passwd", "client", "controller", "executor-9", "é")


def _scalar_pool(c, hints: Hints, owner: str, field) -> tuple:
    """The values a scalar field draws from: by its name (an id, an address, a key ...), else by its type."""
    name = field.name
    if field.type in (F.TYPE_STRING,):
        if name in ("executor_id", "lost_executor", "role", "executor_ids"):
            return hints.executor_ids + ("client", "controller", "", "executor-9", "x" * 300)
        if name.endswith("address"):
            if owner == "Register" and name == "data_address":   # a real one would be a genuine restart
                return _JUNK_ADDRESSES
            return hints.addresses + _JUNK_ADDRESSES
        if name == "dtype":
            return _DTYPES
        if name in ("op", "target", "name"):
            return _OPS
        if name in ("key", "keys"):
            prefixes = hints.store_prefixes + ("group-1/epoch-0", "group-999/epoch-9")
            return tuple(f"{p}/{k}" for p in prefixes for k in ("0", "rank-0", "x")) + ("", "nokey", "group-/epoch-/")
        if name == "path":
            return (f"{hints.save_dir}/fuzz.safetensors", "relative.safetensors", "/nonexistent/x.safetensors",
                    f"{hints.save_dir}/fuzz.bin", "", f"{hints.save_dir}/\x00.safetensors")
        return _STRINGS
    if field.type == F.TYPE_BYTES:
        return hints.public_keys + (b"", b"\x00" * 40, c.raw(c.integer(0, 48)))
    if field.type == F.TYPE_BOOL:
        return (False, True)
    if field.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return _FLOATS
    if field.type == F.TYPE_ENUM:
        return tuple(v.number for v in field.enum_type.values) + (99,)
    low, high = _RANGES.get(field.type, (0, 2**32 - 1))
    if name == "epoch":
        pool = hints.epochs + (0, 1, 2, 2**32 - 1)
    elif name in ("call_id", "call_ids", "tag", "origin_call_id", "seq", "base_seq"):
        pool = hints.call_ids + _UINT_EDGES
    elif "array_id" in name:
        pool = hints.array_ids + _UINT_EDGES
    elif name in ("shard", "frame", "index", "node", "function_id", "program_id", "group_id", "group_ids"):
        pool = (0, 1, 2, 3, 5, 99, 2**32 - 1)
    else:
        pool = _UINT_EDGES + _SINT_EDGES
    return tuple(v for v in pool if low <= v <= high) or (0,)


def _is_repeated(field) -> bool:
    # protobuf 6 has `is_repeated` (and dropped `label` from upb descriptors); older releases only `label`.
    flag = getattr(field, "is_repeated", None)
    return flag if flag is not None else field.label == F.LABEL_REPEATED


def _fill(c, msg, hints: Hints, depth: int = 0) -> None:
    """Set some of ``msg``'s fields (each with a fair chance of staying unset), recursively."""
    owner = msg.DESCRIPTOR.name
    for field in msg.DESCRIPTOR.fields:
        if c.integer(0, 2) == 0:
            continue
        repeated = _is_repeated(field)
        if field.type == F.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                target = getattr(msg, field.name)
                key_field, value_field = field.message_type.fields_by_name["key"], \
                    field.message_type.fields_by_name["value"]
                for _ in range(c.integer(0, 2)):
                    key = c.choice(_scalar_pool(c, hints, owner, key_field))
                    if value_field.type == F.TYPE_MESSAGE:
                        _fill(c, target[key], hints, depth + 1)
                    else:
                        target[key] = c.choice(_scalar_pool(c, hints, owner, value_field))
                continue
            if depth >= _MAX_DEPTH:
                continue
            if repeated:
                for _ in range(c.integer(0, 2)):
                    _fill(c, getattr(msg, field.name).add(), hints, depth + 1)
            else:
                _fill(c, getattr(msg, field.name), hints, depth + 1)
            continue
        if field.name == "shape" and repeated:
            getattr(msg, field.name).extend(c.choice(_SHAPES))
            continue
        pool = _scalar_pool(c, hints, owner, field)
        if repeated:
            getattr(msg, field.name).extend(c.choice(pool) for _ in range(c.integer(0, 3)))
        else:
            setattr(msg, field.name, c.choice(pool))


def body(c, hints: Hints | None = None, kind: str | None = None) -> pb.Envelope:
    """One well-typed message of ``kind`` (default: any of `BODY_KINDS`), its fields drawn from the pools."""
    hints = hints or Hints()
    kind = kind or c.choice(BODY_KINDS)
    envelope = pb.Envelope()
    _fill(c, getattr(envelope, kind), hints)
    getattr(envelope, kind).SetInParent()     # an empty body still names its kind
    if c.integer(0, 1):
        envelope.epoch = c.choice(_scalar_pool(c, hints, "Envelope", pb.Envelope.DESCRIPTOR.fields_by_name["epoch"]))
    if c.integer(0, 7) == 0:
        _fill(c, envelope.frees.add(), hints, 1)
    return envelope


def message(c, hints: Hints | None = None, kinds: tuple[str, ...] = ()) -> list[bytes]:
    """One input: a message (half the time of one of ``kinds``, those its port handles; else of any kind) with
    (mostly) a tensor frame, then half the time mutated (1 to 3 times). Unmutated messages of a handled kind are
    the ones that get past the decoding and the kind checks to the handlers."""
    kind = c.choice(kinds) if kinds and c.integer(0, 1) else None
    frames = [body(c, hints, kind).SerializeToString()]
    if c.integer(0, 3):
        frames.append(torch.ones(c.choice((0, 1, 2, 3, 1000))).numpy().tobytes())
    if c.integer(0, 1):
        for _ in range(c.integer(1, 3)):
            frames = _mutate(c, frames)
    return frames


def _mutate(c, frames: list[bytes]) -> list[bytes]:
    how = c.choice(("random", "truncate", "extend", "flip", "drop frame", "add frame", "empty", "huge frame"))
    index = c.integer(0, len(frames) - 1) if frames else 0
    frames = list(frames) or [b""]
    frame = frames[index]
    if how == "random":
        frames[index] = c.raw(c.integer(0, 64))
    elif how == "truncate":
        frames[index] = frame[:c.integer(0, max(0, len(frame) - 1))]
    elif how == "extend":
        frames[index] = frame + c.raw(c.integer(1, 32))
    elif how == "flip" and frame:
        at = c.integer(0, len(frame) - 1)
        frames[index] = frame[:at] + bytes([frame[at] ^ (1 << c.integer(0, 7))]) + frame[at + 1:]
    elif how == "drop frame" and len(frames) > 1:
        del frames[index]
    elif how == "add frame":
        frames.insert(c.integer(0, len(frames)), c.raw(c.integer(0, 16)))
    elif how == "empty":
        frames = [b""] * c.integer(1, 3)
    elif how == "huge frame":
        frames.append(b"\0" * c.choice((1 << 16, 1 << 20)))
    return frames
