// Collectives among the executors of one host through one shared mapping: all_reduce, all_gather, reduce_scatter,
// broadcast and all_to_all with no helper thread, no socket and one futex wait per step (issue 49, point 2;
// executor/shm_group.py makes the mapping, passes it and calls in; the XLA custom calls call in too).
//
// The mapping is a Header, one RankState per member, then two banks of `size` slots of `slot_bytes` each. An op
// goes in steps; step k of a member (its own count, the same on every member since all run the same ops in the
// same order) uses bank k % 2: the member writes its stripe of the input into its own slot and its Descriptor
// (what op, what dtype, how many elements, the caller's tag), publishes `arrived = k + 1`, waits until every
// member has, checks every member's Descriptor equals its own, then reads the stripes it needs from every slot.
// Two banks make one wait per step enough: a member writes bank k % 2 only after all arrived at k - 1, that is,
// after all finished reading step k - 2, the last use of that bank.
//
// Reductions run in member order on every member, so every member gets the same bits. Results equal
// torch.distributed's (gloo) for two members exactly; for more, floating sums may differ in their last bits,
// since gloo's order is its own.
//
// A wait spins for a few microseconds, then sleeps on the header's futex word in slices of at most 200 ms, so
// `pw_coll_abandon` (any thread) ends it within one slice; past the op's timeout it fails naming the members that
// did not come. A failed member (abandoned, timed out, a mismatch) marks the mapping broken, and every member's
// wait ends at once: no member waits a whole timeout for one that left. The mapping is shared with peers that
// may be buggy or dead: each member keeps its own copy of the geometry (Group) and never reads sizes from it again;
// a Descriptor that does not match is refused (counted) and no slot is read after it.
//
// C ABI (ctypes releases the GIL for each call); no Python, no thread of its own.

#include "shm_collectives.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <new>
#include <string>
#include <type_traits>

namespace {

constexpr uint64_t kMagic = 0x6c6c6f63'68746170ULL;   // "pathcoll", little-endian
constexpr uint32_t kVersion = 1;
constexpr uint64_t kAlign = 64;
constexpr int32_t kMaxMembers = 1024;
constexpr uint64_t kMaxSlotBytes = 1ULL << 30;
constexpr uint64_t kMaxCount = 1ULL << 40;
constexpr auto kSlice = std::chrono::milliseconds(200);   // as executor.collectives._WAIT_SLICE
constexpr auto kSpin = std::chrono::microseconds(20);

enum Kind : int32_t { kAllReduce = 1, kAllGather = 2, kReduceScatter = 3, kBroadcast = 4, kAllToAll = 5 };
enum Reduce : int32_t { kSum = 0, kMax = 1, kMin = 2, kProduct = 3 };
enum DType : int32_t { kF32, kF64, kF16, kBF16, kI8, kU8, kI16, kI32, kI64, kBool, kDTypes };
constexpr uint64_t kElementBytes[kDTypes] = {4, 8, 2, 2, 1, 1, 2, 4, 8, 1};
const char* const kKindNames[] = {"?", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"};

struct Descriptor {
  int32_t kind, dtype, reduce, root;
  uint64_t count, tag, step;
};

struct Header {
  uint64_t magic;
  uint32_t version;
  int32_t size;
  uint64_t slot_bytes;
  uint64_t group_tag;   // the group this mapping was made for (its id and epoch): a stale mapping is refused
  alignas(64) std::atomic<uint32_t> wake;      // the futex word: bumped by every arrival
  std::atomic<uint32_t> waiters;               // members asleep on it (an arrival with none makes no system call)
  std::atomic<int32_t> broken;                 // 1 + the rank that failed the group, 0 while it is whole
};

struct alignas(64) RankState {
  std::atomic<uint64_t> arrived;   // steps this member has published
  Descriptor step_of[2];           // per bank: the op of the step published there
};

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "counters are shared between processes");

uint64_t align_up(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
uint64_t ranks_offset() { return align_up(sizeof(Header)); }
uint64_t slots_offset(int32_t size) { return align_up(ranks_offset() + sizeof(RankState) * uint64_t(size)); }

bool geometry_ok(int32_t size, uint64_t slot_bytes) {
  return size >= 1 && size <= kMaxMembers && slot_bytes % kAlign == 0 && slot_bytes >= kAlign * uint64_t(size) &&
         slot_bytes <= kMaxSlotBytes;
}

// ------------------------------------------------------------------ element types and reductions

uint32_t bits_of(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
float float_of(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return float_of(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    if (mantissa == 0) return float_of(sign);
    return (sign ? -1.0f : 1.0f) * float(mantissa) * 5.9604644775390625e-8f;   // subnormal: mantissa * 2^-24
  }
  return float_of(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t float_to_half(float value) {   // round to nearest, ties to even, as torch's Half
  uint32_t f = bits_of(value), sign = (f >> 16) & 0x8000u;
  f &= 0x7fffffffu;
  if (f >= 0x47800000u) return uint16_t(sign | (f > 0x7f800000u ? 0x7e00u : 0x7c00u));   // overflow, inf, NaN
  if (f < 0x38800000u) {   // a half subnormal (or zero): let the float adder round at 2^-24
    float shifted = float_of(f) + 0.5f;
    return uint16_t(sign | (bits_of(shifted) - 0x3f000000u));
  }
  uint32_t odd = (f >> 13) & 1u;
  f += 0xc8000fffu + odd;   // rebias the exponent (-112 << 23) and round the 13 dropped bits
  return uint16_t(sign | (f >> 13));
}

float bf16_to_float(uint16_t b) { return float_of(uint32_t(b) << 16); }

uint16_t float_to_bf16(float value) {   // round to nearest, ties to even, as torch's BFloat16
  uint32_t f = bits_of(value);
  if ((f & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return uint16_t((f + 0x7fffu + ((f >> 16) & 1u)) >> 16);
}

template <typename T>
T combine(T a, T b, int32_t op) {
  if constexpr (std::is_same_v<T, bool>) {
    return (op == kSum || op == kMax) ? (a || b) : (a && b);
  } else if constexpr (std::is_integral_v<T>) {   // modular sums and products, as torch's: no signed overflow
    using U = std::make_unsigned_t<T>;
    switch (op) {
      case kSum: return T(U(uint64_t(a) + uint64_t(b)));
      case kProduct: return T(U(uint64_t(a) * uint64_t(b)));
      case kMax: return a < b ? b : a;
      default: return b < a ? b : a;
    }
  } else {
    switch (op) {
      case kSum: return a + b;
      case kProduct: return a * b;
      case kMax: return a < b ? b : a;   // std::max's order, as gloo's
      default: return b < a ? b : a;
    }
  }
}

template <typename T>
void combine_into(void* into, const void* from, uint64_t n, int32_t op) {
  T* out = static_cast<T*>(into);
  const T* in = static_cast<const T*>(from);
  for (uint64_t i = 0; i < n; ++i) out[i] = combine(out[i], in[i], op);
}

template <float (*Widen)(uint16_t), uint16_t (*Narrow)(float)>
void combine_narrow(void* into, const void* from, uint64_t n, int32_t op) {   // each step rounded, as torch's
  uint16_t* out = static_cast<uint16_t*>(into);
  const uint16_t* in = static_cast<const uint16_t*>(from);
  for (uint64_t i = 0; i < n; ++i) out[i] = Narrow(combine(Widen(out[i]), Widen(in[i]), op));
}

void combine_any(int32_t dtype, void* into, const void* from, uint64_t n, int32_t op) {
  switch (dtype) {
    case kF32: return combine_into<float>(into, from, n, op);
    case kF64: return combine_into<double>(into, from, n, op);
    case kF16: return combine_narrow<half_to_float, float_to_half>(into, from, n, op);
    case kBF16: return combine_narrow<bf16_to_float, float_to_bf16>(into, from, n, op);
    case kI8: return combine_into<int8_t>(into, from, n, op);
    case kU8: return combine_into<uint8_t>(into, from, n, op);
    case kI16: return combine_into<int16_t>(into, from, n, op);
    case kI32: return combine_into<int32_t>(into, from, n, op);
    case kI64: return combine_into<int64_t>(into, from, n, op);
    default: return combine_into<bool>(into, from, n, op);
  }
}

// ------------------------------------------------------------------ a member's private view

struct Group {
  uint8_t* base;
  int32_t rank, size;
  uint64_t slot_bytes, step = 0, refused = 0;
  std::atomic<uint32_t> abandoned{0};
  std::string failure;   // why this member failed the group: every later op fails with it

  Header* header() const { return reinterpret_cast<Header*>(base); }
  RankState* rank_state(int32_t r) const {
    return reinterpret_cast<RankState*>(base + ranks_offset()) + r;
  }
  uint8_t* slot(uint64_t bank, int32_t r) const {
    return base + slots_offset(size) + (bank * uint64_t(size) + uint64_t(r)) * slot_bytes;
  }
};

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

void wake_all(Header* h) {
  h->wake.fetch_add(1);
  if (h->waiters.load() > 0) futex(&h->wake, FUTEX_WAKE, INT32_MAX, nullptr);
}

int fail(Group& g, int code, char* why, uint64_t why_bytes, const char* format, ...) {
  char text[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(text, sizeof text, format, args);
  va_end(args);
  if (g.failure.empty()) g.failure = text;
  int32_t none = 0;
  if (g.header()->broken.compare_exchange_strong(none, g.rank + 1)) wake_all(g.header());
  if (why != nullptr && why_bytes > 0) std::snprintf(why, why_bytes, "%s", g.failure.c_str());
  return code;
}

// The members that have not published step `target` yet, as text ("1, 3"); empty once all have.
std::string missing(const Group& g, uint64_t target) {
  std::string names;
  for (int32_t r = 0; r < g.size; ++r) {
    if (g.rank_state(r)->arrived.load() < target) names += (names.empty() ? "" : ", ") + std::to_string(r);
  }
  return names;
}

bool all_arrived(const Group& g, uint64_t target) {
  for (int32_t r = 0; r < g.size; ++r) {
    if (g.rank_state(r)->arrived.load() < target) return false;
  }
  return true;
}

using Clock = std::chrono::steady_clock;

int wait_for_all(Group& g, uint64_t target, Clock::time_point deadline, double timeout_s, char* why,
                 uint64_t why_bytes) {
  Header* h = g.header();
  const Clock::time_point spin_until = Clock::now() + kSpin;
  for (;;) {
    uint32_t seen = h->wake.load();
    if (all_arrived(g, target)) return 0;
    if (g.abandoned.load()) return fail(g, -ECANCELED, why, why_bytes, "the group was abandoned");
    int32_t broken = h->broken.load();
    if (broken != 0) {
      return fail(g, -ECANCELED, why, why_bytes, "member %d failed the group, so its collectives cannot complete",
                  broken - 1);
    }
    Clock::time_point now = Clock::now();
    if (now < spin_until) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
      continue;
    }
    if (now >= deadline) {
      return fail(g, -ETIMEDOUT, why, why_bytes, "member(s) %s had not reached step %llu after %.1f s",
                  missing(g, target).c_str(), static_cast<unsigned long long>(target), timeout_s);
    }
    auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(std::min<Clock::duration>(kSlice, deadline - now));
    timespec slice{static_cast<time_t>(left.count() / 1000000000), static_cast<long>(left.count() % 1000000000)};
    h->waiters.fetch_add(1);
    if (!all_arrived(g, target) && !g.abandoned.load()) futex(&h->wake, FUTEX_WAIT, seen, &slice);
    h->waiters.fetch_sub(1);
  }
}

bool same_op(const Descriptor& a, const Descriptor& b) {
  return a.kind == b.kind && a.dtype == b.dtype && a.reduce == b.reduce && a.root == b.root && a.count == b.count &&
         a.tag == b.tag && a.step == b.step;
}

// One step's stripe: elements [first, first + n) of each part (one part, or one per member).
struct Stripe {
  uint64_t first, n;
};

void write_stripe(const Group& g, const Descriptor& op, const uint8_t* in, uint64_t per_step, Stripe s,
                  uint8_t* mine) {
  const uint64_t e = kElementBytes[op.dtype];
  switch (op.kind) {
    case kReduceScatter:
    case kAllToAll:
      for (int32_t part = 0; part < g.size; ++part) {
        std::memcpy(mine + part * per_step * e, in + (part * op.count + s.first) * e, s.n * e);
      }
      return;
    case kBroadcast:
      if (g.rank != op.root) return;
      [[fallthrough]];
    default:
      std::memcpy(mine, in + s.first * e, s.n * e);
  }
}

void read_stripe(const Group& g, const Descriptor& op, uint64_t bank, uint64_t per_step, Stripe s, uint8_t* out) {
  const uint64_t e = kElementBytes[op.dtype], bytes = s.n * e;
  switch (op.kind) {
    case kAllReduce:
    case kReduceScatter: {   // our part of every member's slot, reduced in member order
      const uint64_t part = op.kind == kAllReduce ? 0 : uint64_t(g.rank) * per_step * e;
      uint8_t* into = out + s.first * e;
      std::memmove(into, g.slot(bank, 0) + part, bytes);
      for (int32_t r = 1; r < g.size; ++r) combine_any(op.dtype, into, g.slot(bank, r) + part, s.n, op.reduce);
      return;
    }
    case kAllGather:
      for (int32_t r = 0; r < g.size; ++r) std::memmove(out + (r * op.count + s.first) * e, g.slot(bank, r), bytes);
      return;
    case kBroadcast:
      std::memmove(out + s.first * e, g.slot(bank, op.root), bytes);
      return;
    default:   // all_to_all: our part of member r's slot is our output's part r
      for (int32_t r = 0; r < g.size; ++r) {
        std::memcpy(out + (r * op.count + s.first) * e, g.slot(bank, r) + g.rank * per_step * e, bytes);
      }
  }
}

}  // namespace

extern "C" {

uint64_t pw_coll_bytes(int32_t size, uint64_t slot_bytes) {
  if (!geometry_ok(size, slot_bytes)) return 0;
  return slots_offset(size) + 2 * uint64_t(size) * slot_bytes;
}

// The creator's first write into a fresh (zeroed) mapping of pw_coll_bytes(size, slot_bytes) bytes.
int pw_coll_init(void* base, uint64_t mapped, int32_t size, uint64_t slot_bytes, uint64_t group_tag) {
  uint64_t needed = pw_coll_bytes(size, slot_bytes);
  if (base == nullptr || needed == 0 || mapped < needed) return -EINVAL;
  auto* h = static_cast<Header*>(base);
  h->magic = kMagic;
  h->version = kVersion;
  h->size = size;
  h->slot_bytes = slot_bytes;
  h->group_tag = group_tag;
  return 0;
}

// A member's private view of a mapping that must have been made for this geometry and group; null if it was not.
void* pw_coll_attach(void* base, uint64_t mapped, int32_t rank, int32_t size, uint64_t slot_bytes, uint64_t group_tag) {
  uint64_t needed = pw_coll_bytes(size, slot_bytes);
  if (base == nullptr || needed == 0 || mapped < needed || rank < 0 || rank >= size) return nullptr;
  const auto* h = static_cast<const Header*>(base);
  if (h->magic != kMagic || h->version != kVersion || h->size != size || h->slot_bytes != slot_bytes ||
      h->group_tag != group_tag) {
    return nullptr;
  }
  auto* g = new (std::nothrow) Group();
  if (g == nullptr) return nullptr;
  g->base = static_cast<uint8_t*>(base);
  g->rank = rank;
  g->size = size;
  g->slot_bytes = slot_bytes;
  return g;
}

void pw_coll_detach(void* group) { delete static_cast<Group*>(group); }

// Any thread: a wait in this group ends within one slice, and this and every later op fail.
void pw_coll_abandon(void* group) {
  auto* g = static_cast<Group*>(group);
  g->abandoned.store(1);
  wake_all(g->header());
}

uint64_t pw_coll_refused(void* group) { return static_cast<Group*>(group)->refused; }

// 0, or -EINVAL (a bad op: nothing done), -ECANCELED (abandoned, or another member failed the group), -ETIMEDOUT,
// -EBADMSG (members ran different ops); `why` says which and who. After any failure the group stays failed.
int pw_coll_run(void* group, const pw_coll_op* request, char* why, uint64_t why_bytes) {
  Group& g = *static_cast<Group*>(group);
  const pw_coll_op& r = *request;
  if (r.kind < kAllReduce || r.kind > kAllToAll || r.dtype < 0 || r.dtype >= kDTypes || r.reduce < kSum ||
      r.reduce > kProduct || r.root < 0 || r.root >= g.size || r.count > kMaxCount || !(r.timeout_s > 0) ||
      (r.count > 0 && (r.input == nullptr || r.output == nullptr))) {
    if (why != nullptr && why_bytes > 0) std::snprintf(why, why_bytes, "an invalid collective request");
    return -EINVAL;
  }
  if (!g.failure.empty()) {
    if (why != nullptr && why_bytes > 0) std::snprintf(why, why_bytes, "%s", g.failure.c_str());
    return -ECANCELED;
  }
  if (g.abandoned.load()) return fail(g, -ECANCELED, why, why_bytes, "the group was abandoned");
  const bool striped = r.kind == kReduceScatter || r.kind == kAllToAll;
  const bool reduces = r.kind == kAllReduce || r.kind == kReduceScatter;
  const uint64_t per_step = g.slot_bytes / kElementBytes[r.dtype] / (striped ? uint64_t(g.size) : 1);
  const uint64_t steps = r.count == 0 ? 1 : (r.count + per_step - 1) / per_step;
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(r.timeout_s));
  const auto* in = static_cast<const uint8_t*>(r.input);
  auto* out = static_cast<uint8_t*>(r.output);
  for (uint64_t s = 0; s < steps; ++s) {
    if (int32_t broken = g.header()->broken.load(); broken != 0) {   // failed before this step: not even published
      return fail(g, -ECANCELED, why, why_bytes, "member %d failed the group, so its collectives cannot complete",
                  broken - 1);
    }
    const uint64_t bank = g.step % 2;
    const Stripe stripe{s * per_step, std::min(per_step, r.count - std::min(r.count, s * per_step))};
    const Descriptor mine{r.kind, r.dtype, reduces ? r.reduce : kSum, r.kind == kBroadcast ? r.root : 0, r.count, r.tag,
                          g.step};   // what the op ignores is not compared
    write_stripe(g, mine, in, per_step, stripe, g.slot(bank, g.rank));
    RankState* self = g.rank_state(g.rank);
    self->step_of[bank] = mine;
    self->arrived.store(g.step + 1);
    wake_all(g.header());
    int waited = wait_for_all(g, g.step + 1, deadline, r.timeout_s, why, why_bytes);
    if (waited != 0) return waited;
    for (int32_t m = 0; m < g.size; ++m) {
      const Descriptor theirs = g.rank_state(m)->step_of[bank];
      if (!same_op(theirs, mine)) {
        ++g.refused;
        auto name = [](int32_t kind) { return kKindNames[kind >= kAllReduce && kind <= kAllToAll ? kind : 0]; };
        return fail(g, -EBADMSG, why, why_bytes,
                    "member %d ran %s (dtype %d, %llu elements, tag %llu, step %llu) where member %d ran %s (dtype %d, "
                    "%llu elements, tag %llu, step %llu): the members' collectives are out of step",
                    m, name(theirs.kind), theirs.dtype, static_cast<unsigned long long>(theirs.count),
                    static_cast<unsigned long long>(theirs.tag), static_cast<unsigned long long>(theirs.step), g.rank,
                    name(mine.kind), mine.dtype, static_cast<unsigned long long>(mine.count),
                    static_cast<unsigned long long>(mine.tag), static_cast<unsigned long long>(mine.step));
      }
    }
    read_stripe(g, mine, bank, per_step, stripe, out);
    ++g.step;
  }
  return 0;
}

}  // extern "C"
