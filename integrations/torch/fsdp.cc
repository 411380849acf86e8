// cohort::torch::FullyShardedDataParallel (ZeRO stage 3): the design is in the header and in
// docs/training.md, "Fully sharded data parallel".
#include "cohort/torch/fsdp.h"

#include <fmt/format.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <typeinfo>
#include <unordered_set>

#include "cohort/torch/ddp.h"  // broadcast_module

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
  const int world = comm_->size(), rank = comm_->rank();
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  for (auto& p : module_->named_parameters(true)) {
    const ::torch::Tensor& t = p.value();
    if (!t.requires_grad() || t.scalar_type() != ::torch::kFloat32 || !t.device().is_cpu())
      throw InvalidArgument(fmt::format("FSDP: parameter {} must be a trainable float32 tensor on the CPU, not {}{} on {}",
                                        p.key(), t.requires_grad() ? "" : "a frozen ",
                                        std::string(c10::toString(t.scalar_type())), t.device().str()));
    names.emplace(t.unsafeGetTensorImpl(), p.key());
  }
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
    ::torch::Tensor flat = ::torch::zeros({unit.shard_numel * world}, ::torch::kFloat32);  // the padding stays zero
    for (size_t i = 0; i < unit.params.size(); ++i)
      flat.narrow(0, unit.offsets[i], unit.params[i].numel()).copy_(unit.params[i].detach().reshape({-1}));
    unit.shard = flat.narrow(0, rank * unit.shard_numel, unit.shard_numel).clone().set_requires_grad(true);
    unit.full = options_.compute_dtype == ::torch::kFloat32 ? flat : ::torch::empty({flat.numel()}, options_.compute_dtype);
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
  ::torch::Tensor flat = ::torch::zeros({unit.shard_numel * world}, ::torch::kFloat32);
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
  } else {
    unit.grad_slice = ::torch::empty({unit.shard_numel}, ::torch::kFloat32);
    unit.reducing = comm_->reduce_scatter_async(flat.data_ptr<float>(), unit.grad_slice.data_ptr<float>(),
                                                static_cast<size_t>(unit.shard_numel), DataType::kFloat32, ReduceOp::kSum);
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
  const double world = comm_->size();
  ::torch::Tensor average = unit.grad_slice.div_(world);  // summed over the ranks: the mean, as DDP's
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
  double sum = 0;
  for (auto& unit : units_)
    if (unit->shard.grad().defined()) sum += unit->shard.grad().to(::torch::kFloat64).pow(2).sum().item<double>();
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
    ::torch::Tensor all = ::torch::empty({unit->shard_numel * world}, ::torch::kFloat32);
    if (world == 1) all.copy_(unit->shard);
    else
      comm_->allgather(unit->shard.data_ptr<float>(), all.data_ptr<float>(), static_cast<size_t>(unit->shard_numel),
                       DataType::kFloat32);
    for (size_t i = 0; i < unit->params.size(); ++i)
      by_name[unit->param_names[i]] = all.narrow(0, unit->offsets[i], unit->params[i].numel()).view(unit->params[i].sizes()).clone();
  }
  std::vector<std::pair<std::string, ::torch::Tensor>> out;
  for (const auto& p : module_->named_parameters(true)) out.emplace_back(p.key(), by_name.at(p.key()));
  for (const auto& b : module_->named_buffers(true)) out.emplace_back(b.key(), b.value().clone());
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

}  // namespace cohort::torch
