"""The executor's native library (executor/native/*.cpp) held to native standards: its units built with
AddressSanitizer and UndefinedBehaviorSanitizer and run (tests/native/*.cpp: every size from 0 bytes to 64 MiB, a
wrap-around, a full ring, two processes, a writer killed mid-write, a stale, foreign or corrupt ring); and the
shared-memory ring as the executors use it (executor/shm_ring.py): offered, made, passed as descriptors, written and
read by two processes, and refused where it must be."""

from __future__ import annotations

import glob
import multiprocessing
import os
import struct
import subprocess

import pytest

from executor import native_lib
from executor.ring_offers import RingInviter, make_ring_for
from executor.shm_ring import Ring, RingReader, RingRefused, RingWriter, _frames_of, _split

pytestmark = pytest.mark.timeout(300)

TESTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "native")


def test_the_native_units_pass_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    program = native_lib.sanitized_build(str(tmp_path), sorted(glob.glob(os.path.join(TESTS, "*.cpp"))))
    done = subprocess.run([program], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=1",
                               "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "shm_ring: all passed" in done.stdout and "shm_collectives: all passed" in done.stdout, done.stdout[-2000:]


def test_a_sanitizer_report_fails_the_program(tmp_path):
    """The check above can fail: a unit that reads past a buffer is reported and the program ends non-zero."""
    bad = tmp_path / "overflow_test.cpp"
    bad.write_text("#include <cstdlib>\nint main() { int* p = (int*)std::malloc(4 * sizeof(int)); volatile int i = 4; "
                   "p[i] = 1; std::free(p); return 0; }\n")
    program = native_lib.sanitized_build(str(tmp_path), [str(bad)])
    done = subprocess.run([program], capture_output=True, text=True, timeout=60)
    # UBSan's object-size check or ASan's heap check, whichever sees it first
    assert done.returncode != 0 and ("heap-buffer-overflow" in done.stderr or "insufficient space" in done.stderr), \
        done.stderr[-2000:]


def test_the_library_is_rebuilt_when_a_source_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(native_lib, "SOURCE_DIR", str(tmp_path))
    (tmp_path / "a.cpp").write_text('extern "C" int pw_answer() { return 41; }\n')
    first = native_lib.build()
    (tmp_path / "a.cpp").write_text('extern "C" int pw_answer() { return 42; }\n')
    second = native_lib.build()
    assert first != second and os.path.exists(first) and os.path.exists(second)
    import ctypes

    assert ctypes.CDLL(second).pw_answer() == 42


def test_a_compile_error_names_the_command_and_what_the_compiler_said(tmp_path, monkeypatch):
    monkeypatch.setattr(native_lib, "SOURCE_DIR", str(tmp_path))
    (tmp_path / "broken.cpp").write_text("int f( {\n")
    with pytest.raises(native_lib.NativeUnavailable, match=r"(?s)broken\.cpp.*failed:.*error"):
        native_lib.build()


# ---------------------------------------------------------------- the ring as executors use it


def _pattern(seq: int, size: int) -> bytes:
    return bytes((seq * 131 + i * 7) & 0xFF for i in range(size)) if size < 4096 else \
        (bytes(range(256)) * (size // 256 + 1))[seq % 256: seq % 256 + size]


def _writer_process(name: bytes, token_out, sizes, epoch: int):
    inviter = RingInviter(epoch)
    token_out.send(inviter.invite("peer", b"key")[1])
    token_out.send(inviter.name)
    rings = []
    while not rings:
        rings = inviter.take()
    address, _, ring = rings[0]
    writer = RingWriter(ring)
    for seq, size in enumerate(sizes):
        writer.send(struct.pack("<Q", seq), [_pattern(seq, size)])
        while writer.waiting:
            os.eventfd_read(ring.space_fd) if _readable(ring.space_fd) else None
            writer.flush()
    token_out.send(("done", address, writer.sent, inviter.refused))


def _readable(fd: int) -> bool:
    import select

    return bool(select.select([fd], [], [], 0.05)[0])


def test_a_ring_offered_made_and_passed_carries_every_size_between_two_processes():
    sizes = [0, 1, 63, 64, 65536, 3 << 20, 20 << 20, 5, 0]
    parent, child = multiprocessing.Pipe()
    process = multiprocessing.get_context("fork").Process(target=_writer_process, args=(b"", child, sizes, 7))
    process.start()
    token, name = parent.recv(), parent.recv()
    ring = make_ring_for(name, token, writer_epoch=7, reader_epoch=3, capacity=1 << 20)
    assert ring is not None
    got = []
    reader = RingReader(ring, lambda envelope, frames: got.append((envelope, [bytes(f) for f in frames])))
    while len(got) < len(sizes):
        if reader.read() == 0 and reader.sleep():
            _readable(ring.data_fd)
            reader.awake()
    done = parent.recv()
    process.join(30)
    assert done == ("done", "peer", len(sizes), 0)
    for seq, (envelope, frames) in enumerate(got):
        assert struct.unpack("<Q", envelope)[0] == seq
        assert frames == [_pattern(seq, sizes[seq])], seq
    assert reader.received == len(sizes) and reader.refused == 0 and not reader.broken
    ring.close()


def test_an_offer_to_a_socket_that_is_not_here_makes_no_ring():
    assert make_ring_for(b"\0pathways-ring-" + b"0" * 32, b"t" * 16, 1, 1, capacity=1 << 12) is None
    assert make_ring_for(b"/tmp/not-abstract", b"t" * 16, 1, 1, capacity=1 << 12) is None


def test_a_ring_for_another_incarnation_is_refused():
    ring = Ring.create(writer_epoch=4, reader_epoch=2, capacity=1 << 12)
    fds = [os.dup(ring.memfd), os.dup(ring.data_fd), os.dup(ring.space_fd)]
    with pytest.raises(RingRefused, match="another incarnation"):
        Ring.attach(fds, writer_epoch=5, reader_epoch=2)
    fds = [os.dup(ring.memfd), os.dup(ring.data_fd), os.dup(ring.space_fd)]
    attached = Ring.attach(fds, writer_epoch=4, reader_epoch=2)
    attached.close()
    ring.close()


def test_the_inviter_refuses_a_ring_with_a_token_it_never_gave():
    inviter = RingInviter(epoch=1)
    inviter.invite("peer", b"key")
    assert make_ring_for(inviter.name, b"x" * 16, writer_epoch=1, reader_epoch=1, capacity=1 << 12) is not None
    assert inviter.take() == [] and inviter.refused == 1
    inviter.close()


def test_the_inviter_refuses_a_stale_ring_and_takes_a_fresh_one():
    inviter = RingInviter(epoch=2)
    name, token = inviter.invite("peer", b"key")
    stale = make_ring_for(name, token, writer_epoch=1, reader_epoch=1, capacity=1 << 12)
    assert inviter.take() == [] and inviter.refused == 1
    fresh = make_ring_for(name, token, writer_epoch=2, reader_epoch=1, capacity=1 << 12)
    taken = inviter.take()
    assert [(address, key) for address, key, _ in taken] == [("peer", b"key")]
    for _, _, ring in taken:
        ring.close()
    stale.close(), fresh.close(), inviter.close()


def _raw_write(ring: Ring, seq: int, data: bytes) -> None:
    """Commit ``data`` as one message, not framed as RingWriter frames a copy (a peer that writes garbage)."""
    import ctypes

    import numpy

    array = numpy.frombuffer(data, dtype=numpy.uint8)
    pointers = (ctypes.c_void_p * 1)(array.ctypes.data)
    lengths = (ctypes.c_uint64 * 1)(array.size)
    offset, wake = ctypes.c_uint64(0), ctypes.c_int(0)
    assert ring.lib.pw_ring_write(ctypes.byref(ring.side), seq, pointers, lengths, 1, ctypes.byref(offset),
                                  ctypes.byref(wake)) == 1


def test_a_message_whose_sizes_do_not_add_up_is_refused_and_counted():
    ring = Ring.create(1, 1, capacity=1 << 12)
    got = []
    reader = RingReader(ring, lambda envelope, frames: got.append((envelope, frames)))
    writer = RingWriter(Ring.attach([os.dup(ring.memfd), os.dup(ring.data_fd), os.dup(ring.space_fd)], 1, 1))
    writer.send(b"ok", [])                                               # well formed
    _raw_write(writer.ring, 1, struct.pack("<Q", 1 << 30) + b"abc")      # claims a 1 GiB envelope
    _raw_write(writer.ring, 2, b"\x01")                                  # shorter than its size word
    writer.send(b"still", [b"read"])                                     # the ring goes on
    assert reader.read() == 4
    assert [envelope for envelope, _ in got] == [b"ok", b"still"] and reader.refused == 2 and not reader.broken
    writer.ring.close()
    ring.close()


def test_frames_round_trip_with_the_frames_aligned():
    parts = _frames_of(b"envelope", [b"a" * 10, memoryview(b"b" * 100)])
    message = bytearray(b"".join(bytes(p) for p in parts))
    envelope, frames = _split(memoryview(message))
    assert envelope == b"envelope" and [bytes(f) for f in frames] == [b"a" * 10, b"b" * 100]
    offsets = [bytes(message).index(b"a" * 10), bytes(message).index(b"b" * 100)]
    assert all(offset % 64 == 0 for offset in offsets), offsets


def test_a_ring_whose_memory_is_not_sealed_is_refused():
    """A peer could shrink an unsealed memfd under the other side (a SIGBUS on its next access)."""
    made = Ring.create(1, 1, capacity=1 << 12)
    unsealed = os.memfd_create("not-sealed")
    os.ftruncate(unsealed, made.size)
    with pytest.raises(RingRefused, match="not sealed"):
        Ring.attach([unsealed, os.dup(made.data_fd), os.dup(made.space_fd)], 1, 1)
    with pytest.raises(OSError):
        os.ftruncate(made.memfd, 4096)   # the real one cannot be shrunk
    made.close()


def test_a_writer_whose_reader_broke_the_ring_gives_back_what_was_not_read():
    ring = Ring.create(1, 1, capacity=1 << 12)
    got = []
    reader = RingReader(ring, lambda envelope, frames: got.append(envelope))
    writer = RingWriter(Ring.attach([os.dup(ring.memfd), os.dup(ring.data_fd), os.dup(ring.space_fd)], 1, 1))
    writer.send(b"read", [], tag="a")
    assert reader.read() == 1 and writer.check() and writer.unread() == []
    writer.send(b"x" * 3000, [], tag="b")      # in the ring, not read
    writer.send(b"y" * 3000, [], tag="c")      # does not fit behind it: waits
    assert writer.waiting == 1
    at = 4096 + ring.side.position % (1 << 12)   # the reader's next chunk: its length no longer checks
    ring.view[at + 16] ^= 0xFF
    assert reader.read() == 0 and reader.broken and got == [b"read"]
    assert not writer.check() and writer.unread() == ["b", "c"]
    writer.ring.close()
    ring.close()


def _listen_as_nobody(name: bytes, ready, stop):
    os.setgid(65534)
    os.setuid(65534)
    import socket as sockets

    listener = sockets.socket(sockets.AF_UNIX, sockets.SOCK_SEQPACKET)
    listener.bind(name)
    listener.listen(4)
    ready.send(True)
    stop.recv()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to start a process of another user")
def test_a_ring_is_never_sent_to_a_socket_another_user_listens_on():
    """An inviter that died frees its socket's name; a process of another user that takes the name gets no ring."""
    name = b"\0pathways-ring-" + b"f" * 32
    ready, ready_child = multiprocessing.Pipe()
    stop, stop_child = multiprocessing.Pipe()
    child = multiprocessing.get_context("fork").Process(target=_listen_as_nobody, args=(name, ready_child, stop_child))
    child.start()
    try:
        assert ready.recv()
        assert make_ring_for(name, b"t" * 16, 1, 1, capacity=1 << 12) is None
    finally:
        stop.send(True)
        child.join(10)
