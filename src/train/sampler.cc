#include "cohort/train/sampler.h"

#include <fmt/format.h>

#include <numeric>
#include <random>

#include "cohort/error.h"

namespace cohort::train {

std::vector<int64_t> default_permutation(int64_t n, uint64_t seed) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), int64_t{0});
  std::mt19937_64 gen(seed);
  for (int64_t i = n - 1; i > 0; --i) {
    std::uniform_int_distribution<int64_t> pick(0, i);
    std::swap(p[static_cast<size_t>(i)], p[static_cast<size_t>(pick(gen))]);
  }
  return p;
}

DistributedSampler::DistributedSampler(int64_t dataset_size, int num_replicas, int rank, bool shuffle,
                                       uint64_t seed, bool drop_last, PermutationFn permutation)
    : dataset_size_(dataset_size),
      num_replicas_(num_replicas),
      rank_(rank),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last),
      permutation_(std::move(permutation)) {
  if (num_replicas <= 0) throw InvalidArgument(fmt::format("DistributedSampler: num_replicas must be > 0, got {}", num_replicas));
  if (rank < 0 || rank >= num_replicas)
    throw InvalidArgument(fmt::format("DistributedSampler: rank {} is outside [0, {})", rank, num_replicas));
  if (dataset_size < 0) throw InvalidArgument("DistributedSampler: negative dataset size");
  if (!permutation_) permutation_ = default_permutation;
  // Same arithmetic as torch: with drop_last and an uneven split, drop the tail.
  if (drop_last_ && dataset_size_ % num_replicas_ != 0)
    num_samples_ = (dataset_size_ - num_replicas_ + num_replicas_ - 1) / num_replicas_;  // ceil((n - R) / R)
  else
    num_samples_ = (dataset_size_ + num_replicas_ - 1) / num_replicas_;
  if (num_samples_ < 0) num_samples_ = 0;
}

namespace {

// Samples per rank at `world` ranks, as torch computes it.
int64_t per_rank(int64_t n, int world, bool drop_last) {
  int64_t k = drop_last && n % world != 0 ? (n - world + world - 1) / world : (n + world - 1) / world;
  return k < 0 ? 0 : k;
}

}  // namespace

int64_t DistributedSampler::total_size_for(int world) const {
  if (world <= 0) throw InvalidArgument(fmt::format("DistributedSampler: world size must be > 0, got {}", world));
  return per_rank(dataset_size_, world, drop_last_) * world;
}

std::vector<int64_t> DistributedSampler::indices_from(int64_t cursor, int epoch_world) const {
  const int64_t total = total_size_for(epoch_world);
  if (cursor < 0 || cursor > total)
    throw InvalidArgument(fmt::format("DistributedSampler: cursor {} is outside the epoch's {} positions", cursor, total));
  // The epoch's order as the world that began it saw it: its rank r's list is positions r, r + world, ...
  DistributedSampler began(dataset_size_, epoch_world, 0, shuffle_, seed_, drop_last_, permutation_);
  began.set_epoch(epoch_);
  std::vector<int64_t> order = began.padded_order();
  std::vector<int64_t> mine;
  for (int64_t i = cursor + rank_; i < total; i += num_replicas_) mine.push_back(order[static_cast<size_t>(i)]);
  return mine;
}

int64_t DistributedSampler::longest_share(int64_t cursor, int epoch_world) const {
  const int64_t rest = total_size_for(epoch_world) - cursor;
  return rest <= 0 ? 0 : (rest + num_replicas_ - 1) / num_replicas_;
}

std::vector<int64_t> DistributedSampler::indices() const {
  const auto all = padded_order();
  const size_t total = all.size();
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(num_samples_));
  for (size_t i = static_cast<size_t>(rank_); i < total; i += static_cast<size_t>(num_replicas_)) mine.push_back(all[i]);
  return mine;
}

std::vector<int64_t> DistributedSampler::padded_order() const {
  std::vector<int64_t> all;
  if (shuffle_) {
    all = permutation_(dataset_size_, seed_ + static_cast<uint64_t>(epoch_));
    if (static_cast<int64_t>(all.size()) != dataset_size_)
      throw InvalidArgument(fmt::format("DistributedSampler: permutation returned {} indices for {} samples", all.size(), dataset_size_));
  } else {
    all.resize(static_cast<size_t>(dataset_size_));
    std::iota(all.begin(), all.end(), int64_t{0});
  }
  const size_t total = static_cast<size_t>(total_size());
  if (!drop_last_) {
    // Pad by wrapping around (repeating the list as often as needed), as torch does.
    const size_t n = all.size();
    for (size_t i = 0; all.size() < total && n > 0; ++i) all.push_back(all[i % n]);
  } else {
    all.resize(total);
  }
  return all;
}

}  // namespace cohort::train
