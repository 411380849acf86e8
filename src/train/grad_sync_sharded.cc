// GradientSync's sharded mode (ZeRO stages 1 and 2): each rank keeps its chunk of every bucket's averaged
// gradients (reduce-scatter) and of the parameters, and gathers the updated parameters after its step
// (docs/training.md, "The sharded optimizer (ZeRO stages 1 and 2)"). The buckets and the replicated mode are
// in grad_sync.cc.
#include "cohort/train/grad_sync.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "cohort/error.h"
#include "common/half_arrays.h"
#include "common/log.h"

namespace cohort::train {

// ---- sharded mode (ZeRO stages 1 and 2) ----

void GradientSync::enable_sharding(int stage) {
  if (stage != 1 && stage != 2)
    throw InvalidArgument(fmt::format("sharded optimizer: stage {} does not exist (1: optimizer state sharded, "
                                      "2: gradients too)",
                                      stage));
  if (stage_ == stage) return;
  if (stage_ > 0)
    throw InvalidArgument(fmt::format("sharded optimizer: the gradients are already sharded at stage {}", stage_));
  if (fused_)
    throw InvalidArgument("DDP: the fused update and the sharded optimizer cannot be combined (the sharded "
                          "optimizer steps each rank's shard, then gathers the parameters)");
  if (in_iteration()) throw InvalidArgument("sharded optimizer: enable it between iterations, not during backward");
  // Every rank the same stage (the bucket memory below is allocated collectively), said on every rank.
  const int size = comm_->size();
  if (size > 1) {
    int64_t mine = stage;
    std::vector<int64_t> all(static_cast<size_t>(size));
    comm_->allgather(&mine, all.data(), 1, DataType::kInt64);
    for (int r = 1; r < size; ++r)
      if (all[size_t(r)] != all[0])
        throw MismatchError(fmt::format("sharded optimizer: the stage differs between ranks: {} on rank 0 but {} on "
                                        "rank {}",
                                        all[0], all[size_t(r)], r));
  }
  stage_ = stage;
  // The layout defines the shards (and the optimizer state that lives beside them): no rebuild.
  rebuilt_ = true;
  build_buckets(layout_order());
}

size_t GradientSync::padded_numel(size_t bucket) const {
  if (bucket >= buckets_.size()) throw InvalidArgument(fmt::format("DDP: no bucket #{}", bucket));
  return buckets_[bucket].padded;
}

float* GradientSync::reduced_chunk(const Bucket& b) const {
  const size_t r = static_cast<size_t>(comm_->rank());
  return stage_ == 1 ? b.data.get() + r * chunk_of(b) : shard_gradients_.get() + b.shard_offset;
}

std::vector<GradientSync::ShardChunk> GradientSync::shard_chunks() const {
  std::vector<ShardChunk> out;
  if (stage_ == 0) return out;
  const size_t r = static_cast<size_t>(comm_->rank());
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const Bucket& b = buckets_[i];
    const size_t chunk = chunk_of(b);
    out.push_back({i, r * chunk, chunk, b.parameters.get() + r * chunk, reduced_chunk(b)});
  }
  return out;
}

void GradientSync::acquire_bucket_memory(Bucket& b) {
  // Of each size, at most two buckets' reduce-scatters in flight hold memory; a third bucket of that
  // size waits for the oldest in flight (all ranks launched it: buckets launch in the same order
  // everywhere), and for the next, until one of its size has given its memory back.
  LentMemory& lent = lent_for(b);
  auto in_flight_of_its_size = [&] {
    return std::count_if(in_flight_.begin(), in_flight_.end(),
                         [&](size_t i) { return is_large(buckets_[i]) == is_large(b); });
  };
  while (lent.pool.empty() && in_flight_of_its_size() >= 2) complete_reduce_scatter(buckets_[in_flight_.front()]);
  PooledBuffers buffers;
  if (!lent.pool.empty()) {
    buffers = std::move(lent.pool.back());
    lent.pool.pop_back();
  } else {
    std::shared_ptr<void> data = options_.memory->allocate_private(lent.floats * sizeof(float));
    buffers.data = std::shared_ptr<float[]>(data, static_cast<float*>(data.get()));
    if (options_.compression != WireCompression::kNone) {
      std::shared_ptr<void> wire = options_.memory->allocate_private(lent.floats * sizeof(uint16_t));
      buffers.wire = std::shared_ptr<uint16_t[]>(wire, static_cast<uint16_t*>(wire.get()));
    }
    ++lent.buffers;
  }
  b.data = std::move(buffers.data);
  b.wire = std::move(buffers.wire);
  // Every slot is written by mark_ready or mark_unused; the padding must read as zeros.
  if (b.padded > b.numel) options_.memory->zero(b.data.get() + b.numel, (b.padded - b.numel) * sizeof(float));
}

void GradientSync::release_bucket_memory(Bucket& b) {
  if (!b.data) return;
  lent_for(b).pool.push_back({std::move(b.data), std::move(b.wire)});
  b.data.reset();
  b.wire.reset();
}

void GradientSync::complete_reduce_scatter(Bucket& b) {
  if (b.reduced) return;
  if (b.work) {
    std::shared_ptr<Work> work = std::move(b.work);
    b.work.reset();
    work->wait();  // a lost peer or a deadline throws here, naming it
  }
  const size_t index = static_cast<size_t>(&b - buckets_.data());
  in_flight_.erase(std::remove(in_flight_.begin(), in_flight_.end(), index), in_flight_.end());
  const size_t chunk = chunk_of(b);
  float* dst = reduced_chunk(b);
  if (comm_->size() > 1 && stage_ == 2 && options_.compression == WireCompression::kNone) {
    // The collective wrote the averaged chunk there itself (launch).
  } else if (comm_->size() == 1 || options_.compression == WireCompression::kNone) {
    // The averaged chunk is the first chunk of the bucket (on one rank, where no collective ran: the
    // bucket itself). For rank r > 0 the two ranges do not overlap.
    if (dst != b.data.get()) options_.memory->copy(dst, b.data.get(), chunk * sizeof(float));
  } else if (options_.compression == WireCompression::kFloat16) {
    half_to_floats(b.wire.get(), dst, chunk);
  } else {
    bf16_to_floats(b.wire.get(), dst, chunk);
  }
  b.reduced = true;
  if (stage_ == 2) release_bucket_memory(b);
}

bool GradientSync::finish_sharded() {
  if (stage_ == 0) throw InvalidArgument("DDP: finish_sharded() needs enable_sharding()");
  if (!begin_finish()) return false;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    for (auto& b : buckets_) complete_reduce_scatter(b);
  } catch (...) {
    wait_launched_quietly();
    reset_iteration();
    throw;
  }
  record_wait(t0, std::chrono::steady_clock::now());
  end_iteration();
  return true;
}

void GradientSync::gather_parameters() {
  if (stage_ == 0) throw InvalidArgument("DDP: gather_parameters() needs enable_sharding()");
  if (comm_->size() == 1) return;
  // In place: rank r's chunk is already at its place in every bucket's parameters. All buckets in
  // flight at once; the first error is rethrown after every other has ended.
  std::vector<std::shared_ptr<Work>> works;
  for (auto& b : buckets_) {
    stats_.bytes_on_wire += static_cast<int64_t>(b.padded * sizeof(float));
    works.push_back(comm_->allgather_async(b.parameters.get(), b.parameters.get(), chunk_of(b), DataType::kFloat32));
  }
  std::exception_ptr first;
  for (auto& w : works) {
    try {
      w->wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

size_t GradientSync::gradient_bytes() const {
  const size_t wire = options_.compression == WireCompression::kNone ? 0 : sizeof(uint16_t);
  if (stage_ == 2) {
    size_t shard = 0;
    for (const auto& b : buckets_) shard += chunk_of(b);
    return (regular_.buffers * regular_.floats + large_.buffers * large_.floats) * (sizeof(float) + wire) +
           shard * sizeof(float);
  }
  size_t total = 0;
  for (const auto& b : buckets_) total += b.padded * (sizeof(float) + wire);
  return comm_->size() == 1 && stage_ == 0 ? 0 : total;
}

}  // namespace cohort::train
