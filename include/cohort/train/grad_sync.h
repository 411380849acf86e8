#pragma once
// GradientSync: the framework-agnostic core of data-parallel training (what PyTorch's DDP Reducer
// does), over the public cohort::Communicator interface.
//
// * Parameters are registered in model order and bucketed in REVERSE order (backward produces the
//   last layer's gradients first). The first bucket holds up to first_bucket_cap_bytes (1 MiB), the
//   others up to bucket_cap_bytes (25 MiB). After the first synchronised iteration the buckets are
//   rebuilt in the order the gradients actually became ready (rank 0's order, broadcast, so that
//   every rank has the same layout and issues the same allreduces in the same order).
// * mark_ready(i, grad) copies a finished gradient into its bucket; when a bucket's last gradient
//   arrives its allreduce starts at once (allreduce_async), so communication overlaps the rest of
//   backward. Buckets are launched in bucket order (a bucket that completes early waits for the
//   ones before it), because collectives must be issued in the same order on every rank.
// * finish() waits for every bucket and hands back the averaged gradients.
// * Optional compression: the bucket travels as float16 or bfloat16, the model stays float32.
// * set_sync_enabled(false) (NoSyncGuard) skips communication: the framework accumulates locally.
// * Fused update (enable_fused_update): the parameters live in buckets too, and instead of averaging
//   the gradients during backward, finish_update() reduces the buckets and applies the optimizer's
//   step in one pass (Communicator::allreduce_update; the buckets lie back to back in one gradient and
//   one parameter buffer, so one call covers them all): on one host each rank reduces and updates a
//   slice and writes it into every rank's parameters, so neither the averaged gradients nor a
//   separate optimizer pass over them exist (docs/training.md, "The fused SGD step").
// * Sharded mode (enable_sharding, ZeRO stages 1 and 2): each bucket is split into one chunk per
//   rank and reduce-scattered instead of allreduced; rank r averages and owns chunk r of every bucket,
//   steps the optimizer on it alone, and gather_parameters() sends the updated chunks to every rank
//   (docs/training.md, "The sharded optimizer").
// * A parameter that never got a gradient is an error naming it, unless find_unused_parameters is
//   on (then it contributes zeros, like torch's find_unused_parameters=True).
// * Construction is collective: every rank checks that its parameter names and shapes equal rank 0's.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cohort/communicator.h"

namespace cohort::trace {
class Recorder;  // the process's flight recorder and timeline (src/trace/recorder.h)
}

namespace cohort::train {

struct ParameterSpec {
  std::string name;
  std::vector<int64_t> shape;
  size_t numel() const;
  std::string describe() const;  // "fc1.weight [1024, 784]"
};

enum class WireCompression { kNone, kFloat16, kBFloat16 };
// "none", "fp16"/"float16"/"half", "bf16"/"bfloat16".
std::optional<WireCompression> parse_compression(std::string_view s);
std::string_view compression_name(WireCompression c);

// Where the buckets live and how gradients move in and out of them. The default (no BucketMemory)
// keeps them in host memory from Communicator::allocate_shared, which same-host peers map. A model on
// a GPU uses gpu_bucket_memory(): buckets in GPU memory, reduced by the GPU communicator (NCCL).
class BucketMemory {
 public:
  virtual ~BucketMemory() = default;
  // `bytes` of zeroed memory (every rank calls it in the same order, like allocate_shared).
  virtual std::shared_ptr<void> allocate(Communicator& comm, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void zero(void* dst, size_t bytes) = 0;
  // Whether the CPU may read and write bucket memory (wire compression converts on the CPU).
  virtual bool host_accessible() const = 0;
  // `bytes` of this rank's own memory of the same kind (not collective, not shared with the peers):
  // the sharded mode's stage 2 takes a bucket's gradient memory while it fills and gives it back.
  // The default allocates host memory.
  virtual std::shared_ptr<void> allocate_private(size_t bytes);
};
// Buckets in the memory of GPU `device` (cudaMalloc; copies with cudaMemcpy, which is ordered after the
// work queued on the default stream). The communicator must take GPU buffers (gpu::make_device_communicator).
std::shared_ptr<BucketMemory> gpu_bucket_memory(int device);

struct GradSyncOptions {
  size_t bucket_cap_bytes = size_t{25} << 20;
  size_t first_bucket_cap_bytes = size_t{1} << 20;
  WireCompression compression = WireCompression::kNone;
  bool find_unused_parameters = false;
  // Rebuild buckets in gradient-ready order after the first synchronised iteration.
  bool rebuild_buckets = true;
  // Null: host buckets from Communicator::allocate_shared.
  std::shared_ptr<BucketMemory> memory;
};

struct GradSyncStats {
  int64_t synced_iterations = 0;
  // Time finish() spent blocked on allreduces that had not completed yet (communication that
  // backward did not hide).
  double wait_seconds = 0;
  int64_t bytes_on_wire = 0;  // per rank, summed over iterations
  int64_t allreduces = 0;
  // GPU buckets with timing on (a timeline, COHORT_GPU_TIMING, gpu::enable_timing): on the GPU's own
  // clock, the share of each bucket's allreduce that ran before backward ended (the end of backward
  // being when finish() was called, in the caller's stream), summed over the buckets timed. finish()
  // waits in stream order there, so wait_seconds says nothing about overlap on a GPU; this does.
  int64_t gpu_timed_buckets = 0;
  double gpu_overlap_sum = 0;
  double gpu_allreduce_ms = 0;  // their time on the GPU, summed
  double gpu_overlap_share() const { return gpu_timed_buckets ? gpu_overlap_sum / gpu_timed_buckets : 0; }
};

class GradientSync {
 public:
  // Collective over `comm`. Throws MismatchError (on every rank) naming the first parameter whose
  // name or shape differs from rank 0's.
  GradientSync(std::shared_ptr<Communicator> comm, std::vector<ParameterSpec> params,
               GradSyncOptions options = {});
  ~GradientSync();
  GradientSync(const GradientSync&) = delete;
  GradientSync& operator=(const GradientSync&) = delete;

  // The gradient of parameter `index` is final for this iteration (grad points to numel floats, in the
  // buckets' kind of memory: host, or the GPU for gpu_bucket_memory).
  // Starts the allreduce of every bucket that is now complete. No-op while sync is disabled.
  void mark_ready(size_t index, const float* grad);
  // True when every parameter of this iteration has been marked ready (or is known unused).
  bool all_ready() const { return ready_count_ == params_.size(); }
  // Parameters known in advance not to take part in this iteration (find_unused_parameters only):
  // they contribute zeros right away, so their buckets are not held back.
  void mark_unused(size_t index);
  // True after a mark_ready/mark_unused of this iteration and before finish().
  bool in_iteration() const { return ready_count_ > 0; }

  // Waits for all buckets and calls write_back(index, averaged) for every parameter (not on a
  // 1-rank communicator: the framework's gradients are already the average). Throws
  // InvalidArgument naming the first parameter that got no gradient (without find_unused).
  // No-op (returns false) while sync is disabled or when nothing was marked in this iteration.
  bool finish(const std::function<void(size_t index, const float* averaged)>& write_back);

  // Fused update (collective, after construction, every rank alike): the parameters get bucket memory
  // of their own (parameter_slot) and buckets are no longer reduced as they fill; finish_update()
  // reduces them and applies `update` instead. Needs host buckets and no wire compression. On 1 rank
  // it does nothing (fused_update() stays false): the framework's own optimizer steps there.
  void enable_fused_update();
  bool fused_update() const { return fused_; }
  // Where parameter `index`'s values must live for finish_update (numel floats; null on 1 rank, or
  // without the fused update). The framework copies its values there and makes the parameter a view
  // of it; after a bucket rebuild the slot moves (compare pointers, copy again).
  std::shared_ptr<float> parameter_slot(size_t index) const;
  // Like finish() (false when nothing was marked, the same error for a parameter without gradient),
  // but reduces every bucket fused with `update` (offsets count from the first bucket's start) into
  // the parameter slots, with one blocking allreduce_update over all buckets (they lie back to back:
  // two rounds of synchronisation per step, not two per bucket); the gradients are left as this rank's own.
  // Only with fused_update().
  bool finish_update(const Communicator::ParameterUpdate& update);

  // Where parameter `index`'s gradient sits in its bucket (numel floats; null on a 1-rank
  // communicator, which has no buckets to fill). A framework that makes the parameter's gradient a
  // view of this memory (PyTorch's gradient_as_bucket_view) saves both copies: mark_ready() and
  // finish() see that the pointers are equal and copy nothing. The shared_ptr keeps the memory valid
  // after a bucket rebuild moved the parameter elsewhere (the next mark_ready copies once, then the
  // framework can rebind to the new slot): hold it while using the memory, since the rebuild happens
  // inside the first mark_ready after it was decided (rebuild_pending).
  std::shared_ptr<float> gradient_slot(size_t index) const;

  void set_sync_enabled(bool enabled) { sync_enabled_ = enabled; }
  bool sync_enabled() const { return sync_enabled_; }

  // ---- sharded mode (ZeRO stages 1 and 2) ----
  // Collective, between iterations, every rank alike (a different stage on some rank is a
  // MismatchError naming both). Each bucket is padded with zeros to a multiple of size() elements
  // and split into size() equal chunks; rank r owns chunk r of every bucket. From then on:
  //  * a complete bucket is reduce-scattered (averaged) instead of allreduced, overlapping backward
  //    as before; finish_sharded() waits for them and leaves this rank's averaged chunks where
  //    shard_chunks() says;
  //  * the parameters live in bucket memory (parameter_slot, as with the fused update), and
  //    gather_parameters() sends every rank's chunks of them to every rank (in-place allgathers);
  //  * stage 1 keeps every bucket's gradient memory (the framework's gradients may stay views of
  //    it, gradient_slot); stage 2 holds a bucket's gradient memory only from its first gradient
  //    until its reduce-scatter ends (a pool of a few buffers: while two buckets are in flight, a
  //    third waits for the older one), keeps only this rank's averaged chunks, and gradient_slot()
  //    is null;
  //  * the buckets are no longer rebuilt in gradient-ready order: the layout defines the shards, and
  //    the optimizer state that lives beside them.
  // Wire compression works with both stages (the chunks travel as 16-bit floats). finish() and the
  // fused update are for the unsharded mode and throw here.
  void enable_sharding(int stage);
  int sharding_stage() const { return stage_; }  // 0: not sharded
  // This rank's chunk of one bucket: `count` parameters and their averaged gradients (after
  // finish_sharded()), in the buckets' kind of memory. Element i of the chunk is element
  // `bucket_offset + i` of the bucket's layout (bucket_layout()'s parameters back to back, then
  // zero padding up to padded_numel).
  struct ShardChunk {
    size_t bucket = 0;
    size_t bucket_offset = 0;
    size_t count = 0;
    float* parameters = nullptr;
    float* gradients = nullptr;
  };
  std::vector<ShardChunk> shard_chunks() const;
  // A bucket's elements including the sharded mode's padding (its parameters' numel otherwise).
  size_t padded_numel(size_t bucket) const;
  // Like finish(): false when nothing was marked in this iteration (or sync is disabled); the same
  // error for a parameter without a gradient. Waits for every bucket's reduce-scatter.
  bool finish_sharded();
  // Collective: every rank's chunks of the parameters to every rank (all buckets' allgathers in
  // flight together). Call after the optimizer stepped the chunks.
  void gather_parameters();
  // Bytes of gradient memory this rank holds now (bucket memory, stage 2's pool and shard).
  size_t gradient_bytes() const;

  // Bucket layout (parameter indices per bucket, in launch order), for tests and logs.
  std::vector<std::vector<size_t>> bucket_layout() const;
  bool buckets_rebuilt() const { return rebuilt_; }
  // The rebuild is decided at the end of the first synchronised iteration, but its memory is taken at
  // the next iteration's first gradient (mark_ready / mark_unused): the old buckets still hold the
  // averages the optimizer steps on, and allocating the new ones before those are released would hold
  // both layouts at once (2 x the gradients, the process's peak, with BERT-base 435 MB more per rank).
  // While it is pending, bucket_layout() already tells the new layout. The torch DDP's zero_grad()
  // releases the gradients that are views of the old buckets when it sees this.
  bool rebuild_pending() const { return rebuild_pending_; }
  // GPU timing of the last iteration is added once its work has run.
  const GradSyncStats& stats() const {
    resolve_gpu_timing(false);
    return stats_;
  }
  const std::vector<ParameterSpec>& parameters() const { return params_; }
  Communicator& communicator() { return *comm_; }
  const GradSyncOptions& options() const { return options_; }

 private:
  struct Bucket {
    std::vector<size_t> params;
    size_t numel = 0;
    // Shared so that a framework's gradient tensors can be views into it (gradient_slot) and keep
    // it alive after a rebuild replaced it.
    std::shared_ptr<float[]> data;
    // The compressed copy while on the wire; like `data`, memory the peers map on one host, so that
    // its allreduce runs in place too.
    std::shared_ptr<uint16_t[]> wire;
    std::shared_ptr<float[]> parameters;  // fused update and sharded mode: the parameters, laid out like `data`
    size_t padded = 0;        // numel, plus the sharded mode's padding to a multiple of size()
    size_t shard_offset = 0;  // stage 2: where this bucket's chunk sits in shard_gradients_
    size_t pending = 0;
    std::shared_ptr<Work> work;
    bool reduced = false;  // sharded mode: this iteration's reduce-scatter waited for and unpacked
  };
  // Stage 2's reusable bucket memory (gradients, and their 16-bit wire copy when compressing).
  struct PooledBuffers {
    std::shared_ptr<float[]> data;
    std::shared_ptr<uint16_t[]> wire;
  };

  void check_parameters_match_rank0();
  void check_compression_matches();
  void build_buckets(const std::vector<size_t>& order);
  // Parameters in bucket order grouped into buckets (the first bucket_cap_bytes rule), no memory.
  std::vector<std::vector<size_t>> group_into_buckets(const std::vector<size_t>& order) const;
  // The parameters in the order of the layout in force (the pending rebuild's, if any).
  std::vector<size_t> layout_order() const;
  void apply_pending_rebuild();
  void reset_iteration();
  void launch_complete_buckets();
  void launch(Bucket& b);
  void wait_launched_quietly();
  // finish()'s and finish_update()'s start: false when there is nothing to finish; otherwise marks the
  // unused parameters (find_unused_parameters) or throws naming the first without a gradient.
  bool begin_finish();
  // The step counters and timeline of one finish (communication wait from t0 to t1).
  void record_wait(std::chrono::steady_clock::time_point t0, std::chrono::steady_clock::time_point t1);
  // After a finish: the bucket rebuild (once) or the next iteration's reset.
  void end_iteration();
  // Sharded mode: bucket memory for a bucket's first gradient (stage 2), and the end of a bucket's
  // reduce-scatter (wait, move this rank's chunk to where shard_chunks() says, give memory back).
  void acquire_bucket_memory(Bucket& b);
  void complete_reduce_scatter(Bucket& b);
  void release_bucket_memory(Bucket& b);
  size_t chunk_of(const Bucket& b) const { return b.padded / static_cast<size_t>(comm_->size()); }
  // Where this rank keeps bucket b's averaged chunk once reduce-scattered (stages 1 and 2): stage 1 its
  // own chunk of the bucket, stage 2 its place in the shard of the gradients.
  float* reduced_chunk(const Bucket& b) const;

  std::shared_ptr<Communicator> comm_;
  std::vector<ParameterSpec> params_;
  GradSyncOptions options_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> param_bucket_;
  std::vector<size_t> param_offset_;
  std::vector<char> ready_;
  std::vector<size_t> ready_order_;
  size_t ready_count_ = 0;
  // Timeline and live stats (trace/recorder.h): when this iteration's first gradient arrived and when
  // the previous iteration's wait ended (CLOCK_MONOTONIC ns).
  int64_t first_ready_ns_ = 0;
  int64_t last_finish_ns_ = 0;
  trace::Recorder& recorder_;  // trace::Recorder::instance()
  // GPU buckets: the device (-1: host buckets), and the iteration whose timing is still to be read
  // (the end-of-backward marker and the buckets' work), when timing is on.
  int gpu_device_ = -1;
  // One rank that skips the buckets (its average is its own gradient), unless COHORT_DDP_REDUCE_ONE_RANK.
  bool alone_ = false;
  struct PendingGpuTiming {
    std::shared_ptr<void> marker;
    std::vector<std::shared_ptr<Work>> works;
  };
  mutable std::optional<PendingGpuTiming> pending_gpu_timing_;
  void resolve_gpu_timing(bool wait) const;
  size_t next_launch_ = 0;
  bool sync_enabled_ = true;
  bool rebuilt_ = false;
  bool rebuild_pending_ = false;
  std::vector<size_t> pending_order_;  // the rebuild's parameter order, while pending
  bool fused_ = false;
  int stage_ = 0;
  std::shared_ptr<float[]> shard_gradients_;  // stage 2: this rank's chunk of every bucket, back to back
  // Stage 2's lent bucket memory, in two sizes where that holds less: buckets the cap rule made
  // ("regular", at most twice bucket_cap_bytes) share buffers of the largest of them; a bucket that one
  // large parameter made larger (a word embedding) takes a buffer of the largest such bucket. One size
  // for all made every buffer as large as the embedding's bucket: three of them (BERT-base: 3 x 92 MB
  // per rank). With one size, large_ is unused (no bucket is larger than regular_.floats).
  struct LentMemory {
    std::vector<PooledBuffers> pool;  // not in use
    size_t buffers = 0;               // allocated (in the pool or in use)
    size_t floats = 0;                // each buffer's size
  };
  bool is_large(const Bucket& b) const { return b.padded > regular_.floats; }
  LentMemory& lent_for(const Bucket& b) { return is_large(b) ? large_ : regular_; }
  LentMemory regular_, large_;
  std::vector<size_t> in_flight_;             // stage 2: launched buckets not yet completed, oldest first
  mutable GradSyncStats stats_;  // mutable: stats() adds the GPU timing that has come in
};

// Disables gradient synchronisation for its lifetime (gradient accumulation), like DDP.no_sync().
class NoSyncGuard {
 public:
  explicit NoSyncGuard(GradientSync& sync) : sync_(sync), previous_(sync.sync_enabled()) {
    sync_.set_sync_enabled(false);
  }
  ~NoSyncGuard() { sync_.set_sync_enabled(previous_); }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;

 private:
  GradientSync& sync_;
  bool previous_;
};

// Broadcasts `count` floats from rank 0 (parameters and buffers at construction).
void broadcast_from_rank0(Communicator& comm, float* data, size_t count);

}  // namespace cohort::train
