// The native units' one check: on failure it prints where, what was expected and what came, and exits 1.
#pragma once

#include <cstdio>
#include <cstdlib>

#define EXPECT(cond, ...)                                                   \
  do {                                                                      \
    if (!(cond)) {                                                          \
      std::fprintf(stderr, "%s:%d: expected %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                    \
      std::fprintf(stderr, "\n");                                           \
      std::exit(1);                                                         \
    }                                                                       \
  } while (0)
