#pragma once
// What a communicator operation is, as carried in every message's signature (mismatch checks) and
// printed in slow-rank warnings and errors.

#include <cstdint>
#include <string>

#include "cohort/types.h"
#include "collectives/op_kind.h"
#include "common/strings.h"
#include "trace/describe.h"
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
  int peer = -1;       // send/recv: the other rank (not part of the signature: the two sides differ)
  int64_t queued_ns = 0;  // *_async: when it was queued (CLOCK_MONOTONIC), for the flight recorder
  uint8_t flags = 0;      // coll::kOpFlag*

  transport::Signature signature() const {
    transport::Signature s;
    s.op = uint8_t(kind);
    s.dtype = uint8_t(dtype);
    s.redop = uint8_t(redop);
    s.root = uint32_t(root);
    s.count = count;
    s.flags = flags;
    return s;
  }
};

// How operations are described in messages: one wording for the communicator's errors and the flight
// recorder's reports (trace/describe.h).
using trace::describe_signature;
using str::format_bytes;

}  // namespace cohort::comm
