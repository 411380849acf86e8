#pragma once
// DistributedSampler with torch.utils.data.DistributedSampler's semantics:
//  * shuffle: permutation of [0, n) from a generator seeded with seed + epoch (set_epoch), else 0..n-1;
//  * drop_last: cut the tail so every rank gets floor(n / replicas) samples; otherwise pad by
//    wrapping around to ceil(n / replicas) samples per rank;
//  * rank r takes indices r, r + replicas, r + 2 * replicas, ...
// The permutation function is injectable: the libtorch integration passes torch::randperm with a
// CPU generator seeded like torch.Generator().manual_seed(seed + epoch), which gives exactly
// torch's indices; the default one here (std::mt19937_64 + Fisher-Yates) is deterministic but not
// torch's sequence.

#include <cstdint>
#include <functional>
#include <vector>

namespace cohort::train {

using PermutationFn = std::function<std::vector<int64_t>(int64_t n, uint64_t seed)>;

std::vector<int64_t> default_permutation(int64_t n, uint64_t seed);

class DistributedSampler {
 public:
  DistributedSampler(int64_t dataset_size, int num_replicas, int rank, bool shuffle = true,
                     uint64_t seed = 0, bool drop_last = false, PermutationFn permutation = default_permutation);

  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }
  // Number of samples this rank gets per epoch.
  int64_t num_samples() const { return num_samples_; }
  int64_t total_size() const { return num_samples_ * num_replicas_; }
  // This rank's indices for the current epoch.
  std::vector<int64_t> indices() const;

  // Resuming an epoch, possibly at another world size (docs/training.md, "Resuming"). An epoch's
  // order is the one it began with: the permutation of (seed + epoch) padded (or cut, drop_last) for
  // the world size `epoch_world` that began it; rank r of that world takes positions r, r + world,
  // ...; so after S steps of B samples per rank the first S * B * world positions are consumed, a
  // prefix. `cursor` is that count. The rest, positions [cursor, total), is split round-robin over
  // this sampler's replicas: rank r takes rest[r], rest[r + replicas], ... No sample of the order
  // is repeated or skipped; shares differ by at most one. With the world unchanged, each rank gets
  // exactly the indices an uninterrupted epoch would have given it.
  std::vector<int64_t> indices_from(int64_t cursor, int epoch_world) const;
  // The largest share of indices_from(cursor, epoch_world) (rank 0's): the steps every rank runs.
  int64_t longest_share(int64_t cursor, int epoch_world) const;
  // Positions in an epoch's order for `world` ranks (num_samples * world at that world size).
  int64_t total_size_for(int world) const;

 private:
  // The epoch's permutation padded (or cut) to total_size(): rank r takes positions r, r + replicas...
  std::vector<int64_t> padded_order() const;

  int64_t dataset_size_;
  int num_replicas_;
  int rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  PermutationFn permutation_;
  int64_t epoch_ = 0;
  int64_t num_samples_ = 0;
};

}  // namespace cohort::train
