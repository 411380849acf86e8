#include "collectives/op_kind.h"

namespace cohort::coll {

const char* op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::kNone: return "none";
    case OpKind::kAllreduce: return "allreduce";
    case OpKind::kReduce: return "reduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kAllgather: return "allgather";
    case OpKind::kAllgatherv: return "allgatherv";
    case OpKind::kGather: return "gather";
    case OpKind::kScatter: return "scatter";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kAlltoall: return "alltoall";
    case OpKind::kAlltoallv: return "alltoallv";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kSendRecv: return "send/recv";
    case OpKind::kSplit: return "split";
  }
  return "unknown";
}

}  // namespace cohort::coll
