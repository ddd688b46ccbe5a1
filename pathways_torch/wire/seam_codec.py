"""The seam's messages on the wire, for a client of a remote controller: JSON with type tags, bytes as frames.

A message is ``[JSON, frame, frame ...]``. The JSON is a tree of plain values; a node that is not plain is a
one-key object naming what it is, and decoding builds only what is named here:

- ``{"$t": [...]}`` a tuple; ``{"$d": [[k, v], ...]}`` a dict; ``{"$b": i}`` bytes, frame ``i``;
- ``{"$c": "CallSpec", "f": {...}}`` one of the seam's frozen dataclasses (`seam`), built by its constructor;
- ``{"$pb": "Graph", "b": i}`` a protobuf message of ``pathways.proto``, parsed from frame ``i``;
- ``{"$e": "ExecutorLostError", "a": [...], "v": {...}}`` an error of `pathways_torch.errors` (or a few
  built-in ones), its arguments and plain attributes.

Nothing is unpickled and no name is looked up beyond these tables (docs/security.md): a peer can only make
values, never run code. Tensor bytes never travel here (the data plane carries them executor↔client); frames
are graph constants and protobuf bodies.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import weakref
from typing import Sequence

import pathways_torch.errors as errors

from . import pathways_pb2 as pb
from .seam import ArraySettled, CallSpec, ControllerCounters, ExecutorView, MeshAllocation, ProgramSpec

__all__ = ["encode", "decode", "SeamCodecError", "MAX_DEPTH", "MAX_CONTAINERS", "ErrorNames", "Interned"]

MAX_DEPTH = 64   # deeper trees are refused: nothing the seam sends nests this far
# Lists and objects in one message, at most, counted on the raw bytes before any is built: 8 MiB of "[[],[],..."
# would otherwise be 4 million lists (300 MB, seconds of a Python walk). A 4,096-node program is about 60,000.
MAX_CONTAINERS = 262_144
_DATACLASSES = {cls.__name__: cls for cls in (MeshAllocation, CallSpec, ProgramSpec, ExecutorView,
                                                ControllerCounters, ArraySettled)}
_BUILTIN_ERRORS = {cls.__name__: cls for cls in (ValueError, KeyError, TypeError, TimeoutError, RuntimeError,
                                                 IndexError)}
_ERRORS = {**_BUILTIN_ERRORS, **{name: getattr(errors, name) for name in errors.__all__
                                 if isinstance(getattr(errors, name), type)}}
_PLAIN = (type(None), bool, int, float, str)


class SeamCodecError(ValueError):
    """A seam message that does not decode: malformed, or naming a type this side does not build."""


class ErrorNames:
    """Names each error object sent with a number of its own, so the receiver can tell one failure reaching many
    arrays from many failures (`Interned`): the embedded client's arrays share the very error object too."""

    def __init__(self):
        self._numbers: "weakref.WeakKeyDictionary[BaseException, int]" = weakref.WeakKeyDictionary()
        self._next = itertools.count(1)
        self._lock = threading.Lock()

    def __call__(self, error: BaseException) -> int:
        """Its number; 0 (none) for a built-in error (``ValueError``), which takes no weak reference."""
        with self._lock:
            try:
                number = self._numbers.get(error)
                if number is None:
                    number = self._numbers[error] = next(self._next)
            except TypeError:
                return 0
            return number


class Interned:
    """The receiving end of `ErrorNames`: one error object per number, for as long as anything holds it."""

    def __init__(self):
        self._errors: "weakref.WeakValueDictionary[int, BaseException]" = weakref.WeakValueDictionary()

    def get(self, number: int, make):
        error = self._errors.get(number)
        if error is None:
            error = make()
            try:
                self._errors[number] = error
            except TypeError:   # a built-in error (a ValueError) takes no weak reference: one object per message
                pass
        return error


def encode(message, names: ErrorNames | None = None) -> list:
    """``message`` as frames: the JSON tree first, then the byte frames it refers to (``names``: number errors)."""
    frames: list = [b""]
    tree = _to_tree(message, frames, 0, names)
    frames[0] = json.dumps(tree, separators=(",", ":")).encode()
    return frames


def decode(frames: Sequence, interned: Interned | None = None):
    """The message ``encode`` made of ``frames`` (zmq frames or bytes); ``interned``: one object per numbered
    error."""
    if not frames:
        raise SeamCodecError("an empty seam message: expected a JSON frame first")
    text = _bytes(frames[0])
    containers = text.count(b"[") + text.count(b"{")   # an over-count (brackets in strings too): safe side
    if containers > MAX_CONTAINERS:
        raise SeamCodecError(f"a seam message of {containers} lists and objects: expected at most {MAX_CONTAINERS}")
    try:
        tree = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise SeamCodecError(f"a seam message whose first frame is not JSON: {exc}") from None
    return _from_tree(tree, [_bytes(f) for f in frames[1:]], 0, interned)


def _bytes(frame) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)


# ------------------------------------------------------------ encoding

def _to_tree(value, frames: list, depth: int, names=None):
    if depth > MAX_DEPTH:
        raise SeamCodecError(f"a seam message nested deeper than {MAX_DEPTH}")
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        if not len(value):
            return {"$b": -1}   # no frame for nothing (most events carry an empty put token)
        frames.append(value)
        return {"$b": len(frames) - 2}
    if isinstance(value, BaseException):
        return _error_tree(value, frames, depth, names)
    name = type(value).__name__
    if isinstance(value, tuple):
        return {"$t": [_to_tree(v, frames, depth + 1, names) for v in value]}
    if isinstance(value, list):
        return [_to_tree(v, frames, depth + 1, names) for v in value]
    if isinstance(value, dict):
        return {"$d": [[_to_tree(k, frames, depth + 1, names), _to_tree(v, frames, depth + 1, names)]
                       for k, v in value.items()]}
    if _DATACLASSES.get(name) is type(value):
        return {"$c": name, "f": {f.name: _to_tree(getattr(value, f.name), frames, depth + 1, names)
                                  for f in dataclasses.fields(value)}}
    if hasattr(value, "SerializeToString") and getattr(pb, name, None) is type(value):
        frames.append(value.SerializeToString())
        return {"$pb": name, "b": len(frames) - 2}
    if hasattr(value, "__buffer__") or hasattr(value, "tobytes"):   # a constant's frame (numpy, a zmq Frame)
        frames.append(memoryview(value).cast("B") if hasattr(value, "__buffer__") else value.tobytes())
        return {"$b": len(frames) - 2}
    raise SeamCodecError(f"cannot send a {type(value).__qualname__} across the seam: expected plain values, "
                         f"tuples, lists, dicts, bytes, errors, protobuf messages or one of {sorted(_DATACLASSES)}")


def _error_tree(error: BaseException, frames: list, depth: int, names=None) -> dict:
    number = names(error) if names is not None else 0
    name = type(error).__name__
    if _ERRORS.get(name) is not type(error):
        # Not one this side may build: the nearest family that is, with the original type in its text.
        family = next((cls for cls in type(error).__mro__ if _ERRORS.get(cls.__name__) is cls), None)
        text = f"{type(error).__qualname__}: {error}"
        error = (family or errors.PathwaysError)(text) if family in (None, errors.PathwaysError) or \
            family in _BUILTIN_ERRORS.values() else errors.PathwaysError(text)
        name = type(error).__name__
    attrs = {k: _to_tree(v, frames, depth + 1) for k, v in vars(error).items() if isinstance(v, _PLAIN)}
    args = [_to_tree(a, frames, depth + 1) for a in error.args if isinstance(a, _PLAIN)]
    return {"$e": name, "a": args, "v": attrs, **({"n": number} if number else {})}


# ------------------------------------------------------------ decoding

def _from_tree(tree, frames: list, depth: int, interned=None):
    if depth > MAX_DEPTH:
        raise SeamCodecError(f"a seam message nested deeper than {MAX_DEPTH}")
    if isinstance(tree, _PLAIN):
        return tree
    if isinstance(tree, list):
        return [_from_tree(v, frames, depth + 1, interned) for v in tree]
    if not isinstance(tree, dict) or len(tree) not in (1, 2, 3, 4):
        raise SeamCodecError(f"a seam message node {str(tree)[:80]!r}: expected a tagged object")
    if "$t" in tree:
        return tuple(_from_tree(v, frames, depth + 1, interned) for v in _list(tree["$t"]))
    if "$d" in tree:
        return {_hashable(_from_tree(k, frames, depth + 1, interned)): _from_tree(v, frames, depth + 1, interned)
                for k, v in (_pair(p) for p in _list(tree["$d"]))}
    if "$b" in tree:
        return b"" if tree["$b"] == -1 else _frame(frames, tree["$b"])
    if "$c" in tree:
        return _build(tree, frames, depth, interned)
    if "$pb" in tree:
        cls = getattr(pb, str(tree["$pb"]), None)
        if not (isinstance(cls, type) and hasattr(cls, "FromString") and hasattr(cls, "DESCRIPTOR")):
            raise SeamCodecError(f"a seam message names protobuf type {tree['$pb']!r}, not one of pathways.proto")
        try:
            return cls.FromString(_frame(frames, tree.get("b")))
        except Exception as exc:   # protobuf's DecodeError
            raise SeamCodecError(f"a {tree['$pb']} that does not parse: {exc}") from None
    if "$e" in tree:
        number = tree.get("n")
        if interned is not None and isinstance(number, int) and number > 0:
            return interned.get(number, lambda: _build_error(tree, frames, depth))
        return _build_error(tree, frames, depth)
    raise SeamCodecError(f"a seam message node with keys {sorted(tree)[:4]}: expected $t, $d, $b, $c, $pb or $e")


def _build(tree: dict, frames: list, depth: int, interned=None):
    name = str(tree["$c"])
    cls = _DATACLASSES.get(name)
    if cls is None:
        raise SeamCodecError(f"a seam message names type {name!r}: expected one of "
                             f"{sorted(_DATACLASSES)}")
    fields = tree.get("f")
    if not isinstance(fields, dict):
        raise SeamCodecError(f"a {name} without its fields")
    try:
        return cls(**{str(k): _from_tree(v, frames, depth + 1, interned) for k, v in fields.items()})
    except TypeError as exc:   # unknown or missing fields
        raise SeamCodecError(f"a {name} with fields {sorted(fields)}: {exc}") from None


def _build_error(tree: dict, frames: list, depth: int) -> BaseException:
    cls = _ERRORS.get(str(tree["$e"]))
    if cls is None:
        raise SeamCodecError(f"a seam message names error {tree['$e']!r}: expected one of {sorted(_ERRORS)}")
    error = cls.__new__(cls)
    error.args = tuple(_from_tree(a, frames, depth + 1) for a in _list(tree.get("a", [])))
    attrs = tree.get("v", {})
    if not isinstance(attrs, dict):
        raise SeamCodecError(f"a {cls.__name__} whose attributes are not an object")
    for key, value in attrs.items():
        value = _from_tree(value, frames, depth + 1)
        if isinstance(value, _PLAIN) and not str(key).startswith("__"):
            setattr(error, str(key), value)
    return error


def _list(value) -> list:
    if not isinstance(value, list):
        raise SeamCodecError(f"expected a JSON list in a seam message, got {type(value).__name__}")
    return value


def _pair(value) -> tuple:
    if not isinstance(value, list) or len(value) != 2:
        raise SeamCodecError("a dict entry of a seam message: expected [key, value]")
    return value[0], value[1]


def _hashable(key):
    try:
        hash(key)
    except TypeError:
        raise SeamCodecError(f"a dict key of a seam message that cannot be a key: {type(key).__name__}") from None
    return key


def _frame(frames: list, index) -> bytes:
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(frames):
        raise SeamCodecError(f"a seam message refers to frame {index!r}; it has {len(frames)}")
    return frames[index]
