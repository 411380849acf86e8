// cohort::torch::FullyShardedDataParallel (ZeRO stage 3): the design is in the header and in
// docs/training.md, "Fully sharded data parallel".
#include "cohort/torch/fsdp.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <typeinfo>
#include <unordered_set>

#include "cohort/torch/ddp.h"  // broadcast_module
#include "heap_policy.h"
#include "module_sync.h"     // broadcast_buffers
#include "zero_shards.h"

namespace cohort::torch {

namespace {

// glibc keeps freed heap memory resident (it trims only the top of the heap by itself), and most of a
// step's tensors (a layer's gradients, the shards' averaged gradients, the activations) are below its
// mmap threshold, which rises to the largest block freed (a unit's flattened gradient). What a step
// frees would stay in the process's RSS, and each step's different mix of sizes leaves new holes: hand
// the free pages back when the heap holds at least 64 MiB of them (as DDP's return_freed_memory).
void return_freed_memory() {
#if defined(__GLIBC__)
  if (mallinfo2().fordblks >= (size_t{64} << 20)) malloc_trim(0);
#endif
}

// FSDPOptions::mmap_threshold_bytes: a fixed threshold also stops glibc's own rise of it.
void fix_mmap_threshold(size_t bytes) {
#if defined(__GLIBC__)
  if (bytes == 0) return;
  constexpr size_t kMost = static_cast<size_t>(std::numeric_limits<int>::max());  // mallopt takes an int
  if (bytes > kMost)
    throw InvalidArgument(fmt::format("FSDP: mmap_threshold_bytes {} is above the {} bytes mallopt(M_MMAP_THRESHOLD) "
                                      "takes",
                                      bytes, kMost));
  if (mallopt(M_MMAP_THRESHOLD, static_cast<int>(bytes)) != 1)
    throw InvalidArgument(fmt::format("FSDP: glibc refused mmap_threshold_bytes {} (mallopt(M_MMAP_THRESHOLD))", bytes));
#else
  (void)bytes;
#endif
}

// A unit's gathered parameters live in one storage that every parameter of the unit views. Freeing
// and re-allocating that storage's memory in place (PyTorch FSDP's _free_storage/_alloc_storage) keeps
// the parameters and the tensors autograd saved from them valid across a reshard: the next gather
// writes the same values where they look, and no version counter changes.
void free_storage(const ::torch::Tensor& full) {
  c10::StorageImpl* storage = full.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, full.device()));
  storage->set_nbytes(0);
}

void allocate_storage(const ::torch::Tensor& full) {
  // A GPU's caching allocator takes the calling thread's current device (and stream): make it the
  // unit's device, which need not be the thread's (a backward thread, a model on cuda:1).
  const c10::OptionalDeviceGuard on(at::device_of(full));
  c10::StorageImpl* storage = full.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(full.numel()) * full.element_size();
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
}

DataType wire_type(::torch::Dtype dtype) {
  switch (dtype) {
    case ::torch::kFloat32: return DataType::kFloat32;
    case ::torch::kBFloat16: return DataType::kBFloat16;
    case ::torch::kFloat16: return DataType::kFloat16;
    default:
      throw InvalidArgument(fmt::format("FSDP: compute_dtype {} is not float32, bfloat16 or float16",
                                        std::string(c10::toString(dtype))));
  }
}

// The 16-bit type a compressed gradient travels in; kFloat32 without compression.
::torch::Dtype gradient_wire_dtype(train::WireCompression compression) {
  switch (compression) {
    case train::WireCompression::kFloat16: return ::torch::kFloat16;
    case train::WireCompression::kBFloat16: return ::torch::kBFloat16;
    case train::WireCompression::kNone: break;
  }
  return ::torch::kFloat32;
}

// The record rank 0 writes into checkpoint.bin beside the position: what wrote the shards, and the buffers.
constexpr const char* kCheckpointRecord = "__cohort_fsdp";
constexpr const char* kCheckpointBuffers = "__cohort_fsdp_buffers";
constexpr const char* kParameterState = "parameter";  // the shard's values of the master weights

// What Module::save(archive) writes for `module`, with the tensors taken from `values` by their full
// names: a plain libtorch program loads it into the unwrapped model with torch::load.
void write_module(const ::torch::nn::Module& module, const std::string& prefix,
                  const std::unordered_map<std::string, ::torch::Tensor>& values,
                  ::torch::serialize::OutputArchive& archive) {
  for (const auto& p : module.named_parameters(/*recurse=*/false)) archive.write(p.key(), values.at(prefix + p.key()));
  for (const auto& b : module.named_buffers(/*recurse=*/false))
    archive.write(b.key(), values.at(prefix + b.key()), /*is_buffer=*/true);
  for (const auto& child : module.named_children()) {
    if (!child.value()->is_serializable()) continue;
    ::torch::serialize::OutputArchive child_archive(archive.compilation_unit());
    write_module(*child.value(), prefix + child.key() + ".", values, child_archive);
    archive.write(child.key(), child_archive);
  }
}

}  // namespace

struct FullyShardedDataParallel::Unit {
  std::string name;                          // the module's path; "" for the root unit
  const ::torch::nn::Module* module = nullptr;  // null for the root unit
  std::vector<::torch::Tensor> params;       // the module's own Variables, views of `full`
  std::vector<std::string> param_names;
  std::vector<int64_t> offsets;              // where each parameter starts in the flattened unit
  int64_t numel = 0;
  int64_t shard_numel = 0;                   // ceil(numel / N): the flattened unit is padded to N of them
  ::torch::Tensor full;                      // [N * shard_numel], compute_dtype; its memory exists while gathered
  ::torch::Tensor shard;                     // [shard_numel], float32: this rank's slice, the optimizer's parameter
  ::torch::Tensor shard_low;                 // mixed precision: the shard in compute_dtype, while it is sent
  bool gathered = false;
  std::shared_ptr<Work> gathering;           // an all-gather into `full` still in flight
  // Backward.
  std::vector<bool> ready;                   // which parameters have this backward's gradient
  size_t ready_count = 0;
  bool expect_grad = false;                  // its forward ran with autograd recording
  bool reduced = false;                      // its gradients are reduce-scattered (maybe still in flight)
  bool landed = false;                       // ... and their average is in the shard's .grad
  ::torch::Tensor grad_flat, grad_slice;     // the reduce-scatter's input and output
  std::shared_ptr<Work> reducing;
  std::vector<std::shared_ptr<::torch::autograd::Node>> accumulators;
  std::vector<uintptr_t> hook_keys;
};

// Post hook on a parameter's AccumulateGrad node: runs once .grad holds this backward's gradient.
struct FullyShardedDataParallel::GradHook : ::torch::autograd::FunctionPostHook {
  GradHook(FullyShardedDataParallel* fsdp, size_t unit, size_t param) : fsdp(fsdp), unit(unit), param(param) {}
  ::torch::autograd::variable_list operator()(const ::torch::autograd::variable_list& outputs,
                                              const ::torch::autograd::variable_list& /*inputs*/) override {
    fsdp->on_gradient_ready(unit, param);
    return outputs;
  }
  FullyShardedDataParallel* fsdp;
  size_t unit, param;
};

void FullyShardedDataParallel::init(std::vector<std::shared_ptr<::torch::nn::Module>> explicit_units) {
  if (!comm_) throw InvalidArgument("FSDP: communicator is null");
  if (!module_) throw InvalidArgument("FSDP: module is null");
  wire_type(options_.compute_dtype);  // one the communicator moves
  // A DDP wrapper constructed earlier in this process turned glibc's trimming off: with the top of the
  // heap resident, a gathered unit would come out of it however low the mmap threshold.
  if (options_.mmap_threshold_bytes > 0) heap_policy::trim_again();
  fix_mmap_threshold(options_.mmap_threshold_bytes);
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  std::optional<::torch::Device> device;
  std::string first_name;
  for (auto& p : module_->named_parameters(true)) {
    const ::torch::Tensor& t = p.value();
    const ::torch::Device d = t.device();
    if (!t.requires_grad() || t.scalar_type() != ::torch::kFloat32 || !(d.is_cpu() || d.is_cuda()))
      throw InvalidArgument(fmt::format("FSDP: parameter {} must be a trainable float32 tensor on the CPU or a GPU, not "
                                        "{}{} on {}",
                                        p.key(), t.requires_grad() ? "" : "a frozen ",
                                        std::string(c10::toString(t.scalar_type())), d.str()));
    if (device && *device != d)
      throw InvalidArgument(fmt::format("FSDP: parameter {} is on {} but {} is on {}: one device per model replica",
                                        p.key(), d.str(), first_name, device->str()));
    if (!device) device = d, first_name = p.key();
    names.emplace(t.unsafeGetTensorImpl(), p.key());
  }
  // On a GPU every buffer FSDP makes (the shards, the gathered units, the flattened gradients) is in
  // its memory and moves through the device communicator (NCCL), in torch's current stream order.
  device_ = device.value_or(::torch::Device(::torch::kCPU));
  comm_ = communicator_for_device(comm_, device_, "FSDP");
  const int world = comm_->size(), rank = comm_->rank();
  // Every rank starts from rank 0's weights, as under DDP.
  broadcast_module(*module_, *comm_);

  // Units, innermost first (post-order): a module's parameters belong to the innermost unit holding them.
  std::unordered_set<const ::torch::nn::Module*> wanted;
  for (const auto& m : explicit_units) {
    if (!m) throw InvalidArgument("FSDP: an explicit unit is null");
    wanted.insert(m.get());
  }
  std::unordered_set<const c10::TensorImpl*> assigned;
  std::unordered_set<const ::torch::nn::Module*> seen;
  auto make_unit = [&](const ::torch::nn::Module* module, const std::string& name,
                       const std::vector<::torch::Tensor>& candidates) {
    auto unit = std::make_shared<Unit>();
    unit->name = name;
    unit->module = module;
    for (const auto& t : candidates) {
      if (!assigned.insert(t.unsafeGetTensorImpl()).second) continue;  // a shared parameter: its first unit
      unit->params.push_back(t);
      unit->param_names.push_back(names.at(t.unsafeGetTensorImpl()));
      unit->offsets.push_back(unit->numel);
      unit->numel += t.numel();
    }
    if (!unit->params.empty()) units_.push_back(std::move(unit));
  };
  std::function<int64_t(const std::shared_ptr<::torch::nn::Module>&, const std::string&)> walk =
      [&](const std::shared_ptr<::torch::nn::Module>& m, const std::string& path) -> int64_t {
    seen.insert(m.get());
    int64_t unassigned = 0;
    for (const auto& child : m->named_children())
      unassigned += walk(child.value(), path.empty() ? child.key() : path + "." + child.key());
    for (const auto& p : m->parameters(/*recurse=*/false))
      if (!assigned.count(p.unsafeGetTensorImpl())) unassigned += p.numel();
    if (m == module_) return unassigned;  // the rest forms the root unit
    const auto& types = options_.auto_wrap_module_types;
    const bool by_type = std::find(types.begin(), types.end(), m->name()) != types.end();
    const bool by_size = options_.auto_wrap_min_params > 0 && unassigned >= options_.auto_wrap_min_params;
    if (wanted.count(m.get()) || by_type || by_size) {
      make_unit(m.get(), path, m->parameters(/*recurse=*/true));
      return 0;
    }
    return unassigned;
  };
  walk(module_, "");
  for (const auto& m : explicit_units)
    if (!seen.count(m.get()))
      throw InvalidArgument(fmt::format("FSDP: an explicit unit ({}) is not a submodule of the wrapped {}", m->name(),
                                        module_->name()));
  const size_t before_root = units_.size();
  make_unit(nullptr, "", module_->parameters(/*recurse=*/true));
  has_root_ = units_.size() > before_root;

  // Flatten, shard, and free: each parameter becomes a view of its unit's `full` buffer (set_data keeps
  // the Variable, its gradient accumulator and the module's reference), and the rank keeps its slice.
  ::torch::NoGradGuard no_grad;
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = *units_[u];
    unit.shard_numel = (unit.numel + world - 1) / world;
    ::torch::Tensor flat = ::torch::zeros({unit.shard_numel * world}, float32());  // the padding stays zero
    for (size_t i = 0; i < unit.params.size(); ++i)
      flat.narrow(0, unit.offsets[i], unit.params[i].numel()).copy_(unit.params[i].detach().reshape({-1}));
    unit.shard = flat.narrow(0, rank * unit.shard_numel, unit.shard_numel).clone().set_requires_grad(true);
    unit.full = options_.compute_dtype == ::torch::kFloat32
                    ? flat
                    : ::torch::empty({flat.numel()}, float32().dtype(options_.compute_dtype));
    for (size_t i = 0; i < unit.params.size(); ++i) {
      ::torch::Tensor& p = unit.params[i];
      // Another dtype (mixed precision) gives the parameter a new gradient accumulator: the hooks
      // below are added after.
      p.set_data(unit.full.narrow(0, unit.offsets[i], p.numel()).view(p.sizes()));
      p.mutable_grad().reset();
    }
    flat = ::torch::Tensor();
    free_storage(unit.full);
    unit.ready.assign(unit.params.size(), false);
    for (size_t i = 0; i < unit.params.size(); ++i) {
      auto acc = ::torch::autograd::impl::grad_accumulator(unit.params[i]);
      if (!acc) throw InvalidArgument(fmt::format("FSDP: parameter {} has no gradient accumulator", unit.param_names[i]));
      unit.hook_keys.push_back(acc->add_post_hook(std::make_unique<GradHook>(this, u, i)));
      unit.accumulators.push_back(std::move(acc));
    }
  }
  return_freed_memory();  // the module's own parameter storage and the flattened copies
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  for (auto& unit : units_) {
    for (size_t i = 0; i < unit->accumulators.size(); ++i) unit->accumulators[i]->del_post_hook(unit->hook_keys[i]);
    // The communicator may still write into these buffers: let it finish first.
    for (auto* work : {&unit->gathering, &unit->reducing}) {
      if (!*work) continue;
      try {
        (*work)->wait();
      } catch (const std::exception&) {
      }
    }
  }
}

std::vector<::torch::Tensor> FullyShardedDataParallel::parameters() const {
  std::vector<::torch::Tensor> shards;
  for (const auto& unit : units_) shards.push_back(unit->shard);
  return shards;
}

std::vector<FullyShardedDataParallel::UnitInfo> FullyShardedDataParallel::units() const {
  std::vector<UnitInfo> out;
  for (const auto& unit : units_) out.push_back({unit->name, unit->params.size(), unit->numel, unit->shard_numel});
  return out;
}

bool FullyShardedDataParallel::gathered(size_t index) const { return units_.at(index)->gathered; }

// ---- gather and reshard ----

void FullyShardedDataParallel::start_gather(Unit& unit) {
  if (unit.gathered) return;
  ::torch::NoGradGuard no_grad;
  allocate_storage(unit.full);
  unit.gathered = true;
  if (comm_->size() == 1) {
    unit.full.copy_(unit.shard.detach());  // converts to compute_dtype
    return;
  }
  // Mixed precision: the shard is sent in compute_dtype (half the bytes of float32).
  unit.shard_low = options_.compute_dtype == ::torch::kFloat32 ? unit.shard.detach()
                                                                 : unit.shard.detach().to(options_.compute_dtype);
  unit.gathering = comm_->allgather_async(unit.shard_low.data_ptr(), unit.full.data_ptr(),
                                          static_cast<size_t>(unit.shard_numel), wire_type(options_.compute_dtype));
}

void FullyShardedDataParallel::wait_gather(Unit& unit) {
  if (!unit.gathering) return;
  auto work = std::move(unit.gathering);
  work->wait();
  unit.shard_low = ::torch::Tensor();
}

void FullyShardedDataParallel::reshard(Unit& unit) {
  if (!unit.gathered) return;
  wait_gather(unit);  // the communicator must be done writing before the memory goes
  free_storage(unit.full);
  unit.gathered = false;
}

void FullyShardedDataParallel::prefetch(size_t step) {
  if (!options_.prefetch || !order_recorded_ || step >= order_.size()) return;
  for (size_t u : order_[step]) start_gather(*units_[u]);
}

void FullyShardedDataParallel::gather_root() {
  if (!has_root_) return;
  Unit& root = *units_.back();
  start_gather(root);
  wait_gather(root);
  if (::torch::GradMode::is_enabled()) root.expect_grad = true;
}

// ---- forward ----

void FullyShardedDataParallel::before_forward() {
  finish_gradient_sync();  // throws if the last backward left a unit without its gradients
  // As DDP: a forward that trains normalises with rank 0's statistics on every rank.
  if (options_.broadcast_buffers && ::torch::GradMode::is_enabled() && comm_->size() > 1)
    broadcast_buffers(*module_, *comm_);
  step_ = 0;
  // A forward whose output never went through backward leaves its units expecting gradients, and with
  // reshard_after_forward off, gathered: start over (the optimizer may have changed the shards since).
  for (auto& unit : units_) {
    unit->expect_grad = false;
    reshard(*unit);
  }
}

::torch::Tensor FullyShardedDataParallel::forward(const ::torch::Tensor& input) {
  // Exactly a Sequential: its forward is the chain of its children. (A subclass may override forward.)
  if (typeid(*module_) == typeid(::torch::nn::SequentialImpl))
    return forward_with([&] { return run_sequential(dynamic_cast<::torch::nn::SequentialImpl&>(*module_), input); });
  if (!forward_)
    throw InvalidArgument(fmt::format("FSDP: the forward of {} takes other arguments: call forward_with([&] {{ return "
                                      "module->forward(...); }}) and unit_forward() for each unit",
                                      module_->name()));
  std::vector<size_t> all;
  for (size_t u = 0; u < units_.size(); ++u)
    if (units_[u]->module) all.push_back(u);
  return forward_with([&] { return run_step(all, [&] { return forward_(input); }); });
}

::torch::Tensor FullyShardedDataParallel::run_sequential(::torch::nn::SequentialImpl& seq, ::torch::Tensor x) {
  for (size_t i = 0; i < seq.size(); ++i) {
    std::shared_ptr<::torch::nn::Module> child = seq.ptr(i);
    auto& any = *(seq.begin() + static_cast<std::ptrdiff_t>(i));
    x = run_step(units_within(*child), [&] { return any.forward(x); });
  }
  return x;
}

const std::vector<size_t>& FullyShardedDataParallel::units_within(const ::torch::nn::Module& module) {
  auto it = within_.find(&module);
  if (it != within_.end()) return it->second;
  std::unordered_set<const ::torch::nn::Module*> subtree;
  for (const auto& m : module.modules(/*include_self=*/false)) subtree.insert(m.get());
  subtree.insert(&module);
  std::vector<size_t> found;
  for (size_t u = 0; u < units_.size(); ++u)
    if (units_[u]->module && subtree.count(units_[u]->module)) found.push_back(u);
  return within_.emplace(&module, std::move(found)).first->second;
}

::torch::Tensor FullyShardedDataParallel::run_step(const std::vector<size_t>& units,
                                                   const std::function<::torch::Tensor()>& fn) {
  if (units.empty()) return fn();
  const size_t step = step_++;
  if (!order_recorded_) order_.push_back(units);
  for (size_t u : units) start_gather(*units_[u]);  // nothing to do for a prefetched unit
  for (size_t u : units) wait_gather(*units_[u]);
  prefetch(step + 1);  // the next unit's all-gather runs while this one computes
  ::torch::Tensor out = fn();
  const bool recording = ::torch::GradMode::is_enabled() && out.defined() && out.requires_grad();
  if (recording) {
    for (size_t u : units) units_[u]->expect_grad = true;
    // Before this unit's backward: its parameters again (they were freed after forward), and the
    // gather of the unit before it (the next to run backward) started.
    out.register_hook([this, units, step](const ::torch::Tensor&) {
      for (size_t u : units) start_gather(*units_[u]);
      for (size_t u : units) wait_gather(*units_[u]);
      if (step > 0) prefetch(step - 1);
    });
  }
  if (options_.reshard_after_forward || !recording)
    for (size_t u : units) reshard(*units_[u]);
  return out;
}

void FullyShardedDataParallel::after_forward(const ::torch::Tensor& out) {
  order_recorded_ = true;
  const bool backward_follows = ::torch::GradMode::is_enabled() && out.defined() && out.requires_grad();
  for (auto& unit : units_) {
    if (backward_follows && unit->expect_grad) continue;  // gathered until its backward (root, or no reshard)
    unit->expect_grad = false;
    reshard(*unit);  // an evaluation's units, or a prefetch no step used
  }
}

void FullyShardedDataParallel::forward_failed() {
  step_ = 0;
  for (auto& unit : units_) {
    unit->expect_grad = false;
    reshard(*unit);
  }
}

// ---- backward ----

void FullyShardedDataParallel::on_gradient_ready(size_t u, size_t i) {
  Unit& unit = *units_[u];
  if (!unit.params[i].grad().defined()) return;
  if (!unit.ready[i]) unit.ready[i] = true, ++unit.ready_count;
  if (unit.ready_count < unit.params.size()) return;
  // The unit's backward is over: flatten its gradients (the padding stays zero), start their
  // reduce-scatter without waiting, and free both the whole gradients and the gathered parameters.
  const int world = comm_->size();
  // On a GPU all of this is queued on torch's current stream, after the backward kernels that produced
  // the gradients; the reduce-scatter waits for what that stream had queued when it was called.
  ::torch::Tensor flat = ::torch::zeros({unit.shard_numel * world}, float32());
  for (size_t k = 0; k < unit.params.size(); ++k) {
    flat.narrow(0, unit.offsets[k], unit.params[k].numel()).copy_(unit.params[k].grad().reshape({-1}));
    unit.params[k].mutable_grad().reset();
  }
  unit.ready.assign(unit.params.size(), false);
  unit.ready_count = 0;
  unit.grad_flat = flat;
  unit.reduced = true;
  if (world == 1) {
    unit.grad_slice = flat;
    land_reduce(unit);
  } else if (options_.compression == train::WireCompression::kNone) {
    unit.grad_slice = ::torch::empty({unit.shard_numel}, float32());
    unit.reducing = comm_->reduce_scatter_async(flat.data_ptr<float>(), unit.grad_slice.data_ptr<float>(),
                                                static_cast<size_t>(unit.shard_numel), DataType::kFloat32, ReduceOp::kSum);
  } else {
    // Compressed as DDP's buckets: 16 bits on the wire, averaged there (a sum of 16-bit values could
    // overflow float16 where the mean does not), widened into the shard's float32 gradient on landing.
    const ::torch::Dtype wire = gradient_wire_dtype(options_.compression);
    unit.grad_flat = flat.to(wire);
    unit.grad_slice = ::torch::empty({unit.shard_numel}, float32().dtype(wire));
    unit.reducing = comm_->reduce_scatter_async(unit.grad_flat.data_ptr(), unit.grad_slice.data_ptr(),
                                                static_cast<size_t>(unit.shard_numel), wire_type(wire), ReduceOp::kAvg);
  }
  if (world > 1) {
    // Each reduce-scatter in flight holds its unit's whole flattened gradient: at most
    // kMaxReducesInFlight of them, or the end of backward would hold the whole model's gradients.
    in_flight_.push_back(u);
    while (in_flight_.size() > kMaxReducesInFlight) {
      land_reduce(*units_[in_flight_.front()]);
      in_flight_.pop_front();
    }
    peak_in_flight_ = std::max(peak_in_flight_, in_flight_.size());
  }
  reshard(unit);
  // The activations this unit's backward freed are small blocks in the heap, and the gradients made
  // after them sit above them: they stay resident as holes until something trims the heap. Hand them
  // back now rather than after backward, or the end of backward (the tied embedding's gradients of
  // BERT, the last thing it computes) peaks with every layer's freed activations still resident.
  // (mallinfo2 still counts the pages a trim handed back as free: once the heap has 64 MiB free, every
  // unit's end trims, a walk of the heap's free blocks, small beside a unit's backward.)
  return_freed_memory();
  // The last unit to finish its backward waits for every reduce-scatter, so that the shards hold the
  // averaged gradients when backward() returns (libtorch 1.13 has no final autograd callback).
  const bool all = std::all_of(units_.begin(), units_.end(), [](const auto& x) { return !x->expect_grad || x->reduced; });
  if (all) finish_reduce();
}

// Waits for the unit's reduce-scatter, adds the average into its shard's .grad and frees the buffers.
void FullyShardedDataParallel::land_reduce(Unit& unit) {
  if (!unit.reduced || unit.landed) return;
  ::torch::NoGradGuard no_grad;
  if (unit.reducing) {
    auto work = std::move(unit.reducing);
    work->wait();
  }
  // Summed over the ranks in float32: the mean, as DDP's; a compressed one is averaged already.
  ::torch::Tensor average = unit.grad_slice.scalar_type() == ::torch::kFloat32
                                ? unit.grad_slice.div_(static_cast<double>(comm_->size()))
                                : unit.grad_slice.to(::torch::kFloat32);
  ::torch::Tensor& grad = unit.shard.mutable_grad();
  if (grad.defined()) grad.add_(average);  // accumulated over backwards until zero_grad, as torch does
  else grad = average;
  unit.grad_flat = ::torch::Tensor();
  unit.grad_slice = ::torch::Tensor();
  unit.landed = true;
}

void FullyShardedDataParallel::finish_reduce() {
  for (size_t u : in_flight_) land_reduce(*units_[u]);
  in_flight_.clear();
  for (auto& unit : units_) {
    land_reduce(*unit);
    unit->reduced = false;
    unit->landed = false;
    unit->expect_grad = false;
  }
  return_freed_memory();  // backward's gradients and the units gathered for it
}

void FullyShardedDataParallel::finish_gradient_sync() {
  std::string missing;
  for (auto& unit : units_) {
    if (unit->ready_count > 0) {
      for (size_t i = 0; i < unit->params.size() && missing.empty(); ++i)
        if (!unit->ready[i])
          missing = fmt::format("FSDP: parameter {} (unit '{}') received no gradient in the last backward; every "
                                "parameter of a unit that ran forward needs one",
                                unit->param_names[i], unit->name);
    }
  }
  const bool some_reduced = std::any_of(units_.begin(), units_.end(), [](const auto& u) { return u->reduced; });
  if (missing.empty() && some_reduced)
    for (auto& unit : units_)
      if (unit->expect_grad && !unit->reduced && missing.empty())
        missing = fmt::format("FSDP: unit '{}' received no gradient in the last backward though its forward ran",
                              unit->name);
  if (some_reduced) finish_reduce();  // what did arrive, so that nothing is left in flight
  if (missing.empty()) return;
  for (auto& unit : units_) {
    unit->ready.assign(unit->params.size(), false);
    unit->ready_count = 0;
    unit->expect_grad = false;
    for (auto& p : unit->params) p.mutable_grad().reset();
  }
  throw InvalidArgument(missing);
}

double FullyShardedDataParallel::clip_grad_norm(double max_norm) {
  finish_gradient_sync();
  ::torch::NoGradGuard no_grad;
  // Summed on the shards' device: on a GPU, one wait for the GPU for the whole model, not one per unit.
  ::torch::Tensor squares = ::torch::zeros({}, float32().dtype(::torch::kFloat64));
  for (auto& unit : units_)
    if (unit->shard.grad().defined()) squares += unit->shard.grad().to(::torch::kFloat64).pow(2).sum();
  double sum = squares.item<double>();
  if (comm_->size() > 1) comm_->allreduce(&sum, &sum, 1, DataType::kFloat64, ReduceOp::kSum);
  const double norm = std::sqrt(sum);
  const double coef = max_norm / (norm + 1e-6);  // torch::nn::utils::clip_grad_norm_'s rule
  if (coef < 1)
    for (auto& unit : units_)
      if (unit->shard.grad().defined()) unit->shard.mutable_grad().mul_(coef);
  return norm;
}

// ---- the whole model ----

std::vector<std::pair<std::string, ::torch::Tensor>> FullyShardedDataParallel::full_state_dict() {
  ::torch::NoGradGuard no_grad;
  const int world = comm_->size();
  std::unordered_map<std::string, ::torch::Tensor> by_name;
  for (auto& unit : units_) {
    wait_gather(*unit);  // the communicator runs operations in call order: nothing may be in flight
    // Gathered where the shards are (a GPU's through NCCL), then one copy to the CPU per unit.
    ::torch::Tensor all = ::torch::empty({unit->shard_numel * world}, float32());
    if (world == 1) all.copy_(unit->shard);
    else
      comm_->allgather(unit->shard.data_ptr<float>(), all.data_ptr<float>(), static_cast<size_t>(unit->shard_numel),
                       DataType::kFloat32);
    all = all.to(::torch::kCPU);
    for (size_t i = 0; i < unit->params.size(); ++i)
      by_name[unit->param_names[i]] = all.narrow(0, unit->offsets[i], unit->params[i].numel()).view(unit->params[i].sizes()).clone();
  }
  std::vector<std::pair<std::string, ::torch::Tensor>> out;
  for (const auto& p : module_->named_parameters(true)) out.emplace_back(p.key(), by_name.at(p.key()));
  for (const auto& b : module_->named_buffers(true))
    out.emplace_back(b.key(), b.value().is_cpu() ? b.value().clone() : b.value().to(::torch::kCPU));
  return out;
}

void FullyShardedDataParallel::save_full_model(const std::string& path) {
  const auto full = full_state_dict();
  if (comm_->rank() != 0) return;
  std::unordered_map<std::string, ::torch::Tensor> values(full.begin(), full.end());
  ::torch::serialize::OutputArchive archive;
  write_module(*module_, "", values, archive);
  archive.save_to(path);
}

// ---- sharded checkpoints (the format is zero_shards.h's, which ShardedOptimizer writes too) ----

struct FullyShardedDataParallel::CheckpointLayout {
  std::vector<train::ParameterSpec> params;  // Module::named_parameters order: independent of the units
  std::vector<zero::Piece> pieces;           // this rank's runs; a piece's chunk is its unit's index
};

FullyShardedDataParallel::CheckpointLayout FullyShardedDataParallel::checkpoint_layout() const {
  CheckpointLayout layout;
  std::unordered_map<std::string, size_t> index;
  for (const auto& p : module_->named_parameters(true)) {
    index.emplace(p.key(), layout.params.size());
    layout.params.push_back({p.key(), p.value().sizes().vec()});
  }
  const int64_t rank = comm_->rank();
  size_t position = 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    const Unit& unit = *units_[u];
    // This rank's slice of the flattened unit; the padding after the last parameter belongs to none.
    const int64_t lo = rank * unit.shard_numel, hi = lo + unit.shard_numel;
    for (size_t i = 0; i < unit.params.size(); ++i) {
      const int64_t start = unit.offsets[i], end = start + unit.params[i].numel();
      const int64_t from = std::max(lo, start), to = std::min(hi, end);
      if (from >= to) continue;
      layout.pieces.push_back({index.at(unit.param_names[i]), size_t(from - start), size_t(to - from),
                               position + size_t(from - lo), u, size_t(from - lo)});
    }
    position += static_cast<size_t>(unit.shard_numel);
  }
  return layout;
}

std::string FullyShardedDataParallel::checkpoint_optimizer_kind(const ::torch::optim::Optimizer& optimizer) const {
  const std::string kind = zero::optimizer_kind(optimizer);
  if (kind.empty())
    throw InvalidArgument("FSDP checkpoint: the optimizer is not an SGD, Adam or AdamW (the kinds whose state it saves)");
  // Its state is found by the shard tensors: it must step exactly them.
  std::unordered_set<const c10::TensorImpl*> stepped;
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params()) stepped.insert(p.unsafeGetTensorImpl());
  bool same = stepped.size() == units_.size();
  for (const auto& unit : units_) same = same && stepped.count(unit->shard.unsafeGetTensorImpl());
  if (!same)
    throw InvalidArgument(fmt::format("FSDP checkpoint: the {} steps {} tensors, not this FSDP's {} shards (build it "
                                      "over parameters())",
                                      kind, stepped.size(), units_.size()));
  return kind;
}

void FullyShardedDataParallel::save(const std::string& dir, ::torch::optim::Optimizer& optimizer,
                                    const train::TrainingPosition& position) {
  const std::string kind = checkpoint_optimizer_kind(optimizer);
  const int rank = comm_->rank(), world = comm_->size();
  const CheckpointLayout layout = checkpoint_layout();
  // The master weights, then the optimizer state that exists (none before the first step).
  std::vector<std::string> states{kParameterState};
  for (const auto& name : zero::state_names(optimizer, kind))
    if (!units_.empty() && zero::state_tensor(optimizer, kind, units_.front()->shard, name).defined())
      states.push_back(name);
  nlohmann::json header;
  header["kind"] = "fsdp " + kind;
  header["world"] = world;
  header["rank"] = rank;
  header["global_step"] = position.global_step;
  header["step"] = units_.empty() ? 0 : zero::state_step(optimizer, kind, units_.front()->shard);
  const std::string bytes = zero::encode_shard(header, layout.params, layout.pieces, states, [&](size_t k, size_t u) {
    const ::torch::Tensor& shard = units_[u]->shard;
    const ::torch::Tensor values = k == 0 ? shard : zero::state_tensor(optimizer, kind, shard, states[k]);
    return values.detach().to(::torch::kCPU).contiguous();
  });
  train::write_file_atomically(zero::shard_path(dir, position.global_step, rank, world), bytes);
  // Every shard on disk before the checkpoint that names them.
  if (world > 1) comm_->barrier();
  if (rank == 0) {
    ::torch::serialize::OutputArchive archive;
    nlohmann::json record{{"world", world}, {"global_step", position.global_step}, {"kind", kind}};
    c10::List<::torch::Tensor> buffers;
    nlohmann::json buffer_names = nlohmann::json::array();
    for (const auto& b : module_->named_buffers(true)) {
      buffer_names.push_back(b.key());
      buffers.push_back(b.value().detach().to(::torch::kCPU));  // loadable without this model's GPU
    }
    record["buffers"] = buffer_names;
    archive.write(kCheckpointRecord, c10::IValue(record.dump()));
    archive.write(kCheckpointBuffers, c10::IValue(buffers));
    std::ostringstream payload;
    archive.save_to(payload);
    train::write_checkpoint(dir, position, payload.str());
    zero::remove_old_shard_dirs(dir, position.global_step);
  }
  if (world > 1) comm_->barrier();
}

std::optional<train::TrainingPosition> FullyShardedDataParallel::load(const std::string& dir,
                                                                      ::torch::optim::Optimizer& optimizer) {
  const std::string kind = checkpoint_optimizer_kind(optimizer);
  auto newest = train::newest_complete_checkpoint(dir);
  if (!newest) return std::nullopt;
  const std::string& path = newest->path;
  for (const auto& why : newest->skipped) fmt::print(stderr, "checkpoint: skipped {}\n", why);

  // The record and the buffers, checked against this model and optimizer.
  nlohmann::json record;
  std::vector<::torch::Tensor> stored_buffers;
  std::vector<std::string> buffer_names;
  int old_world = 0;
  int64_t global_step = 0;
  try {
    ::torch::serialize::InputArchive archive;
    std::istringstream in(newest->payload);
    archive.load_from(in);
    c10::IValue value;
    if (!archive.try_read(kCheckpointRecord, value))
      throw InvalidArgument(fmt::format("{}: not an FSDP checkpoint (no {} record; ShardedOptimizer's are loaded with "
                                        "ShardedOptimizer::load)",
                                        path, kCheckpointRecord));
    record = nlohmann::json::parse(value.toStringRef());
    if (record.at("kind").get<std::string>() != kind)
      throw InvalidArgument(fmt::format("{}: the checkpoint holds {} state; this optimizer is {}", path,
                                        record.at("kind").get<std::string>(), kind));
    c10::IValue buffers;
    if (!archive.try_read(kCheckpointBuffers, buffers))
      throw InvalidArgument(fmt::format("{}: a damaged FSDP checkpoint: no {}", path, kCheckpointBuffers));
    for (const auto& b : buffers.toTensorList()) stored_buffers.push_back(b);
    buffer_names = record.at("buffers").get<std::vector<std::string>>();
    old_world = record.at("world").get<int>();
    global_step = record.at("global_step").get<int64_t>();
    if (old_world < 1) throw InvalidArgument(fmt::format("{}: a damaged FSDP record: world size {}", path, old_world));
  } catch (const c10::Error& e) {
    throw InvalidArgument(fmt::format("{}: cannot load into this model: {}", path, e.what_without_backtrace()));
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(fmt::format("{}: a damaged FSDP record: {}", path, e.what()));
  }
  const auto mine = module_->named_buffers(true);
  if (buffer_names.size() != stored_buffers.size())
    throw InvalidArgument(fmt::format("{}: a damaged FSDP checkpoint: {} buffer names, {} buffers", path,
                                      buffer_names.size(), stored_buffers.size()));
  for (size_t i = 0; i < std::max(buffer_names.size(), mine.size()); ++i) {
    const std::string there = i < buffer_names.size()
                                  ? fmt::format("{} [{}]", buffer_names[i], fmt::join(stored_buffers[i].sizes().vec(), ", "))
                                  : "none";
    const std::string here =
        i < mine.size() ? fmt::format("{} [{}]", mine[i].key(), fmt::join(mine[i].value().sizes().vec(), ", ")) : "none";
    if (there != here)
      throw InvalidArgument(fmt::format("{}: cannot load into this model: its buffer {} is {}, this model's is {}", path,
                                        i, there, here));
  }

  // Every old shard's header, checked against this model's parameters and its file's length.
  const CheckpointLayout layout = checkpoint_layout();
  std::vector<zero::OldShard> shards;
  for (int s = 0; s < old_world; ++s) {
    shards.push_back(zero::read_shard_header(zero::shard_path(dir, global_step, s, old_world), s, old_world, path,
                                             layout.params));
    const auto& states = shards.back().states;
    if (std::find(states.begin(), states.end(), kParameterState) == states.end())
      throw InvalidArgument(fmt::format("{}: holds no parameter values (not an FSDP shard)", shards.back().file));
  }
  std::vector<std::string> names{kParameterState};
  for (const auto& name : zero::state_names(optimizer, kind)) names.push_back(name);
  bool any_state = false;
  for (const auto& shard : shards) any_state = any_state || shard.states.size() > 1;
  // [name][unit]: fresh float32 tensors of the new shards' size; the padding stays zero.
  std::vector<std::vector<::torch::Tensor>> values(names.size());
  for (auto& per_unit : values)
    for (const auto& unit : units_) per_unit.push_back(::torch::zeros({unit->shard_numel}, ::torch::kFloat32));
  zero::read_overlaps(shards, layout.pieces, names, values);

  // Only now the model and the optimizer change. A gathered unit would hold the old weights: freed first.
  ::torch::NoGradGuard no_grad;
  for (auto& unit : units_) reshard(*unit);
  for (size_t u = 0; u < units_.size(); ++u) units_[u]->shard.copy_(values[0][u]);
  for (size_t i = 0; i < mine.size(); ++i) mine[i].value().copy_(stored_buffers[i]);
  if (any_state) {
    for (size_t u = 0; u < units_.size(); ++u) {
      std::vector<::torch::Tensor> tensors;
      for (size_t n = 1; n < names.size(); ++n) tensors.push_back(values[n][u].to(device_));  // beside its shard
      zero::set_state(optimizer, kind, units_[u]->shard, tensors, shards.back().step);
    }
  } else {
    optimizer.state().clear();  // written before the first step
  }
  return newest->position;
}

}  // namespace cohort::torch
