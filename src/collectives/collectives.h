#pragma once
// Collective algorithms over coll::Context (point-to-point isend/irecv with slots and waits).
//
// The communicator validates arguments (null buffers, root range, dtype/op pairs) and calls these
// entry points on every rank in the same order. Semantics are those of include/cohort/communicator.h:
//   * `send == recv` means in place (MPI_IN_PLACE):
//       allreduce / reduce (at the root): the input is read from recv;
//       allgather: rank r's contribution is already at recv + r*count;
//       allgatherv: rank r's contribution is already at its place in recv;
//       gather (at the root): the root's contribution is already at recv + root*count;
//       scatter (at the root): the root's block stays where it is in send;
//       reduce_scatter: recv holds the size()*recv_count input; the result goes to its first
//         recv_count elements (MPI_Reduce_scatter_block with MPI_IN_PLACE);
//       alltoall / alltoallv: recv holds the input and is overwritten by the output.
//   * kAvg sums and divides by size() (float types only; the communicator rejects it otherwise).
//   * allreduce results are bitwise identical on every rank: each element is combined on one rank
//     in a fixed order (ring, halving-doubling) or with the lower group's operand first on every
//     rank (recursive doubling), then copied.
// Algorithm::kAuto picks by size and world size (select.h); COHORT_ALGO_<OP> overrides the choice.
// Every call leaves the context's scratch buffers in an undefined state and allocates nothing once
// scratch has grown to the largest size used.

#include <cstddef>
#include <string_view>
#include <optional>

#include "cohort/types.h"
#include "collectives/context.h"

namespace cohort::coll {

enum class Algorithm : uint8_t {
  kAuto = 0,
  kRing,                // pipelined ring (reduce-scatter then allgather for allreduce)
  kHalvingDoubling,     // Rabenseifner: recursive halving reduce-scatter + doubling allgather
  kRecursiveDoubling,   // full-vector exchange with partner 2^k (small messages)
  kBinomial,            // binomial tree (broadcast, reduce)
  kScatterAllgather,    // broadcast: scatter from the root, then ring allgather (large)
  kBruck,               // allgather in ceil(log2 p) steps (small)
  kPairwise,            // alltoall: p-1 exchanges with partner (r+k) / (r-k)
  kLinear,              // root talks to every rank directly (gather, scatter)
  kDissemination,       // barrier: ceil(log2 p) rounds to (r+2^k)
};

// Short names used by COHORT_ALGO_<OP>: auto ring rhd rd binomial scatter_allgather bruck pairwise
// linear dissemination.
std::string_view algorithm_name(Algorithm a);
std::optional<Algorithm> parse_algorithm(std::string_view name);

void allreduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
               Algorithm algo = Algorithm::kAuto);
// Only the root's recv is written (recv may be null elsewhere).
void reduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, ReduceOp op, int root,
            Algorithm algo = Algorithm::kAuto);
void broadcast(Context& ctx, void* buf, size_t count, DataType dtype, int root, Algorithm algo = Algorithm::kAuto);
void allgather(Context& ctx, const void* send, void* recv, size_t count, DataType dtype,
               Algorithm algo = Algorithm::kAuto);
// recv_counts has size() entries; contributions are placed back to back in rank order.
void allgatherv(Context& ctx, const void* send, size_t send_count, void* recv, const size_t* recv_counts,
                DataType dtype, Algorithm algo = Algorithm::kAuto);
void gather(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, int root,
            Algorithm algo = Algorithm::kAuto);
void scatter(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, int root,
             Algorithm algo = Algorithm::kAuto);
void reduce_scatter(Context& ctx, const void* send, void* recv, size_t recv_count, DataType dtype, ReduceOp op,
                    Algorithm algo = Algorithm::kAuto);
void alltoall(Context& ctx, const void* send, void* recv, size_t count, DataType dtype,
              Algorithm algo = Algorithm::kAuto);
// Counts and displacements in elements, size() entries each.
void alltoallv(Context& ctx, const void* send, const size_t* send_counts, const size_t* send_displs, void* recv,
               const size_t* recv_counts, const size_t* recv_displs, DataType dtype,
               Algorithm algo = Algorithm::kAuto);
void barrier(Context& ctx, Algorithm algo = Algorithm::kAuto);

}  // namespace cohort::coll
