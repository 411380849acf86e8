#include "comm/op.h"

#include <fmt/core.h>

namespace cohort::comm {

std::string describe_signature(const transport::Signature& s) {
  auto kind = OpKind(s.op);
  std::string name = op_kind_name(kind);
  if (s.op > uint8_t(coll::kLastOpKind)) name = fmt::format("op {}", s.op);
  auto dtype = s.dtype < kNumDataTypes ? std::string(dtype_name(DataType(s.dtype))) : fmt::format("dtype {}", s.dtype);
  switch (kind) {
    case OpKind::kBarrier: return "barrier";
    case OpKind::kAllreduce:
    case OpKind::kReduceScatter:
      return fmt::format("{}(count={}, {}, {})", name, s.count, dtype,
                         s.redop < kNumReduceOps ? std::string(reduce_op_name(ReduceOp(s.redop))) : "?");
    case OpKind::kReduce:
      return fmt::format("{}(count={}, {}, {}, root={})", name, s.count, dtype,
                         s.redop < kNumReduceOps ? std::string(reduce_op_name(ReduceOp(s.redop))) : "?", s.root);
    case OpKind::kBroadcast:
    case OpKind::kGather:
    case OpKind::kScatter: return fmt::format("{}(count={}, {}, root={})", name, s.count, dtype, s.root);
    default: return fmt::format("{}(count={}, {})", name, s.count, dtype);
  }
}

std::string format_bytes(uint64_t b) {
  if (b >= (uint64_t(1) << 30)) return fmt::format("{:.1f} GiB", double(b) / double(1 << 30));
  if (b >= (uint64_t(1) << 20)) return fmt::format("{:.1f} MiB", double(b) / double(1 << 20));
  if (b >= 1024) return fmt::format("{:.1f} KiB", double(b) / 1024.0);
  return fmt::format("{} B", b);
}

}  // namespace cohort::comm
