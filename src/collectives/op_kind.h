#pragma once
// What an operation is: the one enum that algorithm selection (collectives/select.h) and the
// communicator (message signatures, mismatch checks, slow-rank warnings and errors: comm/op.h) share.
// The numbering is carried in every message's signature, so values are only appended.

#include <cstdint>

namespace cohort::coll {

enum class OpKind : uint8_t {
  kNone = 0,
  // The collectives: each has algorithms (select.h).
  kAllreduce,
  kReduce,
  kBroadcast,
  kAllgather,
  kAllgatherv,
  kGather,
  kScatter,
  kReduceScatter,
  kAlltoall,
  kAlltoallv,
  kBarrier,
  // Communicator operations that are not collectives.
  kSendRecv,  // point to point
  kSplit,     // the exchange inside split()
};
inline constexpr OpKind kLastOpKind = OpKind::kSplit;

// "allreduce", "reduce_scatter", "send/recv", ...
const char* op_kind_name(OpKind k);

// Bits of a signature's flags (transport::Signature::flags, shm::CallSignature::flags): variants of an
// operation that peers must agree on as much as on its kind.
inline constexpr uint8_t kOpFlagParameterUpdate = 1;  // an allreduce fused with a parameter update
// An in-place allreduce whose ranks may pass shared memory or not, each on its own
// (Communicator::allreduce_shareable): staged where they differ, instead of a mismatch.
inline constexpr uint8_t kOpFlagShareable = 2;

constexpr bool is_collective(OpKind k) { return k >= OpKind::kAllreduce && k <= OpKind::kBarrier; }
// The collectives with a root rank.
constexpr bool is_rooted(OpKind k) {
  return k == OpKind::kReduce || k == OpKind::kBroadcast || k == OpKind::kGather || k == OpKind::kScatter;
}
inline constexpr int kNumCollectives = int(OpKind::kBarrier) - int(OpKind::kAllreduce) + 1;

}  // namespace cohort::coll
