// Units of executor/native/shm_collectives.cpp, built with -fsanitize=address,undefined by tests/unit/test_native.py:
// every op and dtype among 1 to 4 member processes, counts from 0 to past many steps (small slots: many steps, both
// banks) and one 64 MiB all_reduce; bad requests and stale mappings refused; members out of step refused, counted
// and failing the group; abandon and a timeout ending a wait (naming the missing member); a member killed at random
// moments never leaves a survivor with wrong data.

#include "../../executor/native/shm_collectives.h"

#include <sys/mman.h>
#include <sys/wait.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "expect.h"

namespace {

enum { kF32, kF64, kF16, kBF16, kI8, kU8, kI16, kI32, kI64, kBool, kDTypes };
const int kBytes[kDTypes] = {4, 8, 2, 2, 1, 1, 2, 4, 8, 1};
const char* const kDTypeNames[kDTypes] = {"f32", "f64", "f16", "bf16", "i8", "u8", "i16", "i32", "i64", "bool"};
enum { kAllReduce = 1, kAllGather, kReduceScatter, kBroadcast, kAllToAll };
enum { kSum, kMax, kMin, kProduct };

// Small integers only, so every dtype holds every value and every sum exactly (the half formats encoded here from
// the integer, independently of the library's rounding conversions).
uint16_t half_of(int n) {
  if (n == 0) return 0;
  uint16_t sign = n < 0 ? 0x8000 : 0;
  unsigned magnitude = static_cast<unsigned>(std::abs(n)), exponent = 0;
  while ((magnitude >> (exponent + 1)) != 0) ++exponent;
  unsigned mantissa = (magnitude << (10 - exponent)) & 0x3ffu;   // exact for |n| < 2048
  return static_cast<uint16_t>(sign | ((exponent + 15) << 10) | mantissa);
}

uint16_t bf16_of(int n) {
  float f = static_cast<float>(n);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>(bits >> 16);   // exact for |n| < 256
}

void put(int dtype, void* data, uint64_t i, int n) {
  switch (dtype) {
    case kF32: static_cast<float*>(data)[i] = static_cast<float>(n); return;
    case kF64: static_cast<double*>(data)[i] = n; return;
    case kF16: static_cast<uint16_t*>(data)[i] = half_of(n); return;
    case kBF16: static_cast<uint16_t*>(data)[i] = bf16_of(n); return;
    case kI8: static_cast<int8_t*>(data)[i] = static_cast<int8_t>(n); return;
    case kU8: static_cast<uint8_t*>(data)[i] = static_cast<uint8_t>(n); return;
    case kI16: static_cast<int16_t*>(data)[i] = static_cast<int16_t>(n); return;
    case kI32: static_cast<int32_t*>(data)[i] = n; return;
    case kI64: static_cast<int64_t*>(data)[i] = n; return;
    default: static_cast<uint8_t*>(data)[i] = static_cast<uint8_t>(n != 0);
  }
}

bool holds(int dtype, const void* data, uint64_t i, int n) {
  unsigned char expected[8] = {}, got[8] = {};
  put(dtype, expected, 0, n);
  std::memcpy(got, static_cast<const unsigned char*>(data) + i * kBytes[dtype], kBytes[dtype]);
  if (n == 0 && dtype <= kBF16) got[kBytes[dtype] - 1] &= 0x7f;   // -0.0 (a product with a negative) is 0
  return std::memcmp(got, expected, kBytes[dtype]) == 0;
}

// Member r's element i: small, signed where the dtype is, varied.
int value(int dtype, int rank, uint64_t i) {
  int v = static_cast<int>((rank * 7 + i * 3 + (i >> 9)) % 11) - 5;
  return dtype == kU8 ? v + 5 : dtype == kBool ? (v > 0) : v;
}

int reduce(int op, int a, int b, int dtype) {
  if (dtype == kBool) return (op == kSum || op == kMax) ? (a || b) : (a && b);
  switch (op) {
    case kSum: return a + b;
    case kMax: return a < b ? b : a;
    case kMin: return b < a ? b : a;
    default: return a * b;
  }
}

int reduced(int op, int dtype, int size, uint64_t i) {
  int total = value(dtype, 0, i);
  for (int r = 1; r < size; ++r) total = reduce(op, total, value(dtype, r, i), dtype);
  return total;
}

struct Mapping {
  void* base;
  uint64_t bytes;
};

Mapping shared_mapping(int size, uint64_t slot_bytes, uint64_t tag) {
  Mapping m{nullptr, pw_coll_bytes(size, slot_bytes)};
  EXPECT(m.bytes > 0, "a geometry of %d members and %llu-byte slots", size, (unsigned long long)slot_bytes);
  m.base = mmap(nullptr, m.bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  EXPECT(m.base != MAP_FAILED, "mmap: %s", std::strerror(errno));
  EXPECT(pw_coll_init(m.base, m.bytes, size, slot_bytes, tag) == 0, "init");
  return m;
}

pw_coll_op request(int kind, int dtype, int op, uint64_t count, const void* in, void* out, double timeout_s = 20) {
  return pw_coll_op{kind, dtype, op, 0, count, 0, in, out, timeout_s};
}

// One member's run of `kind` on `dtype` for `count` elements, its result checked; returns a failure text or "".
std::string run_and_check(void* group, int rank, int size, int kind, int dtype, int op, uint64_t count) {
  const bool parts = kind == kReduceScatter || kind == kAllToAll;
  const uint64_t in_count = parts ? count * size : count;
  const uint64_t out_count = (kind == kAllGather || kind == kAllToAll) ? count * size : count;
  std::vector<unsigned char> in(in_count * kBytes[dtype] + 1), out(out_count * kBytes[dtype] + 1);
  for (uint64_t i = 0; i < in_count; ++i) put(dtype, in.data(), i, value(dtype, rank, i));
  pw_coll_op r = request(kind, dtype, op, count, in.data(), out.data());
  r.root = size - 1;
  char why[512] = "";
  int code = pw_coll_run(group, &r, why, sizeof why);
  if (code != 0) return "code " + std::to_string(code) + ": " + why;
  for (uint64_t i = 0; i < out_count; ++i) {
    int expected;
    switch (kind) {
      case kAllReduce: expected = reduced(op, dtype, size, i); break;
      case kAllGather: expected = value(dtype, static_cast<int>(i / count), i % count); break;
      case kReduceScatter: expected = reduced(op, dtype, size, rank * count + i); break;
      case kBroadcast: expected = value(dtype, size - 1, i); break;
      default: expected = value(dtype, static_cast<int>(i / count), rank * count + i % count);
    }
    if (!holds(dtype, out.data(), i, expected)) {
      return "element " + std::to_string(i) + " of " + std::to_string(out_count) + " is not " + std::to_string(expected);
    }
  }
  return "";
}

// `body(group, rank)` in `size` member processes (member 0 is this one); every member must return "".
template <typename Body>
void in_members(int size, uint64_t slot_bytes, Body body) {
  Mapping m = shared_mapping(size, slot_bytes, 42);
  std::vector<pid_t> children;
  for (int rank = 1; rank < size; ++rank) {
    pid_t child = fork();
    EXPECT(child >= 0, "fork");
    if (child == 0) {
      void* group = pw_coll_attach(m.base, m.bytes, rank, size, slot_bytes, 42);
      std::string failure = group ? body(group, rank) : "attach failed";
      if (!failure.empty()) std::fprintf(stderr, "member %d: %s\n", rank, failure.c_str());
      pw_coll_detach(group);
      _exit(failure.empty() ? 0 : 1);
    }
    children.push_back(child);
  }
  void* group = pw_coll_attach(m.base, m.bytes, 0, size, slot_bytes, 42);
  EXPECT(group != nullptr, "member 0 attaches");
  std::string failure = body(group, 0);
  EXPECT(failure.empty(), "member 0 of %d: %s", size, failure.c_str());
  for (pid_t child : children) {
    int status = 0;
    waitpid(child, &status, 0);
    EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, "a member process ended well (status %d)", status);
  }
  pw_coll_detach(group);
  munmap(m.base, m.bytes);
}

void test_geometry_and_bad_requests_refused() {
  EXPECT(pw_coll_bytes(0, 4096) == 0 && pw_coll_bytes(2, 100) == 0 && pw_coll_bytes(4, 128) == 0,
         "bad geometries have no size");
  Mapping m = shared_mapping(2, 4096, 7);
  EXPECT(pw_coll_attach(m.base, m.bytes, 0, 2, 4096, 8) == nullptr, "a mapping made for another group is refused");
  EXPECT(pw_coll_attach(m.base, m.bytes, 0, 3, 4096, 7) == nullptr, "a mapping of another size is refused");
  EXPECT(pw_coll_attach(m.base, m.bytes - 64, 0, 2, 4096, 7) == nullptr, "a mapping smaller than its geometry");
  EXPECT(pw_coll_attach(m.base, m.bytes, 2, 2, 4096, 7) == nullptr, "a rank past the size");
  void* group = pw_coll_attach(m.base, m.bytes, 0, 2, 4096, 7);
  EXPECT(group != nullptr, "attach");
  float x = 1, y = 0;
  char why[128];
  pw_coll_op bad = request(9, kF32, kSum, 1, &x, &y);
  EXPECT(pw_coll_run(group, &bad, why, sizeof why) == -EINVAL, "an unknown kind");
  bad = request(kAllReduce, 77, kSum, 1, &x, &y);
  EXPECT(pw_coll_run(group, &bad, why, sizeof why) == -EINVAL, "an unknown dtype");
  bad = request(kAllReduce, kF32, kSum, 1, nullptr, &y);
  EXPECT(pw_coll_run(group, &bad, why, sizeof why) == -EINVAL, "no input");
  pw_coll_abandon(group);
  pw_coll_op good = request(kAllReduce, kF32, kSum, 1, &x, &y, 30);
  auto start = std::chrono::steady_clock::now();
  EXPECT(pw_coll_run(group, &good, why, sizeof why) == -ECANCELED && std::chrono::steady_clock::now() - start <
         std::chrono::milliseconds(100), "an op on a group abandoned before it fails at once: %s", why);
  pw_coll_detach(group);
  munmap(m.base, m.bytes);
}

void test_every_op_and_dtype_among_one_to_four_members() {
  for (int size = 1; size <= 4; ++size) {
    in_members(size, 256, [size](void* group, int rank) -> std::string {
      for (int dtype = 0; dtype < kDTypes; ++dtype) {
        for (int kind = kAllReduce; kind <= kAllToAll; ++kind) {
          for (uint64_t count : {0, 1, 5, 333}) {   // 333 elements: many 256-byte steps, both banks
            for (int op : {kSum, kMax, kMin, kProduct}) {
              if ((kind != kAllReduce && kind != kReduceScatter && op != kSum) ||
                  (op == kProduct && (dtype == kF16 || dtype == kBF16 || dtype == kI8))) {
                continue;   // products of 4 members may round in the half formats or wrap in int8
              }
              std::string failure = run_and_check(group, rank, size, kind, dtype, op, count);
              if (!failure.empty()) {
                return std::string(kDTypeNames[dtype]) + " kind " + std::to_string(kind) + " op " +
                       std::to_string(op) + " count " + std::to_string(count) + ": " + failure;
              }
            }
          }
        }
      }
      return "";
    });
  }
}

void test_64_mib() {
  in_members(2, 512 << 10, [](void* group, int rank) {
    return run_and_check(group, rank, 2, kAllReduce, kF32, kSum, 16 << 20);
  });
}

void test_members_out_of_step_are_refused_and_fail_the_group() {
  in_members(2, 4096, [](void* group, int rank) -> std::string {
    std::vector<float> in(8, 1), out(8);
    pw_coll_op r = request(kAllReduce, kF32, kSum, rank == 0 ? 4 : 5, in.data(), out.data());
    char why[512] = "";
    int code = pw_coll_run(group, &r, why, sizeof why);
    if (code != -EBADMSG || pw_coll_refused(group) != 1 || !std::strstr(why, "out of step")) {
      return "a mismatch: code " + std::to_string(code) + ", " + why;
    }
    r.count = 4;
    if (pw_coll_run(group, &r, why, sizeof why) != -ECANCELED) return "an op after a mismatch did not fail";
    return "";
  });
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void test_abandon_and_timeout_end_a_wait() {
  Mapping m = shared_mapping(2, 4096, 3);
  void* group = pw_coll_attach(m.base, m.bytes, 0, 2, 4096, 3);
  float x = 1, y = 0;
  char why[512] = "";
  pw_coll_op r = request(kAllReduce, kF32, kSum, 1, &x, &y, 0.3);
  auto start = std::chrono::steady_clock::now();
  EXPECT(pw_coll_run(group, &r, why, sizeof why) == -ETIMEDOUT, "a lone member times out");
  EXPECT(seconds_since(start) < 2.0 && std::strstr(why, "member(s) 1 had not reached step 1"),
         "the timeout names the missing member in time: %.2f s, %s", seconds_since(start), why);
  pw_coll_detach(group);
  std::memset(m.base, 0, m.bytes);
  EXPECT(pw_coll_init(m.base, m.bytes, 2, 4096, 3) == 0, "init again");
  group = pw_coll_attach(m.base, m.bytes, 0, 2, 4096, 3);
  r.timeout_s = 30;
  std::thread abandoner([group]() {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    pw_coll_abandon(group);
  });
  start = std::chrono::steady_clock::now();
  EXPECT(pw_coll_run(group, &r, why, sizeof why) == -ECANCELED, "an abandoned wait fails");
  abandoner.join();
  EXPECT(seconds_since(start) < 0.5, "abandon ends the wait within its slice (%.2f s)", seconds_since(start));
  void* other = pw_coll_attach(m.base, m.bytes, 1, 2, 4096, 3);
  EXPECT(pw_coll_run(other, &r, why, sizeof why) == -ECANCELED && std::strstr(why, "member 0 failed the group"),
         "the other member fails at once, naming who failed the group: %s", why);
  pw_coll_detach(other);
  pw_coll_detach(group);
  munmap(m.base, m.bytes);
}

void test_a_killed_member_never_leaves_wrong_data() {
  std::mt19937 random(5);
  for (int trial = 0; trial < 6; ++trial) {
    Mapping m = shared_mapping(2, 1024, 9);
    pid_t child = fork();
    EXPECT(child >= 0, "fork");
    if (child == 0) {
      void* group = pw_coll_attach(m.base, m.bytes, 1, 2, 1024, 9);
      for (;;) run_and_check(group, 1, 2, kAllReduce, kI32, kSum, 1000);
    }
    void* group = pw_coll_attach(m.base, m.bytes, 0, 2, 1024, 9);
    std::thread killer([child, &random]() {
      std::this_thread::sleep_for(std::chrono::microseconds(2000 + random() % 20000));
      kill(child, SIGKILL);
    });
    for (;;) {
      std::vector<int32_t> in(1000), out(1000);
      for (int i = 0; i < 1000; ++i) in[i] = value(kI32, 0, i);
      pw_coll_op r = request(kAllReduce, kI32, kSum, 1000, in.data(), out.data(), 0.3);
      char why[512];
      int code = pw_coll_run(group, &r, why, sizeof why);
      if (code != 0) {
        EXPECT(code == -ETIMEDOUT && std::strstr(why, "member(s) 1"), "the survivor's op times out naming it: %s", why);
        break;
      }
      for (int i = 0; i < 1000; ++i) EXPECT(out[i] == reduced(kSum, kI32, 2, i), "element %d after a kill", i);
    }
    killer.join();
    waitpid(child, nullptr, 0);
    pw_coll_detach(group);
    munmap(m.base, m.bytes);
  }
}

}  // namespace

void shm_collectives_units() {
  test_geometry_and_bad_requests_refused();
  test_every_op_and_dtype_among_one_to_four_members();
  test_64_mib();
  test_members_out_of_step_are_refused_and_fail_the_group();
  test_abandon_and_timeout_end_a_wait();
  test_a_killed_member_never_leaves_wrong_data();
  std::printf("shm_collectives: all passed\n");
}
