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
uint64_t pw_ring_bytes(uint64_t capacity);
int pw_ring_init(void* base, uint64_t capacity, uint64_t writer_epoch, uint64_t reader_epoch);
int pw_ring_check(void* base, uint64_t mapped, uint64_t writer_epoch, uint64_t reader_epoch);
int pw_ring_write(void* base, uint64_t seq, const void* const* parts, const uint64_t* lengths, int n_parts,
                  uint64_t* offset, int* wake);
int pw_ring_next(void* base, uint64_t* seq, uint64_t* total, uint64_t* offset, uint64_t* length, uint64_t* data_at);
int pw_ring_release(void* base, int* wake);
int pw_ring_reader_sleep(void* base);
void pw_ring_reader_awake(void* base);
uint64_t pw_ring_pending(void* base);
uint64_t pw_ring_max_chunk(uint64_t capacity);
}

#define EXPECT(cond, ...)                                                   \
  do {                                                                      \
    if (!(cond)) {                                                          \
      std::fprintf(stderr, "%s:%d: expected %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                    \
      std::fprintf(stderr, "\n");                                           \
      std::exit(1);                                                         \
    }                                                                       \
  } while (0)

namespace {

unsigned char pattern(uint64_t seq, uint64_t i) { return static_cast<unsigned char>(seq * 131 + i * 7 + (i >> 11)); }

void* map_ring(uint64_t capacity) {
  void* base = mmap(nullptr, pw_ring_bytes(capacity), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  EXPECT(base != MAP_FAILED, "mmap failed: %s", std::strerror(errno));
  EXPECT(pw_ring_init(base, capacity, 7, 9) == 0, "init of a %llu-byte ring", (unsigned long long)capacity);
  return base;
}

// A message being assembled by the reader from its chunks.
struct Assembly {
  uint64_t seq = 0, total = 0, got = 0;
  std::vector<unsigned char> bytes;
};

// Read what is committed; each whole message is checked against `pattern` and counted. Returns chunks read.
int drain(void* base, uint64_t& next_seq, Assembly& a, int* writer_wakes) {
  int chunks = 0;
  for (;;) {
    uint64_t seq, total, offset, length, at;
    const int got = pw_ring_next(base, &seq, &total, &offset, &length, &at);
    EXPECT(got >= 0, "a readable chunk, got %d", got);
    if (!got) return chunks;
    if (offset == 0) {
      EXPECT(seq == next_seq, "message %llu next, got %llu", (unsigned long long)next_seq, (unsigned long long)seq);
      a = Assembly{seq, total, 0, std::vector<unsigned char>(total)};
    }
    EXPECT(seq == a.seq && total == a.total && offset == a.got,
           "chunk of message %llu at %llu, got message %llu at %llu", (unsigned long long)a.seq,
           (unsigned long long)a.got, (unsigned long long)seq, (unsigned long long)offset);
    if (length) std::memcpy(a.bytes.data() + offset, static_cast<unsigned char*>(base) + at, length);
    a.got += length;
    int wake = 0;
    EXPECT(pw_ring_release(base, &wake) == 0, "release");
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
void write_all(void* base, uint64_t seq, const std::vector<unsigned char>& m, uint64_t& next_seq, Assembly& a,
               int* writer_wakes, int* fulls) {
  const uint64_t cut1 = m.size() / 3, cut2 = m.size() - m.size() / 5;
  const void* parts[3] = {m.data(), m.data() + cut1, m.data() + cut2};
  const uint64_t lengths[3] = {cut1, cut2 - cut1, m.size() - cut2};
  uint64_t offset = 0;
  for (;;) {
    int wake = 0;
    const int r = pw_ring_write(base, seq, parts, lengths, 3, &offset, &wake);
    EXPECT(r >= 0, "write of message %llu, got %d", (unsigned long long)seq, r);
    if (r == 1) return;
    ++*fulls;
    EXPECT(drain(base, next_seq, a, writer_wakes) > 0, "a full ring has chunks to read");
  }
}

void test_arguments_and_headers() {
  EXPECT(pw_ring_bytes(1000) == 0, "a capacity not a power of two refused");
  EXPECT(pw_ring_bytes(2048) == 0, "a capacity under 4 KiB refused");
  EXPECT(pw_ring_bytes(1 << 16) == 4096 + (1 << 16), "header page + data");
  void* base = map_ring(1 << 16);
  EXPECT(pw_ring_check(base, pw_ring_bytes(1 << 16), 7, 9) == 0, "its own ring checks");
  EXPECT(pw_ring_check(base, pw_ring_bytes(1 << 16), 8, 9) == -ESTALE, "another writer incarnation: stale");
  EXPECT(pw_ring_check(base, pw_ring_bytes(1 << 16), 7, 10) == -ESTALE, "another reader incarnation: stale");
  EXPECT(pw_ring_check(base, pw_ring_bytes(1 << 17), 7, 9) == -EPROTO, "a mapping of another size");
  std::vector<unsigned char> garbage(pw_ring_bytes(1 << 16), 0xab);
  EXPECT(pw_ring_check(garbage.data(), garbage.size(), 7, 9) == -EPROTO, "not a ring");
  uint64_t offset = 5;
  int wake;
  const void* parts[1] = {garbage.data()};
  const uint64_t lengths[1] = {4};
  EXPECT(pw_ring_write(base, 0, parts, lengths, 1, &offset, &wake) == -EINVAL, "an offset past the message");
  EXPECT(pw_ring_write(base, 0, parts, lengths, -1, &offset, &wake) == -EINVAL, "a negative part count");
  munmap(base, pw_ring_bytes(1 << 16));
}

void test_sizes_wrap_and_gather() {
  const uint64_t capacity = 1 << 16;
  void* base = map_ring(capacity);
  std::mt19937_64 random(3);
  const uint64_t sizes[] = {0, 1, 7, 63, 64, 65, 4000, pw_ring_max_chunk(capacity), pw_ring_max_chunk(capacity) + 1,
                            capacity - 1, capacity, 3 * capacity + 5};
  uint64_t seq = 0, next_seq = 0;
  Assembly a;
  int writer_wakes = 0, fulls = 0;
  for (int round = 0; round < 40; ++round) {
    for (uint64_t size : sizes) write_all(base, seq, message(seq, size), next_seq, a, &writer_wakes, &fulls), ++seq;
    for (int i = 0; i < 20; ++i) {
      const uint64_t size = random() % 9000;
      write_all(base, seq, message(seq, size), next_seq, a, &writer_wakes, &fulls);
      ++seq;
    }
    drain(base, next_seq, a, &writer_wakes);
  }
  EXPECT(next_seq == seq, "every message read: %llu of %llu", (unsigned long long)next_seq, (unsigned long long)seq);
  EXPECT(pw_ring_pending(base) == 0, "nothing left");
  EXPECT(fulls > 0 && writer_wakes == fulls, "each full ring asked for a wake-up: %d fulls, %d wakes", fulls,
         writer_wakes);
  munmap(base, pw_ring_bytes(capacity));
}

void test_sleep_and_wake_flags() {
  void* base = map_ring(1 << 12);
  EXPECT(pw_ring_reader_sleep(base) == 0, "an empty ring lets the reader sleep");
  std::vector<unsigned char> m = message(0, 10);
  const void* parts[1] = {m.data()};
  const uint64_t lengths[1] = {m.size()};
  uint64_t offset = 0;
  int wake = 0;
  EXPECT(pw_ring_write(base, 0, parts, lengths, 1, &offset, &wake) == 1 && wake == 1, "a sleeping reader is woken");
  offset = 0;
  EXPECT(pw_ring_write(base, 1, parts, lengths, 1, &offset, &wake) == 1 && wake == 0, "an awake one is not");
  EXPECT(pw_ring_reader_sleep(base) == 1, "a reader with chunks waiting does not sleep");
  munmap(base, pw_ring_bytes(1 << 12));
}

// A writer process and a reader process (this one) on one mapping, up to 64 MiB messages, the ring 1 MiB.
void test_two_processes() {
  const uint64_t capacity = 1 << 20;
  void* base = map_ring(capacity);
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
      while (pw_ring_write(base, seq, parts, lengths, 1, &offset, &wake) == 0) usleep(50);
    }
    _exit(0);
  }
  uint64_t next_seq = 0;
  Assembly a;
  int wakes = 0;
  while (next_seq < static_cast<uint64_t>(count)) {
    if (!drain(base, next_seq, a, &wakes)) usleep(50);
  }
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the writer process ended well (status %d)", status);
  munmap(base, pw_ring_bytes(capacity));
}

// A writer killed at random moments: whatever the reader sees is whole chunks of the pattern, never a torn one.
void test_killed_writer_never_tears_a_chunk() {
  const uint64_t capacity = 1 << 18;
  std::mt19937_64 random(11);
  for (int trial = 0; trial < 20; ++trial) {
    void* base = map_ring(capacity);
    const pid_t child = fork();
    EXPECT(child >= 0, "fork");
    if (child == 0) {
      std::vector<unsigned char> m = message(0, 5 << 20);   // every message the same bytes: seq 0's pattern
      for (uint64_t seq = 0;; ++seq) {
        const void* parts[1] = {m.data()};
        const uint64_t lengths[1] = {m.size()};
        uint64_t offset = 0;
        int wake;
        while (pw_ring_write(base, seq, parts, lengths, 1, &offset, &wake) == 0) {}
      }
    }
    const auto deadline = random() % 3000;
    uint64_t chunks = 0;
    for (uint64_t spin = 0; spin < deadline || chunks == 0; ++spin) {
      uint64_t seq, total, offset, length, at;
      const int got = pw_ring_next(base, &seq, &total, &offset, &length, &at);
      EXPECT(got >= 0, "a chunk that checks, got %d", got);
      if (!got) continue;
      const unsigned char* bytes = static_cast<unsigned char*>(base) + at;
      for (uint64_t i = 0; i < length; ++i)
        EXPECT(bytes[i] == pattern(0, offset + i), "byte %llu of a chunk", (unsigned long long)(offset + i));
      int wake;
      EXPECT(pw_ring_release(base, &wake) == 0, "release");
      ++chunks;
    }
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
    // What the dead writer committed is still whole; what it was writing is not visible.
    for (;;) {
      uint64_t seq, total, offset, length, at;
      const int got = pw_ring_next(base, &seq, &total, &offset, &length, &at);
      EXPECT(got >= 0, "a committed chunk after the kill checks, got %d", got);
      if (!got) break;
      const unsigned char* bytes = static_cast<unsigned char*>(base) + at;
      for (uint64_t i = 0; i < length; ++i)
        EXPECT(bytes[i] == pattern(0, offset + i), "byte %llu after the kill", (unsigned long long)(offset + i));
      int wake;
      EXPECT(pw_ring_release(base, &wake) == 0, "release");
    }
    EXPECT(pw_ring_pending(base) == 0, "nothing half-written is pending");
    munmap(base, pw_ring_bytes(capacity));
  }
}

void test_a_corrupt_chunk_is_refused_and_breaks_the_ring() {
  const uint64_t capacity = 1 << 12;
  void* base = map_ring(capacity);
  std::vector<unsigned char> m = message(0, 100);
  const void* parts[1] = {m.data()};
  const uint64_t lengths[1] = {m.size()};
  uint64_t offset = 0;
  int wake;
  EXPECT(pw_ring_write(base, 0, parts, lengths, 1, &offset, &wake) == 1, "write");
  unsigned char* chunk = static_cast<unsigned char*>(base) + 4096;
  chunk[16] ^= 0xff;   // its length: the check word no longer matches
  uint64_t seq, total, off, length, at;
  EXPECT(pw_ring_next(base, &seq, &total, &off, &length, &at) == -EBADMSG, "a chunk whose header was changed");
  EXPECT(pw_ring_next(base, &seq, &total, &off, &length, &at) == -EPIPE, "the ring is broken from then on");
  offset = 0;
  EXPECT(pw_ring_write(base, 1, parts, lengths, 1, &offset, &wake) == -EPIPE, "for the writer too");
  munmap(base, pw_ring_bytes(capacity));

  // A length that passes its check word but runs past what was committed (a peer that lies).
  base = map_ring(capacity);
  offset = 0;
  EXPECT(pw_ring_write(base, 0, parts, lengths, 1, &offset, &wake) == 1, "write");
  chunk = static_cast<unsigned char*>(base) + 4096;
  uint32_t fields[6];
  std::memcpy(fields, chunk, 24);
  fields[4] = 4000;   // length
  fields[5] = fields[0] ^ fields[1] ^ fields[4] ^ fields[2] ^ fields[3] ^ 0 ^ 0 ^ 0x9e3779b9u;   // offset 0
  std::memcpy(chunk, fields, 24);
  EXPECT(pw_ring_next(base, &seq, &total, &off, &length, &at) == -EBADMSG, "a chunk longer than was committed");
  munmap(base, pw_ring_bytes(capacity));
}

}  // namespace

int main() {
  test_arguments_and_headers();
  test_sizes_wrap_and_gather();
  test_sleep_and_wake_flags();
  test_two_processes();
  test_killed_writer_never_tears_a_chunk();
  test_a_corrupt_chunk_is_refused_and_breaks_the_ring();
  std::printf("shm_ring: all passed\n");
  return 0;
}
