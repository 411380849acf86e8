#include "cohort/train/grad_sync.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "cohort/gpu.h"
#include "comm/settings.h"
#include "common/half_arrays.h"
#include "common/log.h"
#include "trace/recorder.h"
#include "cohort/error.h"

namespace cohort::train {

size_t ParameterSpec::numel() const {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

std::string ParameterSpec::describe() const { return fmt::format("{} [{}]", name, fmt::join(shape, ", ")); }

std::optional<WireCompression> parse_compression(std::string_view s) {
  if (s == "none" || s == "fp32" || s == "float32" || s.empty()) return WireCompression::kNone;
  if (s == "fp16" || s == "float16" || s == "half") return WireCompression::kFloat16;
  if (s == "bf16" || s == "bfloat16") return WireCompression::kBFloat16;
  return std::nullopt;
}

std::string_view compression_name(WireCompression c) {
  switch (c) {
    case WireCompression::kNone: return "none";
    case WireCompression::kFloat16: return "fp16";
    case WireCompression::kBFloat16: return "bf16";
  }
  return "?";
}

std::shared_ptr<void> BucketMemory::allocate_private(size_t bytes) {
  // Cache-line aligned and zeroed, like the communicator's shared buckets.
  const size_t rounded = std::max<size_t>(64, (bytes + 63) / 64 * 64);
  void* p = std::aligned_alloc(64, rounded);
  if (!p) throw Error(fmt::format("DDP: cannot allocate {} bytes of bucket memory", bytes));
  std::memset(p, 0, rounded);
  return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
}

namespace {

// The default: memory the communicator hands out for buffers reduced again and again.
class HostBucketMemory final : public BucketMemory {
 public:
  std::shared_ptr<void> allocate(Communicator& comm, size_t bytes) override { return comm.allocate_shared(bytes); }
  void copy(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void zero(void* dst, size_t bytes) override { std::memset(dst, 0, bytes); }
  bool host_accessible() const override { return true; }
};

class GpuBucketMemory final : public BucketMemory {
 public:
  explicit GpuBucketMemory(int device) : device_(device) {}
  std::shared_ptr<void> allocate(Communicator&, size_t bytes) override { return allocate_private(bytes); }
  std::shared_ptr<void> allocate_private(size_t bytes) override {
    auto p = gpu::allocate_device(bytes, device_);
    gpu::zero_memory(p.get(), bytes);
    return p;
  }
  // In stream order on the caller's current stream: a gradient copied into its bucket is ready for
  // the allreduce queued after it (which waits for that stream), and backward goes on meanwhile.
  void copy(void* dst, const void* src, size_t bytes) override { gpu::copy_memory_async(dst, src, bytes, device_); }
  void zero(void* dst, size_t bytes) override { gpu::zero_memory_async(dst, bytes, device_); }
  bool host_accessible() const override { return false; }

 private:
  int device_;
};

}  // namespace

std::shared_ptr<BucketMemory> gpu_bucket_memory(int device) { return std::make_shared<GpuBucketMemory>(device); }

void broadcast_from_rank0(Communicator& comm, float* data, size_t count) {
  if (comm.size() > 1 && count > 0) comm.broadcast(data, count, DataType::kFloat32, 0);
}

namespace {

// One line per parameter: "name [d0, d1]". Compared line by line against rank 0's.
std::string describe_all(const std::vector<ParameterSpec>& params) {
  std::string out;
  for (const auto& p : params) {
    out += p.describe();
    out += '\n';
  }
  return out;
}

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> lines;
  std::istringstream in(s);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

}  // namespace

GradientSync::GradientSync(std::shared_ptr<Communicator> comm, std::vector<ParameterSpec> params,
                           GradSyncOptions options)
    : comm_(std::move(comm)), params_(std::move(params)), options_(options), recorder_(trace::Recorder::instance()) {
  if (!comm_) throw InvalidArgument("GradientSync: communicator is null");
  if (options_.bucket_cap_bytes == 0 || options_.first_bucket_cap_bytes == 0)
    throw InvalidArgument("GradientSync: bucket sizes must be positive");
  if (!options_.memory) options_.memory = std::make_shared<HostBucketMemory>();
  if (options_.compression != WireCompression::kNone && !options_.memory->host_accessible())
    throw InvalidArgument(fmt::format("DDP: wire compression ({}) converts buckets on the CPU; GPU buckets travel as "
                                      "float32 through NCCL (use compression none)",
                                      compression_name(options_.compression)));
  alone_ = comm_->size() == 1 && !comm::ddp_reduce_one_rank();
  gpu_device_ = gpu::device_of(*comm_);
  if (gpu_device_ >= 0 && recorder_.timeline_on()) gpu::enable_timing(*comm_);
  check_parameters_match_rank0();
  check_compression_matches();
  std::vector<size_t> reverse(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) reverse[i] = params_.size() - 1 - i;
  build_buckets(reverse);
  ready_.assign(params_.size(), 0);
}

GradientSync::~GradientSync() { wait_launched_quietly(); }

void GradientSync::check_parameters_match_rank0() {
  const int size = comm_->size();
  if (size == 1) return;
  const std::string mine = describe_all(params_);
  // Rank 0's description, broadcast as length + bytes.
  int64_t length = static_cast<int64_t>(mine.size());
  comm_->broadcast(&length, 1, DataType::kInt64, 0);
  std::string theirs(static_cast<size_t>(length), '\0');
  if (comm_->rank() == 0) theirs = mine;
  if (length > 0) comm_->broadcast(theirs.data(), theirs.size(), DataType::kUInt8, 0);

  // Index of this rank's first differing parameter (-1: identical); gathered so that every rank
  // fails with the same message instead of rank 0 waiting for a rank that gave up.
  const auto want = lines_of(theirs);
  const auto have = lines_of(mine);
  int64_t first_diff = -1;
  for (size_t i = 0; i < std::max(want.size(), have.size()); ++i) {
    if (i >= want.size() || i >= have.size() || want[i] != have[i]) {
      first_diff = static_cast<int64_t>(i);
      break;
    }
  }
  std::vector<int64_t> all(static_cast<size_t>(size));
  comm_->allgather(&first_diff, all.data(), 1, DataType::kInt64);
  for (int r = 0; r < size; ++r) {
    if (all[r] < 0) continue;
    size_t i = static_cast<size_t>(all[r]);
    // Only rank r knows its own description; rank 0's is known everywhere.
    std::string rank0 = i < want.size() ? want[i] : "(no parameter)";
    std::string other = r == comm_->rank() ? (i < have.size() ? have[i] : "(no parameter)")
                                           : "(see rank " + std::to_string(r) + "'s error)";
    throw MismatchError(fmt::format(
        "DDP: model parameters differ between ranks: parameter #{} is {} on rank 0 but {} on rank {} "
        "({} parameters on rank 0)",
        i, rank0, other, r, want.size()));
  }
}

void GradientSync::check_compression_matches() {
  // Compressed buckets allocate wire memory beside each bucket (collectively): ranks that disagree
  // would call allocate_shared with other sizes. Said here, by name, on every rank.
  const int size = comm_->size();
  if (size == 1) return;
  int64_t mine = static_cast<int64_t>(options_.compression);
  std::vector<int64_t> all(static_cast<size_t>(size));
  comm_->allgather(&mine, all.data(), 1, DataType::kInt64);
  for (int r = 1; r < size; ++r)
    if (all[size_t(r)] != all[0])
      throw MismatchError(fmt::format("DDP: wire compression differs between ranks: {} on rank 0 but {} on rank {}",
                                      compression_name(static_cast<WireCompression>(all[0])),
                                      compression_name(static_cast<WireCompression>(all[size_t(r)])), r));
}

std::vector<std::vector<size_t>> GradientSync::group_into_buckets(const std::vector<size_t>& order) const {
  std::vector<std::vector<size_t>> groups(1);
  size_t cap = options_.first_bucket_cap_bytes, numel = 0;
  for (size_t index : order) {
    groups.back().push_back(index);
    numel += params_[index].numel();
    if (numel * sizeof(float) >= cap) {
      groups.emplace_back();
      numel = 0;
      cap = options_.bucket_cap_bytes;
    }
  }
  if (groups.back().empty()) groups.pop_back();
  return groups;
}

std::vector<size_t> GradientSync::layout_order() const {
  if (rebuild_pending_) return pending_order_;
  std::vector<size_t> order;
  for (const Bucket& b : buckets_) order.insert(order.end(), b.params.begin(), b.params.end());
  return order;
}

void GradientSync::apply_pending_rebuild() {
  std::vector<size_t> order = std::move(pending_order_);
  build_buckets(order);
  log::debug("DDP: rebuilt {} buckets in gradient-ready order", buckets_.size());
}

void GradientSync::build_buckets(const std::vector<size_t>& order) {
  rebuild_pending_ = false;
  pending_order_.clear();
  // The old buckets go first (their memory returns unless a .grad view still holds it), then the new.
  buckets_.clear();
  regular_ = LentMemory{};
  large_ = LentMemory{};
  in_flight_.clear();
  shard_gradients_.reset();
  param_bucket_.assign(params_.size(), 0);
  param_offset_.assign(params_.size(), 0);
  Bucket current;
  const size_t world = static_cast<size_t>(comm_->size());
  size_t shard_floats = 0;
  const auto groups = group_into_buckets(order);
  // The fused update reduces nothing during backward, so its buckets need not be separate buffers:
  // every bucket is a slice of one gradient buffer and one parameter buffer, and finish_update()
  // reduces and updates the whole model with one allreduce_update, two rounds of synchronisation
  // per step instead of two per bucket (every round is a point where a rank waits for the slower
  // one; issue 51).
  std::shared_ptr<float[]> fused_grads, fused_params;
  size_t fused_at = 0;
  if (fused_) {
    size_t total = 0;
    for (const auto& group : groups)
      for (size_t index : group) total += params_[index].numel();
    std::shared_ptr<void> g = options_.memory->allocate(*comm_, std::max<size_t>(total, 1) * sizeof(float));
    std::shared_ptr<void> p = options_.memory->allocate(*comm_, std::max<size_t>(total, 1) * sizeof(float));
    fused_grads = std::shared_ptr<float[]>(g, static_cast<float*>(g.get()));
    fused_params = std::shared_ptr<float[]>(p, static_cast<float*>(p.get()));
  }
  auto close = [&] {
    if (current.params.empty()) return;
    // Sharded: a whole number of equal chunks, one per rank.
    current.padded = stage_ > 0 ? (current.numel + world - 1) / world * world : current.numel;
    // From the communicator: on one host, memory the peers map, so the bucket's allreduce reads their
    // gradients in place instead of staging copies (every rank builds the same buckets in the same order).
    // Stage 2 takes gradient memory only while a bucket is in use (acquire_bucket_memory).
    if (fused_) {
      // Aliasing pointers: each bucket keeps the whole buffer alive, as a .grad view of it does.
      current.data = std::shared_ptr<float[]>(fused_grads, fused_grads.get() + fused_at);
      current.parameters = std::shared_ptr<float[]>(fused_params, fused_params.get() + fused_at);
      fused_at += current.numel;
    } else if (stage_ != 2) {
      std::shared_ptr<void> memory = options_.memory->allocate(*comm_, current.padded * sizeof(float));
      current.data = std::shared_ptr<float[]>(memory, static_cast<float*>(memory.get()));
      if (options_.compression != WireCompression::kNone) {
        std::shared_ptr<void> wire = options_.memory->allocate(*comm_, current.padded * sizeof(uint16_t));
        current.wire = std::shared_ptr<uint16_t[]>(wire, static_cast<uint16_t*>(wire.get()));
      }
    }
    if (stage_ > 0) {
      std::shared_ptr<void> params = options_.memory->allocate(*comm_, current.padded * sizeof(float));
      current.parameters = std::shared_ptr<float[]>(params, static_cast<float*>(params.get()));
    }
    current.shard_offset = shard_floats;
    shard_floats += current.padded / world;
    buckets_.push_back(std::move(current));
    current = Bucket{};
  };
  for (const auto& group : groups) {
    for (size_t index : group) {
      param_bucket_[index] = buckets_.size();
      param_offset_[index] = current.numel;
      current.params.push_back(index);
      current.numel += params_[index].numel();
    }
    close();
  }
  // The two sizes of stage 2's lent memory (LentMemory), where they hold less than one size does. Each
  // size has at most three buffers (two in flight, one filling), so one size holds 3 x the largest
  // bucket, and two hold 3 x the largest regular one plus one large buffer per large bucket, three at
  // most: less when large buckets are rare (a word embedding), more when most buckets are large (a
  // model of big matrices), where one size stays.
  const size_t regular_limit = 2 * options_.bucket_cap_bytes / sizeof(float) + world;
  size_t largest = 0, largest_regular = 0, large_buckets = 0;
  for (const Bucket& b : buckets_) {
    largest = std::max(largest, b.padded);
    if (b.padded <= regular_limit) largest_regular = std::max(largest_regular, b.padded);
    else ++large_buckets;
  }
  const bool two_sizes = largest_regular > 0 && 3 * largest_regular + std::min<size_t>(large_buckets, 3) * largest < 3 * largest;
  regular_.floats = two_sizes ? largest_regular : largest;
  large_.floats = two_sizes ? largest : 0;
  if (stage_ == 2) {
    std::shared_ptr<void> shard = options_.memory->allocate_private(std::max<size_t>(shard_floats, 1) * sizeof(float));
    shard_gradients_ = std::shared_ptr<float[]>(shard, static_cast<float*>(shard.get()));
  }
  reset_iteration();
}

void GradientSync::reset_iteration() {
  ready_.assign(params_.size(), 0);
  ready_order_.clear();
  ready_count_ = 0;
  next_launch_ = 0;
  in_flight_.clear();
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.work.reset();
    b.reduced = false;
    if (stage_ == 2) release_bucket_memory(b);
  }
}

std::shared_ptr<float> GradientSync::gradient_slot(size_t index) const {
  if (index >= params_.size()) throw InvalidArgument(fmt::format("DDP: no parameter #{}", index));
  // One rank (unsharded): nothing is copied into buckets. Stage 2: bucket memory is lent, not kept.
  if ((alone_ && stage_ == 0) || stage_ == 2) return nullptr;
  const Bucket& b = buckets_[param_bucket_[index]];
  return std::shared_ptr<float>(b.data, b.data.get() + param_offset_[index]);  // aliasing: owns the bucket
}

std::shared_ptr<float> GradientSync::parameter_slot(size_t index) const {
  if (index >= params_.size()) throw InvalidArgument(fmt::format("DDP: no parameter #{}", index));
  if (!fused_ && stage_ == 0) return nullptr;
  const Bucket& b = buckets_[param_bucket_[index]];
  return std::shared_ptr<float>(b.parameters, b.parameters.get() + param_offset_[index]);
}

void GradientSync::enable_fused_update() {
  if (fused_ || comm_->size() == 1) return;  // one rank: the framework's optimizer steps alone
  if (stage_ > 0)
    throw InvalidArgument("DDP: the fused update and the sharded optimizer cannot be combined (the sharded "
                          "optimizer steps each rank's shard, then gathers the parameters)");
  if (!options_.memory->host_accessible())
    throw InvalidArgument("DDP: the fused update runs on the CPU; GPU buckets are reduced by NCCL (no fused update)");
  if (options_.compression != WireCompression::kNone)
    throw InvalidArgument(fmt::format("DDP: the fused update reduces float32 gradients; wire compression ({}) cannot "
                                      "be combined with it",
                                      compression_name(options_.compression)));
  if (in_iteration()) throw InvalidArgument("DDP: enable the fused update between iterations, not during backward");
  fused_ = true;
  build_buckets(layout_order());  // the same layout, now with parameter memory
}

std::vector<std::vector<size_t>> GradientSync::bucket_layout() const {
  if (rebuild_pending_) return group_into_buckets(pending_order_);
  std::vector<std::vector<size_t>> out;
  for (const auto& b : buckets_) out.push_back(b.params);
  return out;
}

void GradientSync::mark_ready(size_t index, const float* grad) {
  if (!sync_enabled_) return;
  if (index >= params_.size()) throw InvalidArgument(fmt::format("DDP: no parameter #{}", index));
  if (rebuild_pending_) apply_pending_rebuild();
  if (ready_[index])
    throw InvalidArgument(fmt::format(
        "DDP: parameter {} got its gradient twice in one iteration (a module used twice in forward, or "
        "two backward passes without a step)",
        params_[index].name));
  Bucket& b = buckets_[param_bucket_[index]];
  if (stage_ == 2 && !b.data) acquire_bucket_memory(b);
  // One rank: the average is the gradient itself, so it is neither copied nor written back (but the
  // sharded mode steps the optimizer on bucket chunks: the gradient must be there).
  float* slot = b.data.get() + param_offset_[index];
  // A gradient that is a view of its slot is already in place.
  if ((!alone_ || stage_ > 0) && grad != slot)
    options_.memory->copy(slot, grad, params_[index].numel() * sizeof(float));
  ready_[index] = 1;
  ready_order_.push_back(index);
  if (ready_count_++ == 0) first_ready_ns_ = trace::monotonic_ns();
  if (ready_count_ == params_.size() && recorder_.timeline_on())
    recorder_.span("backward", -1, first_ready_ns_, trace::monotonic_ns());
  if (--b.pending == 0) launch_complete_buckets();
}

void GradientSync::mark_unused(size_t index) {
  if (!sync_enabled_) return;
  if (!options_.find_unused_parameters)
    throw InvalidArgument("DDP: mark_unused needs find_unused_parameters");
  if (rebuild_pending_) apply_pending_rebuild();
  if (index >= params_.size() || ready_[index]) return;
  Bucket& b = buckets_[param_bucket_[index]];
  if (stage_ == 2 && !b.data) acquire_bucket_memory(b);
  options_.memory->zero(b.data.get() + param_offset_[index], params_[index].numel() * sizeof(float));
  ready_[index] = 1;
  ready_order_.push_back(index);
  ++ready_count_;
  if (--b.pending == 0) launch_complete_buckets();
}

void GradientSync::launch_complete_buckets() {
  if (fused_) return;  // reduced with the update, in finish_update()
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) launch(buckets_[next_launch_++]);
}

void GradientSync::launch(Bucket& b) {
  ++stats_.allreduces;
  if (recorder_.timeline_on()) recorder_.instant("bucket ready", int(&b - buckets_.data()), trace::monotonic_ns());
  if (alone_) return;  // the average of one rank is its own gradient
  if (stage_ > 0) {
    // Stage 1, and compressed: in place, every rank's averaged chunk in the bucket's (or wire buffer's)
    // first chunk-sized part, which complete_reduce_scatter moves to where it is kept (reduced_chunk).
    // Stage 2 uncompressed: straight into the shard of the gradients, a buffer of its own, so nothing is
    // copied after (in place, the shm group reduces aside and copies into the first chunk, and then
    // complete_reduce_scatter copied it once more). The padding is zeroed again every time, or the last
    // chunk's padding would average whatever the previous step left there.
    const size_t chunk = chunk_of(b);
    if (b.padded > b.numel) options_.memory->zero(b.data.get() + b.numel, (b.padded - b.numel) * sizeof(float));
    switch (options_.compression) {
      case WireCompression::kNone:
        stats_.bytes_on_wire += static_cast<int64_t>(b.padded * sizeof(float));
        b.work = comm_->reduce_scatter_async(b.data.get(), stage_ == 2 ? reduced_chunk(b) : b.data.get(), chunk,
                                             DataType::kFloat32, ReduceOp::kAvg);
        break;
      case WireCompression::kFloat16:
        floats_to_half(b.data.get(), b.wire.get(), b.padded);
        stats_.bytes_on_wire += static_cast<int64_t>(b.padded * 2);
        b.work = comm_->reduce_scatter_async(b.wire.get(), b.wire.get(), chunk, DataType::kFloat16, ReduceOp::kAvg);
        break;
      case WireCompression::kBFloat16:
        floats_to_bf16(b.data.get(), b.wire.get(), b.padded);
        stats_.bytes_on_wire += static_cast<int64_t>(b.padded * 2);
        b.work = comm_->reduce_scatter_async(b.wire.get(), b.wire.get(), chunk, DataType::kBFloat16, ReduceOp::kAvg);
        break;
    }
    if (stage_ == 2) in_flight_.push_back(static_cast<size_t>(&b - buckets_.data()));
    return;
  }
  switch (options_.compression) {
    case WireCompression::kNone:
      stats_.bytes_on_wire += static_cast<int64_t>(b.numel * sizeof(float));
      b.work = comm_->allreduce_async(b.data.get(), b.data.get(), b.numel, DataType::kFloat32, ReduceOp::kAvg);
      break;
    case WireCompression::kFloat16:
      floats_to_half(b.data.get(), b.wire.get(), b.numel);
      stats_.bytes_on_wire += static_cast<int64_t>(b.numel * 2);
      b.work = comm_->allreduce_async(b.wire.get(), b.wire.get(), b.numel, DataType::kFloat16, ReduceOp::kAvg);
      break;
    case WireCompression::kBFloat16:
      floats_to_bf16(b.data.get(), b.wire.get(), b.numel);
      stats_.bytes_on_wire += static_cast<int64_t>(b.numel * 2);
      b.work = comm_->allreduce_async(b.wire.get(), b.wire.get(), b.numel, DataType::kBFloat16, ReduceOp::kAvg);
      break;
  }
}

void GradientSync::wait_launched_quietly() {
  for (auto& b : buckets_) {
    if (!b.work) continue;
    try {
      b.work->synchronize();  // on the host: the buckets may be freed or rebuilt next
    } catch (...) {
    }
    b.work.reset();
  }
}

// On the GPU's clock: how much of each bucket's allreduce ran before the end-of-backward marker.
void GradientSync::resolve_gpu_timing(bool wait) const {
  if (!pending_gpu_timing_) return;
  PendingGpuTiming& p = *pending_gpu_timing_;
  // The marker runs on the caller's stream, apart from the buckets' work: it must have run as well.
  if (!gpu::marker_reached(p.marker, wait ? comm_->options().timeout : std::chrono::milliseconds(0))) {
    if (wait) pending_gpu_timing_.reset();  // a stream that never got there: no figure, no hang
    return;
  }
  for (auto& w : p.works) {
    if (wait) {
      try {
        w->synchronize();
      } catch (...) {
        pending_gpu_timing_.reset();  // failed work has no timing; the error is reported where waited for
        return;
      }
    } else if (!w->test()) {
      return;  // not run yet: try again later
    }
  }
  for (auto& w : p.works) {
    auto iv = gpu::work_interval(*w, p.marker);
    if (!iv) continue;
    const double length = iv->end_ms - iv->start_ms;
    const double before_marker = std::clamp(std::min(iv->end_ms, 0.0) - iv->start_ms, 0.0, std::max(length, 0.0));
    ++stats_.gpu_timed_buckets;
    stats_.gpu_overlap_sum += length > 0 ? before_marker / length : (iv->start_ms < 0 ? 1.0 : 0.0);
    stats_.gpu_allreduce_ms += std::max(length, 0.0);
  }
  pending_gpu_timing_.reset();
}

bool GradientSync::begin_finish() {
  if (!sync_enabled_ || ready_count_ == 0) return false;
  if (ready_count_ < params_.size()) {
    if (options_.find_unused_parameters) {
      for (size_t i = 0; i < params_.size(); ++i)
        if (!ready_[i]) mark_unused(i);
    } else {
      size_t missing = 0;
      while (ready_[missing]) ++missing;
      size_t count = params_.size() - ready_count_;
      wait_launched_quietly();
      reset_iteration();
      throw InvalidArgument(fmt::format(
          "DDP: parameter {} (and {} more) received no gradient in this iteration on rank {}; if some "
          "parameters are unused on purpose, enable find_unused_parameters",
          params_[missing].describe(), count - 1, comm_->rank()));
    }
  }
  return true;
}

void GradientSync::record_wait(std::chrono::steady_clock::time_point t0, std::chrono::steady_clock::time_point t1) {
  stats_.wait_seconds += std::chrono::duration<double>(t1 - t0).count();
  // The flight recorder's step counters (live stats): a step is the time since the previous one
  // ended (forward, backward, optimizer and all), of which this wait is the communication not hidden.
  int64_t wait_start = std::chrono::duration_cast<std::chrono::nanoseconds>(t0.time_since_epoch()).count();
  int64_t wait_end = std::chrono::duration_cast<std::chrono::nanoseconds>(t1.time_since_epoch()).count();
  int64_t step_start = last_finish_ns_ > 0 ? last_finish_ns_ : first_ready_ns_;
  recorder_.add_step(wait_end - step_start, wait_end - wait_start);
  if (recorder_.timeline_on())
    recorder_.span(fused_ ? "reduce and update" : "wait for buckets", -1, wait_start, wait_end);
  last_finish_ns_ = wait_end;
}

void GradientSync::end_iteration() {
  ++stats_.synced_iterations;
  if (options_.rebuild_buckets && !rebuilt_) {
    // Rank 0's ready order, so that all ranks build the same buckets.
    std::vector<int64_t> order(ready_order_.begin(), ready_order_.end());
    if (comm_->size() > 1) comm_->broadcast(order.data(), order.size(), DataType::kInt64, 0);
    std::vector<size_t> as_index(order.begin(), order.end());
    rebuilt_ = true;
    if (fused_) {
      // The fused step binds the parameters to their new slots right after this (step_fused).
      build_buckets(as_index);
      log::debug("DDP: rebuilt {} buckets in gradient-ready order", buckets_.size());
    } else {
      pending_order_ = std::move(as_index);
      rebuild_pending_ = true;
      reset_iteration();
    }
  } else {
    reset_iteration();
  }
}

bool GradientSync::finish(const std::function<void(size_t, const float*)>& write_back) {
  if (stage_ > 0)
    throw InvalidArgument("DDP: the gradients are sharded (each rank averages its chunk of every bucket): "
                          "finish_sharded(), not finish()");
  if (!begin_finish()) return false;
  if (fused_) {
    // The gradients are wanted averaged before the step (to clip them, say): plain allreduces, and the
    // framework's own optimizer steps after this (finish_update finds nothing left to reduce).
    for (auto& b : buckets_) launch(b);
  }
  const auto t0 = std::chrono::steady_clock::now();
  if (gpu_device_ >= 0 && gpu::timing_enabled(*comm_)) {
    // Backward has ended in the caller's stream (every gradient is in its bucket): mark it there, and
    // keep the buckets' work to read their GPU times once they have run.
    resolve_gpu_timing(true);
    PendingGpuTiming p{gpu::record_marker(gpu_device_), {}};
    for (auto& b : buckets_)
      if (b.work) p.works.push_back(b.work);
    pending_gpu_timing_ = std::move(p);
  }
  for (auto& b : buckets_) {
    if (b.work) {
      try {
        b.work->wait();
      } catch (...) {
        b.work.reset();
        wait_launched_quietly();
        reset_iteration();
        throw;
      }
      b.work.reset();
    }
  }
  record_wait(t0, std::chrono::steady_clock::now());
  for (auto& b : buckets_) {
    if (alone_) continue;  // gradients are already final in the framework's tensors
    {
      if (options_.compression == WireCompression::kFloat16)
        half_to_floats(b.wire.get(), b.data.get(), b.numel);
      else if (options_.compression == WireCompression::kBFloat16)
        bf16_to_floats(b.wire.get(), b.data.get(), b.numel);
    }
    size_t offset = 0;
    for (size_t index : b.params) {
      write_back(index, b.data.get() + offset);
      offset += params_[index].numel();
    }
  }
  end_iteration();
  return true;
}

bool GradientSync::finish_update(const Communicator::ParameterUpdate& update) {
  if (!fused_) throw InvalidArgument("DDP: finish_update() needs enable_fused_update()");
  if (!begin_finish()) return false;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    // The buckets lie back to back in one gradient and one parameter buffer (build_buckets): one call
    // for all of them.
    size_t numel = 0;
    for (const auto& b : buckets_) numel += b.numel;
    if (numel > 0) {
      ++stats_.allreduces;
      stats_.bytes_on_wire += static_cast<int64_t>(numel * sizeof(float));
      comm_->allreduce_update(buckets_.front().data.get(), buckets_.front().parameters.get(), numel, ReduceOp::kAvg,
                              update);
    }
  } catch (...) {
    reset_iteration();
    throw;
  }
  record_wait(t0, std::chrono::steady_clock::now());
  end_iteration();
  return true;
}

}  // namespace cohort::train
