// Units of executor/native/shm_ring.cpp, built with -fsanitize=address,undefined by tests/unit/test_native.py and
// run as a plain program: each check prints what was expected and what came, and the program exits 1 on the first.
// Covered: sizes (0 bytes to 64 MiB), wrap-around, gathering from several parts, a full ring and its wake-up flag,
// two processes sharing a mapping, a writer killed mid-write (no torn chunk is ever read), a stale or foreign ring
// refused, a corrupt chunk refused and the ring then broken.

#include <sys/mman.h>
#include <sys/wait.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

extern "C" {
struct pw_ring_view {
  void* base;
  uint64_t capacity;
  uint64_t position;
};
uint64_t pw_ring_bytes(uint64_t capacity);
int pw_ring_init(void* base, uint64_t capacity, uint64_t writer_epoch, uint64_t reader_epoch);
int pw_ring_attach(void* base, uint64_t mapped, uint64_t writer_epoch, uint64_t reader_epoch, pw_ring_view* view);
int pw_ring_write(pw_ring_view* v, uint64_t seq, const void* const* parts, const uint64_t* lengths, int n_parts,
                  uint64_t* offset, int* wake);
int pw_ring_next(pw_ring_view* v, uint64_t* seq, uint64_t* total, uint64_t* offset, uint64_t* length,
                 uint64_t* data_at);
int pw_ring_release(pw_ring_view* v, int* wake);
int pw_ring_reader_sleep(pw_ring_view* v);
void pw_ring_reader_awake(pw_ring_view* v);
int pw_ring_released(pw_ring_view* v, uint64_t* released);
int pw_ring_broken(pw_ring_view* v);
uint64_t pw_ring_max_chunk(uint64_t capacity);
}

#include "expect.h"

namespace {

unsigned char pattern(uint64_t seq, uint64_t i) { return static_cast<unsigned char>(seq * 131 + i * 7 + (i >> 11)); }

// A ring in a shared anonymous mapping and each side's view of it.
struct Ring {
  void* base;
  uint64_t bytes;
  pw_ring_view writer, reader;
};

Ring map_ring(uint64_t capacity) {
  Ring r;
  r.bytes = pw_ring_bytes(capacity);
  r.base = mmap(nullptr, r.bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  EXPECT(r.base != MAP_FAILED, "mmap failed: %s", std::strerror(errno));
  EXPECT(pw_ring_init(r.base, capacity, 7, 9) == 0, "init of a %llu-byte ring", (unsigned long long)capacity);
  EXPECT(pw_ring_attach(r.base, r.bytes, 7, 9, &r.writer) == 0, "the writer attaches");
  EXPECT(pw_ring_attach(r.base, r.bytes, 7, 9, &r.reader) == 0, "the reader attaches");
  return r;
}

bool nothing_to_read(pw_ring_view* reader) {
  uint64_t seq, total, offset, length, at;
  return pw_ring_next(reader, &seq, &total, &offset, &length, &at) == 0;
}

// A message being assembled by the reader from its chunks.
struct Assembly {
  uint64_t seq = 0, total = 0, got = 0;
  std::vector<unsigned char> bytes;
};

// Read what is committed; each whole message is checked against `pattern` and counted. Returns chunks read.
int drain(pw_ring_view* reader, uint64_t& next_seq, Assembly& a, int* writer_wakes) {
  int chunks = 0;
  for (;;) {
    uint64_t seq, total, offset, length, at;
    const int got = pw_ring_next(reader, &seq, &total, &offset, &length, &at);
    EXPECT(got >= 0, "a readable chunk, got %d", got);
    if (!got) return chunks;
    if (offset == 0) {
      EXPECT(seq == next_seq, "message %llu next, got %llu", (unsigned long long)next_seq, (unsigned long long)seq);
      a = Assembly{seq, total, 0, std::vector<unsigned char>(total)};
    }
    EXPECT(seq == a.seq && total == a.total && offset == a.got,
           "chunk of message %llu at %llu, got message %llu at %llu", (unsigned long long)a.seq,
           (unsigned long long)a.got, (unsigned long long)seq, (unsigned long long)offset);
    if (length) std::memcpy(a.bytes.data() + offset, static_cast<unsigned char*>(reader->base) + at, length);
    a.got += length;
    int wake = 0;
    EXPECT(pw_ring_release(reader, &wake) == 0, "release");
    *writer_wakes += wake;
    ++chunks;
    if (a.got == a.total) {
      for (uint64_t i = 0; i < a.total; ++i)
        EXPECT(a.bytes[i] == pattern(a.seq, i), "byte %llu of message %llu", (unsigned long long)i,
               (unsigned long long)a.seq);
      ++next_seq;
    }
  }
}

std::vector<unsigned char> message(uint64_t seq, uint64_t size) {
  std::vector<unsigned char> m(size);
  for (uint64_t i = 0; i < size; ++i) m[i] = pattern(seq, i);
  return m;
}

// Writes `m` as up to three parts (gathered by the ring), draining the ring whenever it is full.
void write_all(Ring& ring, uint64_t seq, const std::vector<unsigned char>& m, uint64_t& next_seq, Assembly& a,
               int* writer_wakes, int* fulls) {
  const uint64_t cut1 = m.size() / 3, cut2 = m.size() - m.size() / 5;
  const void* parts[3] = {m.data(), m.data() + cut1, m.data() + cut2};
  const uint64_t lengths[3] = {cut1, cut2 - cut1, m.size() - cut2};
  uint64_t offset = 0;
  for (;;) {
    int wake = 0;
    const int r = pw_ring_write(&ring.writer, seq, parts, lengths, 3, &offset, &wake);
    EXPECT(r >= 0, "write of message %llu, got %d", (unsigned long long)seq, r);
    if (r == 1) return;
    ++*fulls;
    EXPECT(drain(&ring.reader, next_seq, a, writer_wakes) > 0, "a full ring has chunks to read");
  }
}

void test_arguments_and_headers() {
  EXPECT(pw_ring_bytes(1000) == 0, "a capacity not a power of two refused");
  EXPECT(pw_ring_bytes(2048) == 0, "a capacity under 4 KiB refused");
  EXPECT(pw_ring_bytes(1 << 16) == 4096 + (1 << 16), "header page + data");
  Ring r = map_ring(1 << 16);
  pw_ring_view v;
  EXPECT(pw_ring_attach(r.base, r.bytes, 8, 9, &v) == -ESTALE, "another writer incarnation: stale");
  EXPECT(pw_ring_attach(r.base, r.bytes, 7, 10, &v) == -ESTALE, "another reader incarnation: stale");
  EXPECT(pw_ring_attach(r.base, pw_ring_bytes(1 << 17), 7, 9, &v) == -EPROTO, "a mapping of another size");
  std::vector<unsigned char> garbage(r.bytes, 0xab);
  EXPECT(pw_ring_attach(garbage.data(), garbage.size(), 7, 9, &v) == -EPROTO, "not a ring");
  uint64_t offset = 5;
  int wake;
  const void* parts[1] = {garbage.data()};
  const uint64_t lengths[1] = {4};
  EXPECT(pw_ring_write(&r.writer, 0, parts, lengths, 1, &offset, &wake) == -EINVAL, "an offset past the message");
  EXPECT(pw_ring_write(&r.writer, 0, parts, lengths, -1, &offset, &wake) == -EINVAL, "a negative part count");
  offset = 0;
  EXPECT(pw_ring_write(&r.writer, 0, parts, lengths, 1, &offset, &wake) == 1, "write");
  EXPECT(pw_ring_attach(r.base, r.bytes, 7, 9, &v) == -EPROTO, "a ring already used is not attached again");
  munmap(r.base, r.bytes);
}

void test_sizes_wrap_and_gather() {
  const uint64_t capacity = 1 << 16;
  Ring r = map_ring(capacity);
  std::mt19937_64 random(3);
  const uint64_t sizes[] = {0, 1, 7, 63, 64, 65, 4000, pw_ring_max_chunk(capacity), pw_ring_max_chunk(capacity) + 1,
                            capacity - 1, capacity, 3 * capacity + 5};
  uint64_t seq = 0, next_seq = 0;
  Assembly a;
  int writer_wakes = 0, fulls = 0;
  for (int round = 0; round < 40; ++round) {
    for (uint64_t size : sizes) write_all(r, seq, message(seq, size), next_seq, a, &writer_wakes, &fulls), ++seq;
    for (int i = 0; i < 20; ++i) {
      const uint64_t size = random() % 9000;
      write_all(r, seq, message(seq, size), next_seq, a, &writer_wakes, &fulls);
      ++seq;
    }
    drain(&r.reader, next_seq, a, &writer_wakes);
  }
  EXPECT(next_seq == seq, "every message read: %llu of %llu", (unsigned long long)next_seq, (unsigned long long)seq);
  EXPECT(nothing_to_read(&r.reader), "nothing left");
  uint64_t released = 0;
  EXPECT(pw_ring_released(&r.writer, &released) == 0 && released == r.writer.position,
         "the writer sees everything released");
  EXPECT(fulls > 0 && writer_wakes == fulls, "each full ring asked for a wake-up: %d fulls, %d wakes", fulls,
         writer_wakes);
  munmap(r.base, r.bytes);
}

void test_sleep_and_wake_flags() {
  Ring r = map_ring(1 << 12);
  EXPECT(pw_ring_reader_sleep(&r.reader) == 0, "an empty ring lets the reader sleep");
  std::vector<unsigned char> m = message(0, 10);
  const void* parts[1] = {m.data()};
  const uint64_t lengths[1] = {m.size()};
  uint64_t offset = 0;
  int wake = 0;
  EXPECT(pw_ring_write(&r.writer, 0, parts, lengths, 1, &offset, &wake) == 1 && wake == 1,
         "a sleeping reader is woken");
  offset = 0;
  EXPECT(pw_ring_write(&r.writer, 1, parts, lengths, 1, &offset, &wake) == 1 && wake == 0, "an awake one is not");
  EXPECT(pw_ring_reader_sleep(&r.reader) == 1, "a reader with chunks waiting does not sleep");
  munmap(r.base, r.bytes);
}

// A writer process and a reader process (this one) on one mapping, up to 64 MiB messages, the ring 1 MiB.
void test_two_processes() {
  const uint64_t capacity = 1 << 20;
  Ring r = map_ring(capacity);
  const uint64_t sizes[] = {0, 1, 65536, 3 << 20, 64 << 20, 12345, 0, 999999};
  const int count = sizeof sizes / sizeof sizes[0];
  const pid_t child = fork();
  EXPECT(child >= 0, "fork");
  if (child == 0) {
    for (int seq = 0; seq < count; ++seq) {
      std::vector<unsigned char> m = message(seq, sizes[seq]);
      const void* parts[1] = {m.data()};
      const uint64_t lengths[1] = {m.size()};
      uint64_t offset = 0;
      int wake;
      while (pw_ring_write(&r.writer, seq, parts, lengths, 1, &offset, &wake) == 0) usleep(50);
    }
    _exit(0);
  }
  uint64_t next_seq = 0;
  Assembly a;
  int wakes = 0;
  while (next_seq < static_cast<uint64_t>(count)) {
    if (!drain(&r.reader, next_seq, a, &wakes)) usleep(50);
  }
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the writer process ended well (status %d)", status);
  munmap(r.base, r.bytes);
}

// Reads the chunks committed now, each checked against seq 0's pattern; how many.
uint64_t read_pattern_chunks(pw_ring_view* reader, uint64_t most) {
  uint64_t chunks = 0;
  while (chunks < most) {
    uint64_t seq, total, offset, length, at;
    const int got = pw_ring_next(reader, &seq, &total, &offset, &length, &at);
    EXPECT(got >= 0, "a chunk that checks, got %d", got);
    if (!got) break;
    const unsigned char* bytes = static_cast<unsigned char*>(reader->base) + at;
    for (uint64_t i = 0; i < length; ++i)
      EXPECT(bytes[i] == pattern(0, offset + i), "byte %llu of a chunk", (unsigned long long)(offset + i));
    int wake;
    EXPECT(pw_ring_release(reader, &wake) == 0, "release");
    ++chunks;
  }
  return chunks;
}

// A writer killed at random moments: whatever the reader sees is whole chunks of the pattern, never a torn one.
void test_killed_writer_never_tears_a_chunk() {
  const uint64_t capacity = 1 << 18;
  std::mt19937_64 random(11);
  for (int trial = 0; trial < 20; ++trial) {
    Ring r = map_ring(capacity);
    const pid_t child = fork();
    EXPECT(child >= 0, "fork");
    if (child == 0) {
      std::vector<unsigned char> m = message(0, 5 << 20);   // every message the same bytes: seq 0's pattern
      for (uint64_t seq = 0;; ++seq) {
        const void* parts[1] = {m.data()};
        const uint64_t lengths[1] = {m.size()};
        uint64_t offset = 0;
        int wake;
        while (pw_ring_write(&r.writer, seq, parts, lengths, 1, &offset, &wake) == 0) {}
      }
    }
    const uint64_t spins = random() % 3000;
    uint64_t chunks = 0;
    for (uint64_t spin = 0; spin < spins || chunks == 0; ++spin) chunks += read_pattern_chunks(&r.reader, 1);
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
    read_pattern_chunks(&r.reader, ~0ULL);   // what the dead writer committed is whole
    EXPECT(nothing_to_read(&r.reader), "nothing half-written is visible");
    munmap(r.base, r.bytes);
  }
}

void test_a_corrupt_chunk_is_refused_and_breaks_the_ring() {
  const uint64_t capacity = 1 << 12;
  Ring r = map_ring(capacity);
  std::vector<unsigned char> m = message(0, 100);
  const void* parts[1] = {m.data()};
  const uint64_t lengths[1] = {m.size()};
  uint64_t offset = 0;
  int wake;
  EXPECT(pw_ring_write(&r.writer, 0, parts, lengths, 1, &offset, &wake) == 1, "write");
  unsigned char* chunk = static_cast<unsigned char*>(r.base) + 4096;
  chunk[16] ^= 0xff;   // its length: the check word no longer matches
  uint64_t seq, total, off, length, at;
  EXPECT(pw_ring_next(&r.reader, &seq, &total, &off, &length, &at) == -EBADMSG, "a chunk whose header was changed");
  EXPECT(pw_ring_next(&r.reader, &seq, &total, &off, &length, &at) == -EPIPE, "the ring is broken from then on");
  offset = 0;
  EXPECT(pw_ring_write(&r.writer, 1, parts, lengths, 1, &offset, &wake) == -EPIPE, "for the writer too");
  EXPECT(pw_ring_broken(&r.writer) == 1, "which it can ask");
  munmap(r.base, r.bytes);

  // A length that passes its check word but runs past what was committed (a peer that lies).
  r = map_ring(capacity);
  offset = 0;
  EXPECT(pw_ring_write(&r.writer, 0, parts, lengths, 1, &offset, &wake) == 1, "write");
  chunk = static_cast<unsigned char*>(r.base) + 4096;
  uint32_t fields[6];
  std::memcpy(fields, chunk, 24);
  fields[4] = 4000;   // length
  fields[5] = fields[0] ^ fields[1] ^ fields[4] ^ fields[2] ^ fields[3] ^ 0 ^ 0 ^ 0x9e3779b9u;   // offset 0
  std::memcpy(chunk, fields, 24);
  EXPECT(pw_ring_next(&r.reader, &seq, &total, &off, &length, &at) == -EBADMSG, "a chunk longer than was committed");
  munmap(r.base, r.bytes);
}

// The header is shared: a peer that rewrites it (the capacity, an unaligned or far head or tail) must not make the
// other side index out of its mapping. Each side uses the capacity it checked and positions within one ring.
void test_a_rewritten_header_breaks_the_ring_and_nothing_is_touched_out_of_bounds() {
  const uint64_t capacity = 1 << 12;
  std::vector<unsigned char> m = message(0, 100);
  const void* parts[1] = {m.data()};
  const uint64_t lengths[1] = {m.size()};
  uint64_t offset = 0, seq, total, off, length, at;
  int wake;
  // The capacity: ignored after attach (0 would divide by zero, a larger one would read past the mapping).
  Ring r = map_ring(capacity);
  uint64_t* header = static_cast<uint64_t*>(r.base);
  header[2] = 0;   // capacity
  EXPECT(pw_ring_write(&r.writer, 0, parts, lengths, 1, &offset, &wake) == 1, "the writer uses its own capacity");
  EXPECT(pw_ring_next(&r.reader, &seq, &total, &off, &length, &at) == 1 && length == 100, "so does the reader");
  munmap(r.base, r.bytes);
  // An unaligned head: the reader refuses it.
  r = map_ring(capacity);
  header = static_cast<uint64_t*>(r.base);
  header[8] = capacity - 8;   // head (the first 64-byte line after the fixed fields)
  EXPECT(pw_ring_next(&r.reader, &seq, &total, &off, &length, &at) == -EBADMSG, "an unaligned head");
  munmap(r.base, r.bytes);
  // A tail ahead of the writer's head, or unaligned: the writer refuses it (it would write past the end).
  r = map_ring(capacity);
  header = static_cast<uint64_t*>(r.base);
  header[16] = capacity - 8;   // tail
  offset = 0;
  EXPECT(pw_ring_write(&r.writer, 0, parts, lengths, 1, &offset, &wake) == -EPIPE, "a tail the writer never allowed");
  munmap(r.base, r.bytes);
}

}  // namespace

void shm_ring_units() {
  test_arguments_and_headers();
  test_sizes_wrap_and_gather();
  test_sleep_and_wake_flags();
  test_two_processes();
  test_killed_writer_never_tears_a_chunk();
  test_a_corrupt_chunk_is_refused_and_breaks_the_ring();
  test_a_rewritten_header_breaks_the_ring_and_nothing_is_touched_out_of_bounds();
  std::printf("shm_ring: all passed\n");
}
