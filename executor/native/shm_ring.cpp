// A one-writer, one-reader ring of messages in a shared mapping: how two executors of one host pass arrays
// without ZeroMQ, CURVE or a helper thread (issue 49; executor/shm_ring.py maps it and passes the descriptors).
//
// The mapping is a Header (one page) and `capacity` bytes of data (a power of two). Positions `head` (bytes the
// writer has committed) and `tail` (bytes the reader has released) only grow; a byte at position p lives at
// data[p % capacity]. A message is written as one or more chunks, each a 32-byte ChunkHeader and its bytes, padded
// to 64; a chunk never wraps (where it would, a pad chunk fills the end of the data first). The writer fills a
// chunk, then publishes it by storing `head` with release order; the reader loads `head` with acquire order. A
// writer killed mid-chunk never moved `head`: its reader never sees a torn chunk. A message bigger than the ring
// goes in chunks as space frees (`pw_ring_write` says how far it got; the caller tries again later).
//
// Wake-ups are the caller's (an eventfd per direction, polled with the executor's sockets): `reader_sleeping` and
// `writer_waiting` say whether the other side must be woken, so a busy pair makes no system call at all.
//
// Everything read from the mapping is checked before use: the peer shares it and may be buggy or dead. So each side
// keeps what it relies on in a `pw_ring_view` of its own (the mapping's address, the capacity it checked once, its
// own position): the shared header's capacity is never read again, and the shared head and tail are only what the
// other side publishes, checked (64-aligned, within one ring of our own position) before use. A chunk whose header
// does not match (magic, its own check word, a length past what was committed or past the ring) is refused with
// -EBADMSG and the ring is unusable from then on (the caller drops it and counts it).
//
// C ABI (ctypes releases the GIL for each call); no Python, no allocation, no thread of its own.

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace {

constexpr uint64_t kMagic = 0x676e6972'68746170ULL;   // "pathring", little-endian
constexpr uint32_t kVersion = 1;
constexpr uint64_t kHeaderBytes = 4096;
constexpr uint64_t kAlign = 64;
constexpr uint32_t kChunkMagic = 0x6b6e6863u;   // "chnk"
constexpr uint32_t kData = 1;
constexpr uint32_t kPad = 2;
constexpr uint64_t kMinCapacity = 4096;
constexpr uint64_t kMaxCapacity = 1ULL << 34;

struct Header {
  uint64_t magic;
  uint32_t version;
  uint32_t header_bytes;
  uint64_t capacity;
  uint64_t writer_epoch;   // the incarnations this ring was made for: a replacement gets a new ring
  uint64_t reader_epoch;
  alignas(64) std::atomic<uint64_t> head;
  alignas(64) std::atomic<uint64_t> tail;
  alignas(64) std::atomic<uint32_t> reader_sleeping;
  std::atomic<uint32_t> writer_waiting;
  std::atomic<uint32_t> broken;   // a side found the ring corrupt: both stop using it
};
static_assert(sizeof(Header) <= kHeaderBytes, "the header fits its page");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "positions are shared between processes");

}  // namespace

extern "C" {
// One side's private view of a ring: never in the shared mapping.
struct pw_ring_view {
  void* base;
  uint64_t capacity;   // checked once against the mapping's size (pw_ring_attach)
  uint64_t position;   // the writer's head, or the reader's tail
};
}

namespace {

struct ChunkHeader {
  uint32_t magic;
  uint32_t kind;
  uint64_t seq;      // the message's sequence number (the writer's count)
  uint32_t length;   // bytes of this chunk
  uint32_t check;    // magic ^ kind ^ length ^ low and high words of seq and offset
  uint64_t offset;   // where this chunk's bytes go in the message (a pad: the bytes it skips)
};
static_assert(sizeof(ChunkHeader) == 32, "a chunk header is 32 bytes");

// Follows every data chunk's header: the whole message's size, so a reader can place any chunk.
struct ChunkTotal {
  uint64_t total;
  uint64_t reserved[3];
};
static_assert(sizeof(ChunkTotal) == 32, "the total follows the header, 32 bytes");

constexpr uint64_t kChunkOverhead = sizeof(ChunkHeader) + sizeof(ChunkTotal);

uint64_t round_up(uint64_t n) { return (n + kAlign - 1) & ~(kAlign - 1); }

uint32_t check_word(const ChunkHeader& c) {
  return c.magic ^ c.kind ^ c.length ^ static_cast<uint32_t>(c.seq) ^ static_cast<uint32_t>(c.seq >> 32) ^
         static_cast<uint32_t>(c.offset) ^ static_cast<uint32_t>(c.offset >> 32) ^ 0x9e3779b9u;
}

Header* header(void* base) { return static_cast<Header*>(base); }
unsigned char* data(void* base) { return static_cast<unsigned char*>(base) + kHeaderBytes; }

// The largest chunk's bytes: at most a quarter of the ring, so a pad never blocks a chunk for long.
uint64_t max_chunk(uint64_t capacity) {
  uint64_t most = capacity / 4 - kChunkOverhead;
  return most > 0xffffffffULL ? 0xffffffffULL & ~(kAlign - 1) : most;
}

bool power_of_two(uint64_t n) { return n && !(n & (n - 1)); }

}  // namespace

extern "C" {

// Bytes to map for a ring of `capacity` data bytes (0 if capacity is not a power of two in range).
uint64_t pw_ring_bytes(uint64_t capacity) {
  if (!power_of_two(capacity) || capacity < kMinCapacity || capacity > kMaxCapacity) return 0;
  return kHeaderBytes + capacity;
}

// Make a ring in `base` (pw_ring_bytes(capacity) zeroed bytes, as a fresh memfd maps). 0, or -EINVAL.
int pw_ring_init(void* base, uint64_t capacity, uint64_t writer_epoch, uint64_t reader_epoch) {
  if (!base || !pw_ring_bytes(capacity)) return -EINVAL;
  Header* h = header(base);
  h->version = kVersion;
  h->header_bytes = kHeaderBytes;
  h->capacity = capacity;
  h->writer_epoch = writer_epoch;
  h->reader_epoch = reader_epoch;
  h->head.store(0, std::memory_order_relaxed);
  h->tail.store(0, std::memory_order_relaxed);
  h->reader_sleeping.store(0, std::memory_order_relaxed);
  h->writer_waiting.store(0, std::memory_order_relaxed);
  h->broken.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kMagic;
  return 0;
}

// Check that `base` (`mapped` bytes) is a fresh ring made for these incarnations, and fill `view` for one side:
// 0; -EPROTO (not a ring, another version, a size that does not match the mapping, already used), or -ESTALE
// (made for other incarnations: refused). From here on nothing but head and tail is read from the header.
int pw_ring_attach(void* base, uint64_t mapped, uint64_t writer_epoch, uint64_t reader_epoch, pw_ring_view* view) {
  if (!base || !view || mapped < kHeaderBytes) return -EPROTO;
  const Header* h = header(base);
  if (h->magic != kMagic || h->version != kVersion || h->header_bytes != kHeaderBytes) return -EPROTO;
  const uint64_t capacity = h->capacity;
  if (!pw_ring_bytes(capacity) || pw_ring_bytes(capacity) != mapped) return -EPROTO;
  if (h->writer_epoch != writer_epoch || h->reader_epoch != reader_epoch) return -ESTALE;
  if (h->head.load(std::memory_order_acquire) || h->tail.load(std::memory_order_acquire)) return -EPROTO;
  view->base = base;
  view->capacity = capacity;
  view->position = 0;
  return 0;
}

namespace {

// The reader's published tail, as the writer may trust it (64-aligned, at most a ring behind our head); else the
// ring is broken and ~0.
uint64_t trusted_tail(pw_ring_view* v) {
  Header* h = header(v->base);
  const uint64_t tail = h->tail.load(std::memory_order_seq_cst);
  if (tail > v->position || v->position - tail > v->capacity || tail % kAlign) {
    h->broken.store(1);
    return ~0ULL;
  }
  return tail;
}

// The writer's published head, as the reader may trust it; else the ring is broken and ~0.
uint64_t trusted_head(pw_ring_view* v) {
  Header* h = header(v->base);
  const uint64_t head = h->head.load(std::memory_order_acquire);
  if (head < v->position || head - v->position > v->capacity || head % kAlign) {
    h->broken.store(1);
    return ~0ULL;
  }
  return head;
}

}  // namespace

// Write message `seq`, the concatenation of `n_parts` buffers, from byte `*offset` on, in chunks while the ring has
// room (`*offset` moves past what was written). Returns 1 when the whole message is in, 0 when the ring is full
// (call again with the same arguments once the reader frees space: `writer_waiting` stays set, so the reader wakes
// us), -EPIPE (broken ring) or -EINVAL. `*wake` is set to 1 when the reader sleeps and must be woken.
int pw_ring_write(pw_ring_view* v, uint64_t seq, const void* const* parts, const uint64_t* lengths, int n_parts,
                  uint64_t* offset, int* wake) {
  if (!v || !v->base || !wake || !offset || n_parts < 0 || (n_parts && (!parts || !lengths))) return -EINVAL;
  Header* h = header(v->base);
  *wake = 0;
  if (h->broken.load(std::memory_order_acquire)) return -EPIPE;
  uint64_t total = 0;
  for (int i = 0; i < n_parts; ++i) total += lengths[i];
  if (*offset > total || (total && *offset == total)) return -EINVAL;
  const uint64_t capacity = v->capacity;
  const uint64_t most = max_chunk(capacity);
  for (;;) {   // at least one chunk: an empty message is one empty chunk
    const uint64_t tail = trusted_tail(v);
    if (tail == ~0ULL) return -EPIPE;
    const uint64_t head = v->position;
    const uint64_t length = total - *offset < most ? total - *offset : most;
    const uint64_t need = round_up(kChunkOverhead + length);
    const uint64_t at = head % capacity;
    const uint64_t pad = capacity - at < need ? capacity - at : 0;
    if (capacity - (head - tail) < pad + need) {
      h->writer_waiting.store(1, std::memory_order_seq_cst);
      // The reader may have freed space between our load and the flag: look once more.
      if (h->tail.load(std::memory_order_seq_cst) == tail) return 0;
      h->writer_waiting.store(0, std::memory_order_relaxed);
      continue;
    }
    unsigned char* ring = data(v->base);
    if (pad) {
      ChunkHeader p{kChunkMagic, kPad, seq, 0, 0, pad};
      p.check = check_word(p);
      std::memcpy(ring + at, &p, sizeof p);
    }
    unsigned char* out = ring + (head + pad) % capacity;
    ChunkHeader c{kChunkMagic, kData, seq, static_cast<uint32_t>(length), 0, *offset};
    c.check = check_word(c);
    ChunkTotal t{total, {0, 0, 0}};
    std::memcpy(out, &c, sizeof c);
    std::memcpy(out + sizeof c, &t, sizeof t);
    // Gather [offset, offset + length) of the message's parts.
    unsigned char* dst = out + kChunkOverhead;
    uint64_t skip = *offset, left = length;
    for (int i = 0; i < n_parts && left; ++i) {
      if (skip >= lengths[i]) { skip -= lengths[i]; continue; }
      const uint64_t take = lengths[i] - skip < left ? lengths[i] - skip : left;
      std::memcpy(dst, static_cast<const unsigned char*>(parts[i]) + skip, take);
      dst += take;
      left -= take;
      skip = 0;
    }
    v->position = head + pad + need;
    *offset += length;
    h->head.store(v->position, std::memory_order_seq_cst);   // the commit: the chunk is whole before it is visible
    if (h->reader_sleeping.load(std::memory_order_seq_cst) && h->reader_sleeping.exchange(0)) *wake = 1;
    if (*offset >= total) return 1;
  }
}

// The next chunk for the reader: 1 and its fields (data at base + *data_at), 0 if none is committed, -EBADMSG for
// a chunk or a head that does not check (the ring is then broken), -EPIPE if broken before. Pads are skipped.
int pw_ring_next(pw_ring_view* v, uint64_t* seq, uint64_t* total, uint64_t* offset, uint64_t* length,
                 uint64_t* data_at) {
  if (!v || !v->base || !seq || !total || !offset || !length || !data_at) return -EINVAL;
  Header* h = header(v->base);
  if (h->broken.load(std::memory_order_acquire)) return -EPIPE;
  const uint64_t capacity = v->capacity;
  for (;;) {
    const uint64_t tail = v->position;
    const uint64_t head = trusted_head(v);
    if (head == ~0ULL) return -EBADMSG;
    if (head == tail) return 0;
    const uint64_t at = tail % capacity;   // 64-aligned: our own position
    if (head - tail < kChunkOverhead) { h->broken.store(1); return -EBADMSG; }
    ChunkHeader c;
    std::memcpy(&c, data(v->base) + at, sizeof c);
    if (c.magic != kChunkMagic || c.check != check_word(c) || (c.kind != kData && c.kind != kPad)) {
      h->broken.store(1);
      return -EBADMSG;
    }
    if (c.kind == kPad) {
      if (c.offset != capacity - at || c.offset > head - tail) { h->broken.store(1); return -EBADMSG; }
      v->position = tail + c.offset;
      h->tail.store(v->position, std::memory_order_seq_cst);
      continue;
    }
    const uint64_t need = round_up(kChunkOverhead + c.length);
    ChunkTotal t;
    std::memcpy(&t, data(v->base) + at + sizeof c, sizeof t);
    if (need > head - tail || need > capacity - at || c.offset > t.total || c.length > t.total - c.offset) {
      h->broken.store(1);
      return -EBADMSG;
    }
    *seq = c.seq;
    *total = t.total;
    *offset = c.offset;
    *length = c.length;
    *data_at = kHeaderBytes + at + kChunkOverhead;
    return 1;
  }
}

// Let go of the chunk pw_ring_next gave (its bytes may be overwritten from now on). `*wake` is set to 1 when the
// writer waits for space and must be woken. 0, or -EBADMSG / -EPIPE / -EINVAL (no chunk to let go of).
int pw_ring_release(pw_ring_view* v, int* wake) {
  if (!v || !v->base || !wake) return -EINVAL;
  *wake = 0;
  uint64_t seq, total, offset, length, data_at;
  const int got = pw_ring_next(v, &seq, &total, &offset, &length, &data_at);
  if (got <= 0) return got == 0 ? -EINVAL : got;
  Header* h = header(v->base);
  v->position += round_up(kChunkOverhead + length);
  h->tail.store(v->position, std::memory_order_seq_cst);
  if (h->writer_waiting.load(std::memory_order_seq_cst) && h->writer_waiting.exchange(0)) *wake = 1;
  return 0;
}

// The reader is about to sleep on its eventfd: 0 (sleep; the writer will wake it), or 1 if a chunk came meanwhile
// (do not sleep; a broken ring too: the next read says so). Call pw_ring_reader_awake after waking.
int pw_ring_reader_sleep(pw_ring_view* v) {
  Header* h = header(v->base);
  h->reader_sleeping.store(1, std::memory_order_seq_cst);
  if (h->head.load(std::memory_order_seq_cst) != v->position) {
    h->reader_sleeping.store(0, std::memory_order_relaxed);
    return 1;
  }
  return 0;
}

void pw_ring_reader_awake(pw_ring_view* v) { header(v->base)->reader_sleeping.store(0, std::memory_order_relaxed); }

// The writer: 0 and the reader's released position (every byte before it was read), or -EPIPE (broken, or a
// position that does not check).
int pw_ring_released(pw_ring_view* v, uint64_t* released) {
  if (!v || !v->base || !released) return -EINVAL;
  if (header(v->base)->broken.load(std::memory_order_acquire)) return -EPIPE;
  const uint64_t tail = trusted_tail(v);
  if (tail == ~0ULL) return -EPIPE;
  *released = tail;
  return 0;
}

// Either side: whether the ring is broken (a side found it corrupt).
int pw_ring_broken(pw_ring_view* v) { return header(v->base)->broken.load(std::memory_order_acquire) ? 1 : 0; }

// The largest chunk a ring of `capacity` carries (bigger messages go in several).
uint64_t pw_ring_max_chunk(uint64_t capacity) { return pw_ring_bytes(capacity) ? max_chunk(capacity) : 0; }

}  // extern "C"
