#pragma once
// coll::Context: everything a collective algorithm may do, and nothing more.
//
// Algorithms (src/collectives/) are written against this small interface of non-blocking,
// tag-addressed point-to-point operations. The communicator (src/comm/) implements it on top of the
// transports (TCP, shared memory), scoping every message to the current collective (sequence
// number, op, size, dtype) so that concurrent communicators never mix and mismatched calls are
// detected. Tests implement it with threads and mailboxes.
//
// Ordering: between one pair of ranks, messages with the same `slot` are matched in posting order.
// Different slots are independent streams (an algorithm uses them e.g. for pipelined chunks or
// for several rings at once). A receive must name the exact size the sender sends.

#include <cstddef>
#include <cstdint>
#include <span>

#include "cohort/types.h"

namespace cohort::coll {

using RequestId = uint64_t;

class Context {
 public:
  virtual ~Context() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Posts a send of `bytes` bytes at `data` to `peer`. The memory must stay valid and unchanged
  // until the request completes (wait returns).
  virtual RequestId isend(int peer, const void* data, size_t bytes, uint32_t slot = 0) = 0;
  // Posts a receive of exactly `bytes` bytes from `peer` into `data`.
  virtual RequestId irecv(int peer, void* data, size_t bytes, uint32_t slot = 0) = 0;
  // Waits until the request completes. Throws the communicator's error (peer lost, timeout naming
  // the ranks that did not progress, mismatch) instead of returning.
  virtual void wait(RequestId id) = 0;
  virtual void wait_all(std::span<const RequestId> ids) {
    for (RequestId id : ids) wait(id);
  }
  // Scratch memory owned by the context, reused across calls (contents undefined on entry).
  // `index` selects one of several independent scratch buffers.
  virtual void* scratch(size_t bytes, int index = 0) = 0;
};

}  // namespace cohort::coll
