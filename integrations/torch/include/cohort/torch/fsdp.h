#pragma once
// cohort::torch::FullyShardedDataParallel — ZeRO stage 3 (the parameters sharded too) for the libtorch
// C++ frontend. docs/training.md, "Fully sharded data parallel", has the design and the rules.
//
//   cohort::torch::FullyShardedDataParallel model(Net(), comm, {.auto_wrap_min_params = 100'000});
//   torch::optim::AdamW optimizer(model.parameters(), 1e-3);        // the shards: any libtorch optimizer
//   optimizer.zero_grad(); loss = f(model.forward(x), y); loss.backward(); optimizer.step();
//
// The model is cut into units (explicit ones, and those an auto-wrap policy picks by parameter count or
// by module type; the parameters no unit holds form the root unit). Each unit's parameters are
// flattened into one vector, padded to a multiple of the world size N, and each rank keeps its 1/N
// slice: the shard, a leaf tensor the optimizer steps. The module's own parameters stay the same
// Variables (the module, its forward and Module::parameters() are unchanged) but become views of one
// buffer per unit whose memory exists only while the unit is gathered:
//   * before a unit's forward its shards are all-gathered into that buffer (the next unit's gather is
//     started before this one computes: forward prefetch), and the memory is freed after it when
//     reshard_after_forward is on (the default);
//   * in backward, a hook on the unit's output gathers it again before its gradients are computed (and
//     starts the gather of the unit before it), and when the last of its parameters has its gradient
//     the gradients are flattened, reduce-scattered (summed, divided by N) into the shards' .grad
//     without waiting (at most two in flight), and the unit's memory is freed. The last unit's gradient
//     waits for them all, so the shards hold the averaged gradient when backward() returns, as under DDP.
// Mixed precision (FSDPOptions::compute_dtype): gathered and computed in bf16 or fp16, the shards (the
// master weights) and the reduce-scatter in float32.
// After optimizer.step() the next forward gathers the updated shards: nothing else to call.
// Buffers (batch norm's statistics) are rank 0's at construction and before each training forward, as
// under DDP; FSDPOptions::compression sends the gradients' reduce-scatter in 16 bits, as DDP's buckets.
// Checkpoints: save()/load() shard by shard at any world size (ShardedOptimizer's format), and
// full_state_dict()/save_full_model() for a plain libtorch program.
//
// How forward reaches the units: libtorch's C++ modules have no forward hooks. For a
// torch::nn::Sequential, forward(x) runs the children one by one and gathers each child's units
// around it (every unit inside that child: a child holding several is one step). For
// any other module, forward_with([&] { ... }) runs the caller's forward with the root unit gathered,
// and the caller wraps each unit's call: fsdp.unit_forward(*layer, [&] { return layer->forward(h); }).
// forward(x) of a module that is not a Sequential gathers every unit for the whole forward (correct,
// but without the memory saving).
//
// Rules, as DDP's: every rank builds the same model (rank 0's weights are broadcast); every unit whose
// forward ran must give every parameter a gradient in each backward (an error names the unit at the
// next forward otherwise); trainable float32 parameters, all on the CPU or all on one GPU. One backward
// at a time. The wrapper must outlive the autograd graphs of its forwards.
//
// On a GPU (the model on cuda:N before it is wrapped): the shards, the gathered units and the flattened
// gradients are in GPU memory, and the all-gathers and reduce-scatters go through the device
// communicator (NCCL; a host communicator is wrapped on GPU N, as DDP does) in torch's current stream
// order, as ProcessGroupNCCL's: each waits for what that stream had queued when it was called (a
// gradient's reduce-scatter comes after the backward kernels that wrote it), and waiting for one orders
// the stream after it without blocking the host, so a prefetched gather overlaps the unit computing
// before it. Checkpoints and full_state_dict() are copied to the CPU.

#include <torch/torch.h>

#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "cohort/torch/module_holder.h"
#include "cohort/train/checkpoint.h"
#include "cohort/train/grad_sync.h"

namespace cohort::torch {

struct FSDPOptions {
  // Free a unit's gathered parameters after its forward (gather them again in backward). Off: they stay
  // from forward to the end of the unit's backward (less communication, more memory).
  bool reshard_after_forward = true;
  // Start the all-gather of the next unit (forward) or of the one before (backward) while this one computes.
  bool prefetch = true;
  // Auto-wrap by parameter count: a submodule becomes a unit when the parameters in its subtree that no
  // smaller unit already holds number at least this many (PyTorch's size_based_auto_wrap_policy,
  // min_num_params). 0: off.
  int64_t auto_wrap_min_params = 0;
  // Auto-wrap by module type: every submodule whose Module::name() is one of these becomes a unit
  // ("torch::nn::LinearImpl", or a TORCH_MODULE's impl class name as Module::name() prints it).
  std::vector<std::string> auto_wrap_module_types;
  // Mixed precision: kBFloat16 or kFloat16 gathers the parameters in that type and the module computes
  // in it (feed it inputs of that type); the shards (the master weights the optimizer steps) and the
  // gradients' reduce-scatter stay float32. kFloat32: no mixed precision.
  ::torch::Dtype compute_dtype = ::torch::kFloat32;
  // DDP's broadcast_buffers: before each forward that records gradients, the module's buffers (batch
  // norm's running statistics) are broadcast from rank 0, so that every rank normalises with the same
  // statistics and a checkpoint (which holds rank 0's) has them. The constructor broadcasts them too,
  // with the parameters, whatever this says.
  bool broadcast_buffers = true;
  // DDP's wire compression, for the gradients' reduce-scatter: kFloat16 or kBFloat16 sends each unit's
  // flattened gradient as 16-bit floats (half the bytes) and the averaged slice comes back as 16-bit
  // floats, widened into the float32 .grad of the shard. The all-gathers of the parameters are not
  // compressed by this (compute_dtype is what gathers them in 16 bits). One rank: nothing is sent.
  train::WireCompression compression = train::WireCompression::kNone;
  // glibc's mmap threshold, fixed for the whole process at construction (mallopt(M_MMAP_THRESHOLD)):
  // every block of at least this many bytes is mapped on its own and unmapped when freed. FSDP
  // allocates and frees a unit's gathered parameters and flattened gradient (tens of MB) around every
  // unit of every step, between the activations; with glibc's default threshold, which rises to the
  // largest block freed, all of them come from the heap, whose holes stay resident: BERT-base at 2
  // ranks peaked 550 MB above what it had live (docs/training.md, "Fully sharded data parallel").
  // 0 leaves malloc as it is. Not glibc: ignored.
  size_t mmap_threshold_bytes = size_t{1} << 20;
};

class FullyShardedDataParallel {
 public:
  // `module`: a ModuleHolder (Sequential, a TORCH_MODULE) or a shared_ptr to a module; `units`: submodules
  // of it that are units whatever the policy says. Collective over `comm`.
  template <typename ModuleType>
  FullyShardedDataParallel(ModuleType module, std::shared_ptr<Communicator> comm, FSDPOptions options = {},
                           std::vector<std::shared_ptr<::torch::nn::Module>> units = {})
      : comm_(std::move(comm)), options_(std::move(options)) {
    auto ptr = holder_ptr(std::move(module));
    module_ = ptr;
    if constexpr (requires(const ::torch::Tensor& x) { ptr->forward(x); }) {
      forward_ = [ptr](const ::torch::Tensor& x) -> ::torch::Tensor { return ptr->forward(x); };
    }
    init(std::move(units));
  }
  ~FullyShardedDataParallel();
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  // A Sequential: unit by unit. Another module with forward(Tensor): every unit gathered around it.
  ::torch::Tensor forward(const ::torch::Tensor& input);
  // The caller's forward, with the root unit gathered; it runs each unit through unit_forward().
  template <typename Fn>
  ::torch::Tensor forward_with(Fn&& run_forward) {
    before_forward();
    gather_root();
    ::torch::Tensor out;
    try {
      out = run_forward();
    } catch (...) {
      forward_failed();
      throw;
    }
    after_forward(out);
    return out;
  }
  // Inside forward_with: runs one unit's forward (`unit` or any module holding units) with its units gathered.
  template <typename Fn>
  ::torch::Tensor unit_forward(const ::torch::nn::Module& unit, Fn&& run_forward) {
    return run_step(units_within(unit), [&] { return run_forward(); });
  }
  FullyShardedDataParallel* operator->() { return this; }

  // The shards, one per unit: what an optimizer steps (their .grad: the averaged gradient's slice).
  std::vector<::torch::Tensor> parameters() const;
  std::shared_ptr<::torch::nn::Module> module() const { return module_; }
  // Where the model, its shards and FSDP's buffers are: the CPU or one GPU.
  ::torch::Device device() const { return device_; }
  void train(bool on = true) { module_->train(on); }
  void eval() { module_->eval(); }

  // Collective: clips the averaged gradients to a total 2-norm of max_norm across every rank's shards
  // (torch::nn::utils::clip_grad_norm_ over the whole model) and returns the norm before clipping.
  double clip_grad_norm(double max_norm);
  // Waits for the reduce-scatters still in flight (normally done when backward() returns). Throws
  // naming a unit that got only some of its gradients.
  void finish_gradient_sync();

  // Collective: the whole model's parameters and buffers by name (Module::named_parameters order, then
  // the buffers), gathered into fresh float32 CPU tensors (the master weights) on every rank, also for
  // a model on a GPU.
  std::vector<std::pair<std::string, ::torch::Tensor>> full_state_dict();
  // Collective: rank 0 writes full_state_dict() as Module::save would write the unwrapped module, so
  // that a plain libtorch program loads it with torch::load(model, path).
  void save_full_model(const std::string& path);

  // Sharded checkpoints, in the format of ShardedOptimizer::save (docs/training.md, "Fully sharded data
  // parallel"). Collective: each rank writes its shards, the master weights and `optimizer`'s state for
  // them (an SGD, Adam or AdamW built over parameters()), to <dir>/zero/step-<global_step>/
  // shard-<r>-of-<N>.bin; then rank 0 writes <dir>/checkpoint.bin (the position and the module's
  // buffers), so that the newest complete checkpoint always has all its shards. Older steps' shards
  // than the two kept checkpoints' are removed.
  void save(const std::string& dir, ::torch::optim::Optimizer& optimizer, const train::TrainingPosition& position);
  // Collective: loads the newest complete checkpoint of `dir` into the shards, the buffers and
  // `optimizer`, whatever world size wrote it (each rank reads the parts of every old shard that overlap
  // its own); nullopt when `dir` holds none. Everything is read and checked before anything changes: a
  // missing or damaged shard, another model (a parameter's name or size), other buffers or another kind
  // of optimizer throw InvalidArgument naming the file and what was expected, with the model and the
  // optimizer as they were.
  std::optional<train::TrainingPosition> load(const std::string& dir, ::torch::optim::Optimizer& optimizer);

  struct UnitInfo {
    std::string name;     // the module's path ("" for the root unit)
    size_t parameters;    // how many parameter tensors
    int64_t numel;        // their elements
    int64_t shard_numel;  // per rank, padding included: ceil(numel / N)
  };
  std::vector<UnitInfo> units() const;
  // Whether unit `index`'s parameters are gathered (their memory exists) right now.
  bool gathered(size_t index) const;
  // The most gradient reduce-scatters that were in flight at once (each holds its unit's flattened
  // gradient until it ends): at most kMaxReducesInFlight.
  size_t peak_reduces_in_flight() const { return peak_in_flight_; }
  static constexpr size_t kMaxReducesInFlight = 2;
  Communicator& communicator() { return *comm_; }

 private:
  struct Unit;
  struct GradHook;
  struct CheckpointLayout;
  // The checkpoint's parameter list (Module::named_parameters order) and this rank's runs of them.
  CheckpointLayout checkpoint_layout() const;
  // "sgd", "adam" or "adamw" for an optimizer over exactly parameters(); throws otherwise.
  std::string checkpoint_optimizer_kind(const ::torch::optim::Optimizer& optimizer) const;
  void init(std::vector<std::shared_ptr<::torch::nn::Module>> explicit_units);
  // float32 on the model's device: what the shards, the flattened units and gradients are made with.
  ::torch::TensorOptions float32() const { return ::torch::TensorOptions().dtype(::torch::kFloat32).device(device_); }
  void before_forward();
  void after_forward(const ::torch::Tensor& out);
  void forward_failed();
  void gather_root();
  ::torch::Tensor run_step(const std::vector<size_t>& units, const std::function<::torch::Tensor()>& fn);
  ::torch::Tensor run_sequential(::torch::nn::SequentialImpl& seq, ::torch::Tensor x);
  const std::vector<size_t>& units_within(const ::torch::nn::Module& module);
  void start_gather(Unit& unit);
  void wait_gather(Unit& unit);
  void reshard(Unit& unit);
  void prefetch(size_t step);
  void on_gradient_ready(size_t unit, size_t param);
  void land_reduce(Unit& unit);
  void finish_reduce();

  std::function<::torch::Tensor(const ::torch::Tensor&)> forward_;
  std::shared_ptr<::torch::nn::Module> module_;
  std::shared_ptr<Communicator> comm_;
  FSDPOptions options_;
  ::torch::Device device_{::torch::kCPU};
  // shared_ptr, not unique_ptr: its deleter is fixed where a unit is made, so that the template
  // constructor compiles where Unit is incomplete.
  std::vector<std::shared_ptr<Unit>> units_;  // the root unit (if it has parameters) is the last
  bool has_root_ = false;
  std::unordered_map<const ::torch::nn::Module*, std::vector<size_t>> within_;  // units_within's cache
  // The units of each step of the first forward, in order: what prefetch gathers next.
  std::vector<std::vector<size_t>> order_;
  bool order_recorded_ = false;
  size_t step_ = 0;              // steps run in this forward
  std::deque<size_t> in_flight_;  // units whose reduce-scatter is in flight, oldest first
  size_t peak_in_flight_ = 0;
};

}  // namespace cohort::torch
