"""A process group of the executors of one host over one shared mapping (issue 49, point 2): all_reduce,
all_gather, reduce_scatter, broadcast and all_to_all run on the calling thread in the native library
(executor/native/shm_collectives.cpp: one futex wait per step, no helper thread, no socket), where gloo would wake
three threads of its own per op. gloo stays for a group whose members span hosts (or network namespaces).

How a group forms, through the rendezvous store the controller keeps for it (reached over each executor's CURVE
connection, `executor.rendezvous`):

1. Every member sets its host key (the boot id, its uid and its network namespace; a member with
   ``PATHWAYS_SHM_COLLECTIVES=0`` sets a key of its own that matches nobody's).
2. Member 0 reads them all. Where every key equals its own, it makes the mapping (a memfd sealed at its size:
   nothing in ``/dev/shm``, gone with its last process), listens on an abstract Unix SOCK_SEQPACKET socket with a
   random name and sets that name as the group's answer; else it sets ``gloo``.
3. The others read the answer; under a name, each connects, checks that a process of its own user listens
   (SO_PEERCRED) and receives the memfd; member 0 sends it only to a process of its own user. Every member maps it
   and checks it was made for this group (its geometry and the group's tag, from the store prefix).
"""

from __future__ import annotations

import array
import ctypes
import errno
import hashlib
import mmap
import os
import secrets
import socket
import time

from . import native_lib
from .ring_offers import fds_of, peer_uid
from .shm_ring import sealed_memfd, sealed_size

__all__ = ["ShmGroup", "HostGroupError", "form_host_group", "host_key", "ENABLE_ENV", "DTYPES"]

ENABLE_ENV = "PATHWAYS_SHM_COLLECTIVES"   # "0": this executor's groups use gloo, even within a host
SLOT_BYTES = 512 << 10    # each member's stripe per step (two banks of them): a bigger op goes in several steps
_HOST_KEY = "pathways-host/{}"
_ANSWER_KEY = "pathways-shm"
_GLOO = b"gloo"
_NAME_PREFIX = b"\0pathways-group-"
_KINDS = {"all_reduce": 1, "all_gather": 2, "reduce_scatter": 3, "broadcast": 4, "all_to_all": 5}
_REDUCES = {"sum": 0, "max": 1, "min": 2, "product": 3}
_WHY_BYTES = 512


def _dtype_ids() -> dict:
    import torch

    return {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3, torch.int8: 4, torch.uint8: 5,
            torch.int16: 6, torch.int32: 7, torch.int64: 8, torch.bool: 9}


DTYPES = None   # torch dtype -> the library's id, filled at the first group (torch imported then)


class HostGroupError(RuntimeError):
    """A collective of a host group failed: timed out (``timed_out``), or its members ran different ops."""

    def __init__(self, text: str, timed_out: bool = False):
        super().__init__(text)
        self.timed_out = timed_out


class _Op(ctypes.Structure):
    """`pw_coll_op` (executor/native/shm_collectives.h)."""

    _fields_ = [("kind", ctypes.c_int32), ("dtype", ctypes.c_int32), ("reduce", ctypes.c_int32),
                ("root", ctypes.c_int32), ("count", ctypes.c_uint64), ("tag", ctypes.c_uint64),
                ("input", ctypes.c_void_p), ("output", ctypes.c_void_p), ("timeout_s", ctypes.c_double)]


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    vp, u64, i32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int32
    lib.pw_coll_bytes.argtypes, lib.pw_coll_bytes.restype = [i32, u64], u64
    lib.pw_coll_init.argtypes, lib.pw_coll_init.restype = [vp, u64, i32, u64, u64], ctypes.c_int
    lib.pw_coll_attach.argtypes, lib.pw_coll_attach.restype = [vp, u64, i32, i32, u64, u64], vp
    lib.pw_coll_detach.argtypes, lib.pw_coll_detach.restype = [vp], None
    lib.pw_coll_abandon.argtypes, lib.pw_coll_abandon.restype = [vp], None
    lib.pw_coll_refused.argtypes, lib.pw_coll_refused.restype = [vp], u64
    lib.pw_coll_run.argtypes = [vp, ctypes.POINTER(_Op), ctypes.c_char_p, u64]
    lib.pw_coll_run.restype = ctypes.c_int
    return lib


_lib = None


def _library() -> ctypes.CDLL:
    global _lib, DTYPES
    if _lib is None:
        DTYPES = _dtype_ids()
        _lib = _bind(native_lib.library())
    return _lib


class ShmGroup:
    """One member's side of a host group: the mapping, its private view in the library (``handle``), and the ops.

    Ops take and return CPU tensors; every member must run the same ops in the same order (as with gloo). A
    failed op (abandoned, timed out, out of step) leaves the group failed on every member."""

    def __init__(self, memfd: int, rank: int, size: int, group_tag: int, slot_bytes: int = SLOT_BYTES,
                 timeout_s: float = 60.0, members=(), create: bool = False):
        self.lib = _library()
        self._rank, self.size, self.timeout_s = rank, size, timeout_s
        self.members = tuple(members) or tuple(str(r) for r in range(size))
        self.bytes = self.lib.pw_coll_bytes(size, slot_bytes)
        if not self.bytes:
            raise ValueError(f"a host group of {size} members with {slot_bytes}-byte slots: expected 1 to 1024 "
                             f"members and slots of a multiple of 64 bytes, at least 64 per member")
        self.mapping = mmap.mmap(memfd, self.bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._anchor = (ctypes.c_char * self.bytes).from_buffer(self.mapping)
        base = ctypes.addressof(self._anchor)
        if create and self.lib.pw_coll_init(base, self.bytes, size, slot_bytes, group_tag):
            self._unmap()
            raise ValueError("the host group's mapping could not be initialised")
        self.handle = self.lib.pw_coll_attach(base, self.bytes, rank, size, slot_bytes, group_tag)
        if not self.handle:
            self._unmap()
            raise HostGroupError(f"the mapping member 0 sent was not made for this group ({size} members, "
                                 f"{slot_bytes}-byte slots, tag {group_tag:#x}): refused")
        self.run_address = ctypes.cast(self.lib.pw_coll_run, ctypes.c_void_p).value   # for the XLA custom calls
        self._why = ctypes.create_string_buffer(_WHY_BYTES)
        self._op = _Op()

    def rank(self) -> int:   # as a torch ProcessGroup's
        return self._rank

    # ------------------------------------------------------------ ops

    def all_reduce(self, x, op: str = "sum"):
        """A new tensor: the reduction (sum, max, min or product) of every member's ``x``."""
        return self._run("all_reduce", x, x.numel(), reduce=op)

    def all_gather(self, x, dim: int = 0):
        """Every member's ``x``, concatenated along ``dim`` in member order."""
        import torch

        x = x.contiguous()
        out = torch.empty((self.size, *x.shape), dtype=x.dtype)
        self._call("all_gather", x, out, x.numel())
        return out.reshape(self.size * x.shape[0], *x.shape[1:]) if dim == 0 and x.dim() else \
            torch.cat(out.unbind(0), dim=dim) if x.dim() else out

    def reduce_scatter(self, x, op: str = "sum", dim: int = 0):
        """This member's chunk (``x.chunk(size, dim)``) of the reduction of every member's ``x``."""
        import torch

        if x.dim() == 0 or x.shape[dim] % self.size:   # uneven chunks: reduce all and keep ours
            return self.all_reduce(x, op).chunk(self.size, dim=dim)[self._rank].contiguous()
        parts = torch.stack(x.chunk(self.size, dim=dim)) if dim else x.contiguous()
        chunk_shape = x.chunk(self.size, dim=dim)[0].shape
        out = torch.empty(chunk_shape, dtype=x.dtype)
        self._call("reduce_scatter", parts, out, out.numel(), reduce=op)
        return out

    def broadcast(self, x, root: int = 0):
        """Member ``root``'s ``x``, on every member (``x`` is the shape to receive into on the others)."""
        return self._run("broadcast", x, x.numel(), root=root)

    def all_to_all(self, x):
        """``x``'s part i (of ``size`` equal parts along dim 0) goes to member i; the result's part j came from j."""
        if x.dim() == 0 or x.shape[0] % self.size:
            raise ValueError(f"all_to_all: expected a leading dimension divisible by the group's {self.size} members, "
                             f"got shape {tuple(x.shape)}")
        return self._run("all_to_all", x, x.numel() // self.size)

    def _run(self, kind: str, x, count: int, **kwargs):
        out = x.contiguous().clone()
        self._call(kind, out, out, count, **kwargs)
        return out

    def _call(self, kind: str, x, out, count: int, reduce: str = "sum", root: int = 0) -> None:
        dtype = DTYPES.get(x.dtype)
        if dtype is None or x.device.type != "cpu":
            raise TypeError(f"{kind} on a host group: expected a CPU tensor of {sorted(map(str, DTYPES))}, got "
                            f"{x.dtype} on {x.device}")
        op = self._op
        op.kind, op.dtype, op.reduce, op.root = _KINDS[kind], dtype, _REDUCES[reduce], root
        op.count, op.tag, op.timeout_s = count, 0, self.timeout_s
        op.input, op.output = x.data_ptr(), out.data_ptr()
        code = self.lib.pw_coll_run(self.handle, op, self._why, _WHY_BYTES)
        if code:
            raise self._error(kind, code)

    def _error(self, kind: str, code: int) -> Exception:
        why = self._why.value.decode(errors="replace")
        for rank, member in enumerate(self.members):   # name the members, not their ranks
            why = why.replace(f"member {rank} ", f"member {member} ").replace(f"member(s) {rank}", f"member(s) {member}")
        from .axis_binding import CollectiveAbandoned

        if code == -errno.ECANCELED:
            return CollectiveAbandoned(f"{kind} on a host group: {why}")
        return HostGroupError(f"{kind} on a host group: {why}", timed_out=code == -errno.ETIMEDOUT)

    # ------------------------------------------------------------ lifetime

    def abandon(self) -> None:
        """Any thread: a wait in this group ends within one 200 ms slice; this and later ops fail."""
        if self.handle:
            self.lib.pw_coll_abandon(self.handle)

    @property
    def refused(self) -> int:
        """Steps refused here because a member's op did not match this member's."""
        return self.lib.pw_coll_refused(self.handle) if self.handle else 0

    def close(self) -> None:
        if self.handle:
            self.lib.pw_coll_detach(self.handle)
            self.handle = None
        self._unmap()

    def _unmap(self) -> None:
        anchor, self._anchor = getattr(self, "_anchor", None), None
        del anchor
        if getattr(self, "mapping", None) is not None:
            self.mapping.close()
            self.mapping = None

    def __del__(self):
        try:
            self.close()
        except Exception:   # interpreter shutdown
            pass


# ---------------------------------------------------------------- forming one


def host_key() -> bytes:
    """Equal on two executors exactly when they can share a memfd through an abstract socket: the same boot of the
    same machine, the same user, the same network namespace (abstract names are per namespace)."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return b"off-" + secrets.token_hex(8).encode()
    with open("/proc/sys/kernel/random/boot_id", "rb") as f:
        boot = f.read().strip()
    return b"%s/%d/%d" % (boot, os.getuid(), os.stat("/proc/self/ns/net").st_ino)


def group_tag(prefix: str) -> int:
    """A 64-bit tag of the group's store prefix (``group-G/epoch-E``): a mapping made for another group is refused."""
    return int.from_bytes(hashlib.sha256(prefix.encode()).digest()[:8], "little")


def form_host_group(store, rank: int, size: int, timeout_s: float, prefix: str, members=()) -> ShmGroup | None:
    """This member's `ShmGroup` where every member is on this host, else None (the caller forms a gloo group): every
    member gets the same answer. Blocks until every member has joined, or ``timeout_s``."""
    if size < 2:
        return None
    mine = host_key()
    store.set(_HOST_KEY.format(rank), mine)
    tag = group_tag(prefix)
    if rank == 0:
        same = all(store.get(_HOST_KEY.format(r)) == mine for r in range(1, size))
        if not same:
            store.set(_ANSWER_KEY, _GLOO)
            return None
        return _make_and_send(store, size, timeout_s, tag, members)
    answer = store.get(_ANSWER_KEY)
    if answer == _GLOO:
        return None
    return _receive(answer, rank, size, timeout_s, tag, members)


def _make_and_send(store, size: int, timeout_s: float, tag: int, members) -> ShmGroup:
    lib = _library()
    memfd = sealed_memfd("pathways-group", lib.pw_coll_bytes(size, SLOT_BYTES))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        group = ShmGroup(memfd, 0, size, tag, timeout_s=timeout_s, members=members, create=True)
        name = _NAME_PREFIX + secrets.token_hex(16).encode()
        listener.bind(name)
        listener.listen(size)
        store.set(_ANSWER_KEY, name)
        deadline = time.monotonic() + timeout_s
        sent = 0
        while sent < size - 1:
            listener.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                connection, _ = listener.accept()
            except socket.timeout:
                group.close()
                raise HostGroupError(f"{size - 1 - sent} of the host group's members did not connect within "
                                     f"{timeout_s:.0f} s") from None
            with connection:
                if peer_uid(connection) != os.getuid():   # another user's process found the name: nothing for it
                    continue
                connection.sendmsg([b"G"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [memfd]))])
                sent += 1
        return group
    finally:
        listener.close()
        os.close(memfd)


def _receive(name: bytes, rank: int, size: int, timeout_s: float, tag: int, members) -> ShmGroup:
    if not name.startswith(_NAME_PREFIX):
        raise HostGroupError(f"member 0 answered {name[:40]!r} for the host group's mapping: expected a socket name")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as connection:
        connection.settimeout(timeout_s)
        connection.connect(name)
        if peer_uid(connection) != os.getuid():
            raise HostGroupError(f"the host group's socket belongs to uid {peer_uid(connection)}, not ours: refused")
        _, ancillary, _, _ = connection.recvmsg(8, socket.CMSG_SPACE(4), socket.MSG_CMSG_CLOEXEC)
    fds = fds_of(ancillary)
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise HostGroupError(f"member 0 sent {len(fds)} descriptors for the host group's mapping, expected 1")
    try:
        try:
            size_bytes = sealed_size(fds[0])   # a mapping that could shrink under us: a SIGBUS
        except ValueError as exc:
            raise HostGroupError(f"the host group's mapping is refused: {exc}") from None
        needed = _library().pw_coll_bytes(size, SLOT_BYTES)
        if size_bytes < needed:
            raise HostGroupError(f"the host group's mapping is {size_bytes} bytes: expected {needed}")
        return ShmGroup(fds[0], rank, size, tag, timeout_s=timeout_s, members=members)
    finally:
        os.close(fds[0])
