"""Same-host copies through shared memory: a ring per direction, an eventfd per wake-up, no ZeroMQ and no CURVE
inside a host (issue 49, point 1; the ring itself is executor/native/shm_ring.cpp).

How two executors of one host pair up, over the authenticated channel they already have:

1. The sender (writer) listens on an abstract Unix SOCK_SEQPACKET socket with a random name, once, and offers a
   ring to a peer by adding a `RingInvite` (that name, a random token for that peer's address and key, its
   incarnation) to the copies it sends it the usual way, over ZeroMQ with CURVE, until a ring is up.
2. The receiver (reader), reading such a copy, connects to that name and checks who listens there (SO_PEERCRED: a
   process of its own user, else it sends nothing: a name freed by a dead inviter and taken by another user gets no
   ring), then makes the ring (a memfd of the ring's bytes, sealed at its size, and two eventfds: data committed,
   space freed) and sends the three descriptors (SCM_RIGHTS) with the token. A sender on another host (or in another
   network namespace) has no such socket there: the connection fails, and that peer stays on ZeroMQ.
3. The sender takes the descriptors only with a token it gave out, from a process of its own user (SO_PEERCRED of
   the connection), and only a ring made for its own incarnation (a stale one is refused); from then on its copies
   to that peer are written
   into the ring by the thread that makes them, and the reader's compute thread is woken once (its eventfd is
   polled with its sockets).

Nothing is left in ``/dev/shm`` or on the file system: a memfd and an abstract socket go with their last process.
A writer killed mid-write never shows a torn message (the commit word is the ring's ``head``); the reader of a
replaced writer drops that ring (a replacement offers a fresh one).

A message in the ring is one copy: an 8-byte count of the envelope's bytes, the envelope (padded so the frames that
follow start 64-byte aligned), then the payload frames, each preceded by its 8-byte size.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import struct

import numpy

from . import native_lib

__all__ = ["Ring", "RingWriter", "RingReader", "RING_BYTES", "MAX_MESSAGE_BYTES", "RingRefused", "sealed_memfd",
           "sealed_size"]

log = logging.getLogger(__name__)

RING_BYTES = 8 << 20   # each direction's data bytes (a bigger copy goes in chunks as the reader frees space)
MAX_MESSAGE_BYTES = 1 << 34   # a copy bigger than this through a ring is refused (and the ring broken)
_ALIGN = 64
_u64 = ctypes.c_uint64
_vp = ctypes.c_void_p


class RingRefused(RuntimeError):
    """A ring that does not check: another version, another size, made for other incarnations, or corrupt."""


class _Side(ctypes.Structure):
    """One side's private view of a ring (`pw_ring_view`): never in the shared mapping, so a peer that rewrites the
    header cannot move what this side indexes by."""

    _fields_ = [("base", _vp), ("capacity", _u64), ("position", _u64)]


_SideP = ctypes.POINTER(_Side)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.pw_ring_bytes.argtypes, lib.pw_ring_bytes.restype = [_u64], _u64
    lib.pw_ring_init.argtypes, lib.pw_ring_init.restype = [_vp, _u64, _u64, _u64], ctypes.c_int
    lib.pw_ring_attach.argtypes, lib.pw_ring_attach.restype = [_vp, _u64, _u64, _u64, _SideP], ctypes.c_int
    lib.pw_ring_write.argtypes = [_SideP, _u64, ctypes.POINTER(_vp), ctypes.POINTER(_u64), ctypes.c_int,
                                  ctypes.POINTER(_u64), ctypes.POINTER(ctypes.c_int)]
    lib.pw_ring_write.restype = ctypes.c_int
    lib.pw_ring_next.argtypes = [_SideP] + [ctypes.POINTER(_u64)] * 5
    lib.pw_ring_next.restype = ctypes.c_int
    lib.pw_ring_release.argtypes, lib.pw_ring_release.restype = [_SideP, ctypes.POINTER(ctypes.c_int)], ctypes.c_int
    lib.pw_ring_reader_sleep.argtypes, lib.pw_ring_reader_sleep.restype = [_SideP], ctypes.c_int
    lib.pw_ring_reader_awake.argtypes, lib.pw_ring_reader_awake.restype = [_SideP], None
    lib.pw_ring_released.argtypes, lib.pw_ring_released.restype = [_SideP, ctypes.POINTER(_u64)], ctypes.c_int
    lib.pw_ring_broken.argtypes, lib.pw_ring_broken.restype = [_SideP], ctypes.c_int
    return lib


_lib = None


def _ring_lib() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib = _bind(native_lib.library())
    return _lib


# Shared memory (a ring's, a host group's) is a memfd sealed at its size before it is passed: neither side can shrink
# it under the other (a SIGBUS).
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def sealed_memfd(name: str, size: int) -> int:
    """A memfd of ``size`` bytes, sealed at that size (close-on-exec); nothing named in ``/dev/shm``."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def sealed_size(fd: int) -> int:
    """The size of a memfd a peer sent; ValueError unless it is sealed at that size."""
    if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
        raise ValueError("its memory is not sealed at its size")
    return os.fstat(fd).st_size


class Ring:
    """One direction's mapping, this side's private view of it (`side`) and its two eventfds (``data_fd``: the writer
    wakes the reader; ``space_fd``: the reader wakes the writer). Made by the reader (`create`), handed to the
    writer as descriptors (`attach`)."""

    def __init__(self, memfd: int, data_fd: int, space_fd: int, size: int):
        self.lib = _ring_lib()
        self.memfd, self.data_fd, self.space_fd, self.size = memfd, data_fd, space_fd, size
        self.closed = True   # until mapped
        self.mapping = mmap.mmap(memfd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._anchor = (ctypes.c_char * size).from_buffer(self.mapping)   # the mapping's address, for the library
        self.base = ctypes.addressof(self._anchor)
        self.view = memoryview(self.mapping)
        self.side = _Side()
        self.closed = False

    @classmethod
    def create(cls, writer_epoch: int, reader_epoch: int, capacity: int = RING_BYTES) -> "Ring":
        lib = _ring_lib()
        size = lib.pw_ring_bytes(capacity)
        if not size:
            raise ValueError(f"ring capacity: expected a power of two from 4 KiB to 16 GiB, got {capacity}")
        fds = [sealed_memfd("pathways-ring", size)]
        try:
            fds += [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(2)]
            ring = cls(*fds, size)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        made = lib.pw_ring_init(ring.base, capacity, writer_epoch, reader_epoch)
        if made or lib.pw_ring_attach(ring.base, size, writer_epoch, reader_epoch, ring.side):
            ring.close()
            raise RingRefused(f"a ring of {capacity} bytes could not be made ({os.strerror(-made) if made else ''})")
        return ring

    @classmethod
    def attach(cls, fds: list[int], writer_epoch: int, reader_epoch: int) -> "Ring":
        """The writer's side of a ring it was sent; `RingRefused` (the descriptors closed) unless it checks: a
        memfd sealed at its size, a fresh ring of this version made for these incarnations."""
        memfd, data_fd, space_fd = fds
        try:
            ring = cls(memfd, data_fd, space_fd, sealed_size(memfd))
        except (OSError, ValueError) as exc:
            for fd in fds:
                os.close(fd)
            raise RingRefused(f"a ring that cannot be mapped: {exc}") from exc
        checked = ring.lib.pw_ring_attach(ring.base, ring.size, writer_epoch, reader_epoch, ring.side)
        if checked:
            ring.close()
            why = {errno.ESTALE: "it was made for another incarnation", errno.EPROTO: "not a fresh ring of this "
                   "version and size"}.get(-checked, os.strerror(-checked))
            raise RingRefused(f"a ring refused: {why} (expected writer incarnation {writer_epoch}, reader "
                              f"{reader_epoch})")
        return ring

    def wake(self, fd: int) -> None:
        try:
            os.eventfd_write(fd, 1)
        except BlockingIOError:   # the counter is full: the other side is awake anyway
            pass

    @staticmethod
    def drain(fd: int) -> None:
        try:
            os.eventfd_read(fd)
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.view.release()
            del self._anchor
            self.mapping.close()
        finally:
            for fd in (self.memfd, self.data_fd, self.space_fd):
                os.close(fd)


def _frames_of(envelope: bytes, payload: list) -> list:
    """A copy as the buffers the ring gathers: the envelope's size and bytes, then each frame's size and bytes,
    each size word starting 64-byte aligned and followed by pad to 64, so every frame starts aligned."""
    head = struct.pack("<Q", len(envelope)) + envelope
    parts, at = [head], len(head)
    for frame in payload:
        view = memoryview(frame.buffer if hasattr(frame, "buffer") else frame).cast("B")
        size = b"\0" * (-at % _ALIGN) + struct.pack("<Q", view.nbytes) + b"\0" * (_ALIGN - 8)
        parts += [size, view]
        at += len(size) + view.nbytes
    return parts


def _split(message: memoryview) -> tuple[bytes, list]:
    """A message back into its envelope's bytes and its frames (views of ``message``)."""
    if message.nbytes < 8:
        raise RingRefused(f"a ring message of {message.nbytes} bytes: expected at least 8")
    (size,) = struct.unpack_from("<Q", message, 0)
    at = 8 + size
    if at > message.nbytes:
        raise RingRefused(f"a ring message names a {size}-byte envelope in {message.nbytes} bytes")
    envelope = bytes(message[8:at])
    frames = []
    while at < message.nbytes:
        at += -at % _ALIGN
        if at + _ALIGN > message.nbytes:
            raise RingRefused("a ring message ends inside a frame's size")
        (length,) = struct.unpack_from("<Q", message, at)
        at += _ALIGN
        if at + length > message.nbytes:
            raise RingRefused(f"a ring frame of {length} bytes runs past its message")
        frames.append(message[at:at + length])
        at += length
    return envelope, frames


class RingWriter:
    """The sending side (one thread: the sender's compute thread). `send` writes at once what fits; the rest waits
    in order and goes with `flush` when the reader frees space (``ring.space_fd`` readable). Each message carries a
    ``tag`` (what the caller reports if it is lost); `unread` gives the tags of those the reader has not read yet
    (waiting, or in the ring), for a writer that must give the ring up."""

    def __init__(self, ring: Ring):
        self.ring = ring
        self._pending: collections.deque = collections.deque()   # [seq, parts, offset, tag]
        self._in_ring: collections.deque = collections.deque()   # (ring position past its last chunk, tag)
        self._seq = 0
        self.sent = 0      # messages wholly in the ring
        self.broken = ""

    def send(self, envelope: bytes, payload: list, tag=None) -> None:
        parts = _frames_of(envelope, payload)
        self._pending.append([self._seq, parts, 0, tag])
        self._seq += 1
        self.flush()

    @property
    def waiting(self) -> int:
        """Messages not fully in the ring yet."""
        return len(self._pending)

    def flush(self) -> None:
        """Write what waits, while the ring has room."""
        self.ring.drain(self.ring.space_fd)
        lib, wake, side = self.ring.lib, ctypes.c_int(0), ctypes.byref(self.ring.side)
        while self._pending and not self.broken:
            seq, parts, offset, tag = self._pending[0]
            arrays = [numpy.frombuffer(p, dtype=numpy.uint8) for p in parts]   # addresses, no copy
            pointers = (_vp * len(arrays))(*[a.ctypes.data if a.size else 0 for a in arrays])
            lengths = (_u64 * len(arrays))(*[a.size for a in arrays])
            at = _u64(offset)
            written = lib.pw_ring_write(side, seq, pointers, lengths, len(arrays), ctypes.byref(at),
                                        ctypes.byref(wake))
            self._pending[0][2] = at.value
            if wake.value:
                self.ring.wake(self.ring.data_fd)
            if written < 0:
                self.broken = f"the ring is broken ({os.strerror(-written)})"
                return
            if written == 0:
                return   # full: the reader wakes us (space_fd)
            self._pending.popleft()
            self._in_ring.append((self.ring.side.position, tag))
            self.sent += 1

    def check(self) -> bool:
        """Forget the messages the reader has read; False if the ring is broken (`unread` says what was lost)."""
        released = _u64(0)
        if self.broken or self.ring.lib.pw_ring_released(ctypes.byref(self.ring.side), ctypes.byref(released)):
            self.broken = self.broken or "the reader broke the ring"
            return False
        while self._in_ring and self._in_ring[0][0] <= released.value:
            self._in_ring.popleft()
        return True

    def unread(self) -> list:
        """The tags of messages the reader has not read: in the ring, then waiting to go in."""
        return [tag for _, tag in self._in_ring] + [entry[3] for entry in self._pending]


class RingReader:
    """The receiving side (the receiver's compute thread): `read` hands each whole message to ``on_message(envelope
    bytes, frames)``; the frames are views of a buffer of the message's own (copied out of the ring once, 64-byte
    aligned), so the ring's space is free again at once. A message bigger than ``max_message`` bytes, or whose
    chunks do not agree, breaks the ring (the writer then reports what it had in it as lost)."""

    def __init__(self, ring: Ring, on_message, max_message: int = MAX_MESSAGE_BYTES):
        self.ring = ring
        self._on_message = on_message
        self._max_message = max_message
        self._assembly = None   # (seq, total, buffer, bytes so far)
        self.received = 0
        self.refused = 0
        self.broken = ""

    def read(self, most: int = 64) -> int:
        """Handle up to ``most`` whole messages committed now; how many were handled."""
        lib, ring, side = self.ring.lib, self.ring, ctypes.byref(self.ring.side)
        seq, total, offset, length, data_at = (_u64() for _ in range(5))
        wake, handled = ctypes.c_int(0), 0
        while handled < most and not self.broken:
            got = lib.pw_ring_next(side, *(ctypes.byref(v) for v in (seq, total, offset, length, data_at)))
            if got < 0:
                self._break(f"the ring is broken ({os.strerror(-got)})")
                return handled
            if got == 0:
                return handled
            try:
                message = self._place(seq.value, total.value, offset.value, length.value, data_at.value)
            except (MemoryError, ValueError) as exc:   # never leave a chunk unreleased: it would be read forever
                self._break(f"a chunk of message {seq.value} could not be placed ({type(exc).__name__}: {exc})")
                return handled
            lib.pw_ring_release(side, ctypes.byref(wake))
            if wake.value:
                ring.wake(ring.space_fd)
            if message is not None:
                handled += 1
                self._deliver(message)
        return handled

    def _place(self, seq: int, total: int, offset: int, length: int, data_at: int):
        """Copy a chunk into its message's buffer; the message once whole."""
        if offset == 0:
            if total > self._max_message:
                raise ValueError(f"a {total}-byte message: at most {self._max_message} are taken")
            self._assembly = (seq, total, _aligned_buffer(total), 0)
        if self._assembly is None or self._assembly[0] != seq or self._assembly[1] != total or \
                self._assembly[3] != offset:
            raise ValueError(f"a chunk of message {seq} (of {total} bytes) at byte {offset}: out of order")
        _, _, buffer, _ = self._assembly
        buffer[offset:offset + length] = self.ring.view[data_at:data_at + length]
        self._assembly = (seq, total, buffer, offset + length)
        if offset + length < total:
            return None
        self._assembly = None
        return buffer

    def _deliver(self, message: memoryview) -> None:
        try:
            envelope, frames = _split(message)
        except RingRefused as exc:
            self.refused += 1
            log.warning("a ring message refused: %s", exc)
            return
        self.received += 1
        self._on_message(envelope, frames)

    def _break(self, why: str) -> None:
        self.broken = why
        self.refused += 1
        log.warning("a shared-memory ring was dropped: %s", why)

    def sleep(self) -> bool:
        """Ask to be woken by the writer's next commit; False if something came meanwhile (read it, do not sleep)."""
        self.ring.drain(self.ring.data_fd)
        return self.ring.lib.pw_ring_reader_sleep(ctypes.byref(self.ring.side)) == 0

    def awake(self) -> None:
        self.ring.lib.pw_ring_reader_awake(ctypes.byref(self.ring.side))


def _aligned_buffer(nbytes: int) -> memoryview:
    """A writable buffer whose first byte is 64-byte aligned (frames at aligned offsets in it are then aligned for
    torch: `Backend.from_frame` makes no copy)."""
    raw = numpy.empty(nbytes + _ALIGN, dtype=numpy.uint8)
    skip = -raw.ctypes.data % _ALIGN
    return memoryview(raw[skip:skip + nbytes])
