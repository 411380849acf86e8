// cohort_torch_shared_storage.h: allreduce on memory the peers map (why and when a tensor moves).

#include "cohort_torch_shared_storage.h"

#include <c10/core/CPUAllocator.h>

#include <cstring>
#include <utility>

#include "comm/settings.h"

namespace cohort_torch {

SharedStorage::SharedStorage(cohort::Communicator& comm) : comm_(comm) {
  enabled_ = cohort::comm::torch_share_storage() && comm.size() > 1 && comm.local_size() == comm.size() &&
             comm.options().transport != "tcp";
}

void SharedStorage::allreduce(const at::Tensor& buf, bool users, cohort::DataType dtype, cohort::ReduceOp op) {
  const size_t count = static_cast<size_t>(buf.numel());
  if (!enabled_) return comm_.allreduce(buf.data_ptr(), buf.data_ptr(), count, dtype, op);
  c10::StorageImpl* storage = buf.storage().unsafeGetStorageImpl();
  const c10::DataPtr& data = storage->data_ptr();
  const bool shared = data.get_deleter() == &release;
  // A whole storage: then its size is count * element size on every rank (both are compared), so
  // the ranks' allocations agree, and each moved tensor sits at the start of its part.
  const bool whole = buf.storage_offset() == 0 && storage->nbytes() == buf.nbytes();
  const bool movable = users && whole && buf.nbytes() >= kMinBytes &&
                       (shared || (data.get_deleter() == c10::GetCPUAllocator()->raw_deleter() &&
                                   storage->nbytes() <= kMaxBytes));
  const auto seen = seen_.find(storage);
  const bool seen_before = seen != seen_.end() && !seen->second.expired();
  std::shared_ptr<void> memory =
      comm_.allreduce_shareable(buf.data_ptr(), count, dtype, op, movable && (shared || seen_before));
  if (memory) return move(storage, std::move(memory));
  if (!movable || shared) return;
  if (seen_.size() >= 256) std::erase_if(seen_, [](const auto& entry) { return entry.second.expired(); });
  if (seen_.size() >= 4096) seen_.clear();  // live tensors forgotten here only move one call later
  seen_.insert_or_assign(storage, buf.storage().getWeakStorageImpl());
}

void SharedStorage::move(c10::StorageImpl* storage, std::shared_ptr<void> memory) {
  std::memcpy(memory.get(), storage->data_ptr().get(), storage->nbytes());
  void* target = memory.get();
  auto* moved = new Moved{std::move(memory), c10::DataPtr()};
  // Views read the storage's pointer on every access, so they follow; the old memory goes into the
  // new owner instead of being freed (see the class comment).
  moved->before = storage->set_data_ptr(c10::DataPtr(target, moved, &release, c10::Device(c10::kCPU)));
}

}  // namespace cohort_torch
