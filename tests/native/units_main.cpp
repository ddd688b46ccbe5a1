// The native units' program (tests/unit/test_native.py builds it with the library's sources, sanitized).
#include <cstdio>

void shm_ring_units();
void shm_collectives_units();

int main() {
  shm_ring_units();
  shm_collectives_units();
  std::printf("native units: all passed\n");
  return 0;
}
