// SharedStorage: allreduce on memory the peers map.
//
// cohort's intra-host allreduce stages a buffer through shared slots because a peer cannot read the
// caller's memory; memory from Communicator::allocate_shared it can read, so an in-place allreduce
// there moves about half the bytes (docs/algorithms-shm.md). DDP allreduces the same bucket tensors
// every step, and an unmodified script cannot allocate them itself, so the backend moves a tensor's
// storage there once it has seen that storage in an earlier large allreduce: the contents are copied
// and the storage's data pointer is swapped (every view of it follows, as with share_memory_()).
// Only storages from torch's CPU allocator move (never memory torch borrowed, e.g. from numpy), only
// when the tensor is all of its storage, and only up to kMaxBytes: the old memory is kept until the
// storage dies, because a raw pointer taken before the move (t.numpy(), a C++ data_ptr()) must stay
// valid (it just no longer sees new results).
//
// Every rank must take the same path (the in-place one reads and writes the peers' memory) and move
// together (allocation is collective), yet each rank knows only its own tensor. No collective of its
// own decides it: every allreduce goes through Communicator::allreduce_shareable, whose ranks see in
// the call's own signature whether all of them passed the same range of one shared allocation (then
// in place; otherwise staged) and whether all of them asked to move (then the call ends with the
// allocation, and every rank moves its storage there). A rank asks when its tensor is a whole storage
// it has seen before, or one that already moved (so that ranks whose moved storages no longer line up
// move again, together). So each allreduce of the user is one operation of the communicator: its
// number in errors, `cohort trace` and `--stats` is the user's count. COHORT_TORCH_SHARE_STORAGE=0
// turns it off (plain allreduces, nothing moves).
#pragma once

#include <c10/core/StorageImpl.h>

#include <cstddef>
#include <map>
#include <memory>

#include "cohort/communicator.h"
#include "cohort/types.h"
#include "cohort_torch_common.h"

namespace cohort_torch {

class SharedStorage {
 public:
  static constexpr size_t kMinBytes = size_t{256} << 10;
  // DDP's buckets are 25 MiB (bucket_cap_mb); larger tensors stage rather than keep a second copy.
  static constexpr size_t kMaxBytes = size_t{64} << 20;

  explicit SharedStorage(cohort::Communicator& comm);

  // The allreduce of `buf`, a contiguous tensor, in place: the user's own (`users`), or a staging copy,
  // which never moves. Runs on the worker thread. Every dense allreduce of the group comes here,
  // whatever its size: the ranks' calls must all be shareable ones, or all plain ones.
  void allreduce(const at::Tensor& buf, bool users, cohort::DataType dtype, cohort::ReduceOp op);

 private:
  // What a moved storage's DataPtr owns: the shared memory, and the memory it had before.
  struct Moved {
    std::shared_ptr<void> shared;
    c10::DataPtr before;
  };
  static void release(void* context) { delete static_cast<Moved*>(context); }

  // Moves `storage` into `memory` (its size, from allreduce_shareable), after the call that gave it.
  void move(c10::StorageImpl* storage, std::shared_ptr<void> memory);

  cohort::Communicator& comm_;
  bool enabled_ = false;
  // Storages seen in a large allreduce. The weak reference keeps a dead StorageImpl's shell allocated,
  // so a new storage can never take its address and be mistaken for one seen before.
  std::map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>> seen_;
};

}  // namespace cohort_torch
