#include "trace/describe.h"

#include <fmt/core.h>

#include "cohort/types.h"
#include "collectives/op_kind.h"

namespace cohort::trace {

std::string describe_signature(const transport::Signature& s) {
  using coll::OpKind;
  auto kind = OpKind(s.op);
  std::string name = coll::op_kind_name(kind);
  if (s.op > uint8_t(coll::kLastOpKind)) name = fmt::format("op {}", s.op);
  if (s.flags & coll::kOpFlagParameterUpdate) name += "+update";
  auto dtype = s.dtype < kNumDataTypes ? std::string(dtype_name(DataType(s.dtype))) : fmt::format("dtype {}", s.dtype);
  auto redop = s.redop < kNumReduceOps ? std::string(reduce_op_name(ReduceOp(s.redop))) : std::string("?");
  switch (kind) {
    case OpKind::kBarrier: return "barrier";
    case OpKind::kAllreduce:
    case OpKind::kReduceScatter: return fmt::format("{}(count={}, {}, {})", name, s.count, dtype, redop);
    case OpKind::kReduce: return fmt::format("{}(count={}, {}, {}, root={})", name, s.count, dtype, redop, s.root);
    case OpKind::kBroadcast:
    case OpKind::kGather:
    case OpKind::kScatter: return fmt::format("{}(count={}, {}, root={})", name, s.count, dtype, s.root);
    default: return fmt::format("{}(count={}, {})", name, s.count, dtype);
  }
}

}  // namespace cohort::trace
