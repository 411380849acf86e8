#pragma once
// Which server holds a row, and the hashes behind it (docs/parameter-server.md states them so
// that other tools can place ids the same way).

#include <cstdint>

namespace cohort::ps {

// splitmix64's finalizer: every bit of the id moves every bit of the result.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// Sparse ids: server mix64(id) mod servers (shard_of_id in include/cohort/ps.h).
// A server's own index mixes the id with another constant, so that the ids one server holds (all
// equal mod servers under mix64) still spread over all of its buckets.
inline uint64_t index_hash(uint64_t id) { return mix64(id ^ 0x2545f4914f6cdd1dull); }

}  // namespace cohort::ps
