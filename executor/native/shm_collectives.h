// The request of one collective among the executors of one host (executor/native/shm_collectives.cpp): shared by
// the library's callers in C++ (the XLA custom calls, the sanitizer units); executor/shm_group.py mirrors it.
#pragma once

#include <cstdint>

extern "C" {

struct pw_coll_op {
  int32_t kind;     // 1 all_reduce, 2 all_gather, 3 reduce_scatter, 4 broadcast, 5 all_to_all
  int32_t dtype;    // 0 f32, 1 f64, 2 f16, 3 bf16, 4 i8, 5 u8, 6 i16, 7 i32, 8 i64, 9 bool
  int32_t reduce;   // 0 sum, 1 max, 2 min, 3 product (all_reduce, reduce_scatter)
  int32_t root;     // broadcast's source member
  uint64_t count;   // elements per member: all_reduce in and out; all_gather in (out: count * size);
                    // reduce_scatter out (in: count * size); broadcast in and out; all_to_all count * size each
  uint64_t tag;     // the caller's: an op whose tag differs on some member is refused there
  const void* input;
  void* output;
  double timeout_s;
};

uint64_t pw_coll_bytes(int32_t size, uint64_t slot_bytes);
int pw_coll_init(void* base, uint64_t mapped, int32_t size, uint64_t slot_bytes, uint64_t group_tag);
void* pw_coll_attach(void* base, uint64_t mapped, int32_t rank, int32_t size, uint64_t slot_bytes, uint64_t group_tag);
void pw_coll_detach(void* group);
void pw_coll_abandon(void* group);
uint64_t pw_coll_refused(void* group);
int pw_coll_run(void* group, const pw_coll_op* request, char* why, uint64_t why_bytes);
typedef int (*pw_coll_run_fn)(void* group, const pw_coll_op* request, char* why, uint64_t why_bytes);
}
