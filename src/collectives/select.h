#pragma once
// Algorithm selection: the one place that maps (operation, world size, bytes) to an algorithm.
// Thresholds and the reasoning behind them are in docs/algorithms.md; COHORT_ALGO_<OP> overrides.

#include <cstddef>
#include <string_view>

#include "collectives/collectives.h"
#include "collectives/op_kind.h"

namespace cohort::coll {


// Whether `algo` implements `op` (kAuto always does; an operation that is not a collective has no
// algorithms).
bool algorithm_supported(OpKind op, Algorithm algo);

// The algorithm for `op` on `world` ranks moving a message of `bytes` bytes:
//   allreduce/reduce/broadcast: the whole vector; allgather(v)/gather: the gathered output;
//   scatter: the root's input; reduce_scatter: the input (world * recv_count elements);
//   alltoall(v): one rank's send buffer.
// `requested` other than kAuto wins (InvalidArgument if `op` has no such algorithm); otherwise
// COHORT_ALGO_<OP> (ConfigError if bad); otherwise the size rules.
Algorithm select_algorithm(OpKind op, int world, size_t bytes, Algorithm requested = Algorithm::kAuto);

// The rules alone, without the environment override (for tests and the docs' table).
Algorithm default_algorithm(OpKind op, int world, size_t bytes);

// Pipelining parameters of the ring and tree algorithms (COHORT_COLL_CHUNK, COHORT_COLL_SLOTS),
// read once.
size_t pipeline_chunk_bytes();
int pipeline_slots();

// Thresholds (bytes), documented in docs/algorithms.md.
inline constexpr size_t kAllreduceRecursiveDoublingMax = 32 * 1024;   // <= : rd
inline constexpr size_t kAllreduceHalvingDoublingMax = 1024 * 1024;   // <= : rhd (p > 2), else ring
inline constexpr size_t kBroadcastBinomialMax = 512 * 1024;           // <= or p <= 3: binomial
inline constexpr size_t kReduceBinomialMax = 512 * 1024;              // <= or p <= 2: binomial
inline constexpr size_t kAllgatherBruckMax = 64 * 1024;               // <= (total output): bruck

}  // namespace cohort::coll
