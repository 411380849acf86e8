// Communicator::create: validates, applies the COHORT_* overrides and bootstraps; the defaults of
// allocate_shared, allreduce_shareable and allreduce_update.
#include <fmt/core.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "comm/communicator_impl.h"
#include "comm/settings.h"
#include "common/log.h"

namespace cohort {

std::shared_ptr<Communicator> Communicator::create(std::shared_ptr<Store> store, int rank, int size,
                                                   CommOptions options) {
  if (!store) throw InvalidArgument("Communicator::create: store is null");
  if (size < 1) throw InvalidArgument(fmt::format("Communicator::create: size {} must be at least 1", size));
  if (rank < 0 || rank >= size) {
    throw InvalidArgument(fmt::format("Communicator::create: rank {} out of range [0, {})", rank, size));
  }
  comm::apply_env_overrides(options);
  comm::CommSetup s{store, options.store_prefix, rank, size, options, {}, false, false, {}, nullptr};
  auto impl = std::make_shared<comm::CommunicatorImpl>(std::move(s));
  impl->bootstrap();
  return impl;
}

std::shared_ptr<void> Communicator::allocate_shared(size_t bytes) {
  // Ordinary memory (peers cannot map it; allreduce stages it as usual), cache-line aligned and zeroed.
  const size_t size = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, size);
  if (!p) throw std::bad_alloc();
  std::memset(p, 0, size);
  return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
}

std::shared_ptr<void> Communicator::allreduce_shareable(void* buf, size_t count, DataType dtype, ReduceOp op,
                                                       bool /*want_shared*/) {
  // Any communicator: a plain in-place allreduce, and no memory the peers map.
  allreduce(buf, buf, count, dtype, op);
  return nullptr;
}

void Communicator::allreduce_update(float* grads, float* params, size_t count, ReduceOp op,
                                    const ParameterUpdate& update) {
  // Any communicator: reduce, then every rank applies the same update to the same values.
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg)
    throw InvalidArgument(fmt::format("allreduce_update: op {} (sum or avg only)", reduce_op_name(op)));
  if (!update) throw InvalidArgument("allreduce_update: update is empty");
  allreduce(grads, grads, count, DataType::kFloat32, op);
  if (count > 0) update(0, count, grads, params);
}

}  // namespace cohort
