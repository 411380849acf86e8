#pragma once
// What a communicator operation is, as carried in every message's signature (mismatch checks) and
// printed in slow-rank warnings and errors.

#include <cstdint>
#include <string>

#include "cohort/types.h"
#include "collectives/op_kind.h"
#include "transport/transport.h"

namespace cohort::comm {

// The operation kinds are the collectives layer's (collectives/op_kind.h): one enum for algorithm
// selection and for the communicator.
using coll::OpKind;
using coll::op_kind_name;

// One operation as its caller described it.
struct OpDesc {
  OpKind kind = OpKind::kNone;
  DataType dtype = DataType::kUInt8;
  ReduceOp redop = ReduceOp::kSum;
  int root = 0;
  uint64_t count = 0;  // elements (0 where ranks may legitimately differ, e.g. alltoallv)
  uint64_t bytes = 0;  // this rank's payload, for messages

  transport::Signature signature() const {
    transport::Signature s;
    s.op = uint8_t(kind);
    s.dtype = uint8_t(dtype);
    s.redop = uint8_t(redop);
    s.root = uint32_t(root);
    s.count = count;
    return s;
  }
};

// "allreduce(count=1024, float, sum)" from a signature.
std::string describe_signature(const transport::Signature& s);
// "1.5 KiB"
std::string format_bytes(uint64_t bytes);

}  // namespace cohort::comm
