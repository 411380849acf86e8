// libtorch integration: DistributedDataParallel, DistributedSampler, checkpoints (one TU on purpose).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <ATen/CPUGeneratorImpl.h>
#ifdef COHORT_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include <cstring>
#include <cstdlib>
#include <malloc.h>
#include <fstream>
#include <sstream>
#include <atomic>
#include <limits>
#include <map>
#include <unordered_set>

#include "cohort/error.h"
#include "cohort/gpu.h"
#include "cohort/torch/ddp.h"
#include "common/log.h"
#include "heap_policy.h"
#include "module_sync.h"

namespace cohort::torch {

namespace {

#ifdef COHORT_TORCH_CUDA
// torch's current CUDA stream on `device` (the calling thread's, as torch keeps it): what cohort's GPU
// collectives wait for before they start, and what waits for them.
void* torch_current_stream(int device) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
}
#endif

// Whether keep_resident turned glibc's trimming off in this process.
std::atomic<bool> g_trimming_off{false};

}  // namespace

namespace heap_policy {

// M_TRIM_THRESHOLD alone would also freeze glibc's mmap threshold wherever its rise had got to (128 KiB
// in a fresh process: every activation mapped and unmapped, faulted in at every use), so the threshold
// is fixed at the top of that rise, 32 MiB (glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit). At every
// construction: a wrapper of another kind constructed since may have changed them.
void keep_resident() {
#if defined(__GLIBC__)
  if (mallopt(M_MMAP_THRESHOLD, 32 << 20) != 1 || mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max()) != 1) {
    log::warn("DDP: glibc refused to keep the heap resident (mallopt M_MMAP_THRESHOLD / M_TRIM_THRESHOLD); every "
              "step will fault its activations in again");
    return;
  }
  g_trimming_off.store(true);
#endif
}

void trim_again() {
#if defined(__GLIBC__)
  if (!g_trimming_off.exchange(false)) return;
  mallopt(M_TRIM_THRESHOLD, 128 << 10);  // glibc's DEFAULT_TRIM_THRESHOLD
  malloc_trim(0);
#endif
}

}  // namespace heap_policy

void use_torch_streams() {
#ifdef COHORT_TORCH_CUDA
  gpu::set_stream_provider(&torch_current_stream);
#endif
}

namespace {

DataType dtype_of(const ::torch::Tensor& t, const std::string& name) {
  switch (t.scalar_type()) {
    case ::torch::kFloat32: return DataType::kFloat32;
    case ::torch::kFloat64: return DataType::kFloat64;
    case ::torch::kInt64: return DataType::kInt64;
    case ::torch::kInt32: return DataType::kInt32;
    case ::torch::kUInt8: return DataType::kUInt8;
    case ::torch::kInt8: return DataType::kInt8;
    case ::torch::kFloat16: return DataType::kFloat16;
    case ::torch::kBFloat16: return DataType::kBFloat16;
    default:
      throw InvalidArgument(fmt::format("DDP: tensor {} has dtype {}, which cohort cannot broadcast", name,
                                        std::string(c10::toString(t.scalar_type()))));
  }
}

void broadcast_tensor(::torch::Tensor t, const std::string& name, Communicator& comm) {
  if (!t.defined() || t.numel() == 0) return;
  if (t.device().is_cuda() && gpu::device_of(comm) < 0)
    throw InvalidArgument(fmt::format("DDP: tensor {} is on {} but the communicator takes host buffers only (wrap it "
                                      "with cohort::gpu::make_device_communicator)",
                                      name, t.device().str()));
  if (!t.device().is_cpu() && !t.device().is_cuda())
    throw InvalidArgument(fmt::format("DDP: tensor {} is on {}; cohort moves CPU and CUDA tensors", name, t.device().str()));
  DataType dt = dtype_of(t, name);
  if (t.is_contiguous()) {
    comm.broadcast(t.data_ptr(), static_cast<size_t>(t.numel()), dt, 0);
  } else {
    ::torch::Tensor tmp = t.contiguous();
    comm.broadcast(tmp.data_ptr(), static_cast<size_t>(tmp.numel()), dt, 0);
    t.copy_(tmp);
  }
}

}  // namespace

std::shared_ptr<Communicator> communicator_for_device(std::shared_ptr<Communicator> comm, const ::torch::Device& device,
                                                      const char* who) {
  if (!device.is_cuda()) return comm;
  const int index = device.has_index() ? device.index() : 0;
  use_torch_streams();
  if (gpu::device_of(*comm) < 0) return gpu::make_device_communicator(std::move(comm), {index, gpu::DevicePath::kAuto});
  if (gpu::device_of(*comm) != index)
    throw InvalidArgument(fmt::format("{}: the model is on cuda:{} but the communicator uses GPU {}", who, index,
                                      gpu::device_of(*comm)));
  return comm;
}

void broadcast_module(::torch::nn::Module& module, Communicator& comm) {
  if (comm.size() == 1) return;
  ::torch::NoGradGuard no_grad;
  for (auto& p : module.named_parameters(true)) broadcast_tensor(p.value(), p.key(), comm);
  for (auto& b : module.named_buffers(true)) broadcast_tensor(b.value(), b.key(), comm);
}

// Post hook on a parameter's AccumulateGrad node: runs after .grad holds this backward's gradient.
struct DistributedDataParallel::Hook : ::torch::autograd::FunctionPostHook {
  Hook(DistributedDataParallel* ddp, size_t index) : ddp(ddp), index(index) {}
  ::torch::autograd::variable_list operator()(const ::torch::autograd::variable_list& outputs,
                                              const ::torch::autograd::variable_list& /*inputs*/) override {
    ddp->on_gradient_ready(index);
    return outputs;
  }
  DistributedDataParallel* ddp;
  size_t index;
};

void DistributedDataParallel::init() {
  if (!comm_) throw InvalidArgument("DDP: communicator is null");
  std::vector<train::ParameterSpec> specs;
  std::optional<::torch::Device> device;
  std::string first_name;
  for (auto& p : module_->named_parameters(true)) {
    if (!p.value().requires_grad()) continue;  // frozen parameters are not synchronised (as in torch)
    const ::torch::Device d = p.value().device();
    if (p.value().scalar_type() != ::torch::kFloat32 || !(d.is_cpu() || d.is_cuda()))
      throw InvalidArgument(fmt::format("DDP: parameter {} must be a float32 tensor on the CPU or a GPU, not {} on {}",
                                        p.key(), std::string(c10::toString(p.value().scalar_type())), d.str()));
    if (device && *device != d)
      throw InvalidArgument(fmt::format("DDP: parameter {} is on {} but {} is on {}: one device per model replica",
                                        p.key(), d.str(), first_name, device->str()));
    if (!device) device = d, first_name = p.key();
    specs.push_back({p.key(), p.value().sizes().vec()});
    params_.push_back(p.value());
  }
  device_ = device.value_or(::torch::Device(::torch::kCPU));
  if (options_.keep_heap_resident && device_.is_cpu()) heap_policy::keep_resident();
  train::GradSyncOptions o;
  if (device_.is_cuda()) {
    // A model on a GPU: buckets in its memory, reduced by NCCL. A host communicator is wrapped here, so
    // the four-step conversion stays the same.
    comm_ = communicator_for_device(comm_, device_, "DDP");
    o.memory = train::gpu_bucket_memory(gpu::device_of(*comm_));
  }
  o.bucket_cap_bytes = options_.bucket_cap_bytes;
  o.first_bucket_cap_bytes = options_.first_bucket_cap_bytes;
  o.compression = options_.compression;
  o.find_unused_parameters = options_.find_unused_parameters;
  o.rebuild_buckets = options_.rebuild_buckets;
  // The name/shape check comes first so that a mismatch is reported as such, not as a broadcast
  // of the wrong size.
  sync_ = std::make_unique<train::GradientSync>(comm_, std::move(specs), o);
  broadcast_module(*module_, *comm_);
  contiguous_grads_.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    auto acc = ::torch::autograd::impl::grad_accumulator(params_[i]);
    if (!acc) throw InvalidArgument(fmt::format("DDP: parameter #{} has no gradient accumulator", i));
    hook_keys_.push_back(acc->add_post_hook(std::make_unique<Hook>(this, i)));
    accumulators_.push_back(std::move(acc));
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
}

void DistributedDataParallel::before_forward() {
  // Tensor::set_ (which torch::nn::Module::load uses to restore parameters) gives a parameter a new
  // gradient accumulator, silently dropping our hook: move the hooks to the current accumulators.
  for (size_t i = 0; i < params_.size(); ++i) {
    auto current = ::torch::autograd::impl::grad_accumulator(params_[i]);
    if (current == accumulators_[i]) continue;
    accumulators_[i]->del_post_hook(hook_keys_[i]);
    hook_keys_[i] = current->add_post_hook(std::make_unique<Hook>(this, i));
    accumulators_[i] = std::move(current);
  }
  // The previous backward left buckets unreduced: some parameter got no gradient.
  if (sync_->sync_enabled() && sync_->in_iteration()) finish_gradient_sync();
  if (options_.broadcast_buffers && sync_->sync_enabled() && ::torch::GradMode::is_enabled() && comm_->size() > 1)
    broadcast_buffers();
}

void DistributedDataParallel::broadcast_buffers() { cohort::torch::broadcast_buffers(*module_, *comm_); }

void broadcast_buffers(::torch::nn::Module& module, Communicator& comm) {
  ::torch::NoGradGuard no_grad;
  // Packed by dtype: one broadcast of each kind instead of one per buffer (a ResNet-18 has 60).
  std::map<::torch::ScalarType, std::vector<::torch::Tensor>> by_dtype;
  for (auto& b : module.buffers(true))
    if (b.defined() && b.numel() > 0) by_dtype[b.scalar_type()].push_back(b);
  for (auto& [dtype, buffers] : by_dtype) {
    std::vector<::torch::Tensor> flat;
    for (auto& b : buffers) flat.push_back(b.reshape({-1}));
    ::torch::Tensor packed = ::torch::cat(flat);
    broadcast_tensor(packed, "buffers", comm);
    int64_t at = 0;
    for (auto& b : buffers) {
      b.copy_(packed.narrow(0, at, b.numel()).view(b.sizes()));
      at += b.numel();
    }
  }
}

void DistributedDataParallel::after_forward(const ::torch::Tensor& out) {
  if (!options_.find_unused_parameters || !sync_->sync_enabled() || !::torch::GradMode::is_enabled() ||
      !out.requires_grad() || !out.grad_fn())
    return;
  // Parameters whose AccumulateGrad node is not reachable from the output get no gradient in this
  // backward: they contribute zeros now, so the last used parameter's hook can finish the sync.
  std::unordered_set<const ::torch::autograd::Node*> seen;
  std::vector<::torch::autograd::Node*> stack{out.grad_fn().get()};
  seen.insert(stack.back());
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      auto* next = edge.function.get();
      if (next && seen.insert(next).second) stack.push_back(next);
    }
  }
  for (size_t i = 0; i < params_.size(); ++i)
    if (!seen.count(accumulators_[i].get())) sync_->mark_unused(i);
}

void DistributedDataParallel::on_gradient_ready(size_t index) {
  if (!sync_->sync_enabled()) return;
  ::torch::Tensor grad = params_[index].grad();
  if (!grad.defined()) return;
  if (!grad.is_contiguous() || grad.scalar_type() != ::torch::kFloat32) {
    contiguous_grads_[index] = grad.to(::torch::kFloat32).contiguous();
    grad = contiguous_grads_[index];
  }
  sync_->mark_ready(index, grad.data_ptr<float>());
  if (sync_->sharding_stage() == 2) {
    // The gradient is in its bucket now, on its way to the rank that owns it: free it here.
    params_[index].mutable_grad().reset();
    contiguous_grads_[index] = ::torch::Tensor();
  } else if (options_.gradient_as_bucket_view && !contiguous_grads_[index].defined()) {
    bind_to_bucket(index);
  }
  if (!sync_->all_ready()) return;
  // With the fused update the optimizer's step reduces (step_fused).
  if (sync_->sharding_stage() > 0) {
    sync_->finish_sharded();
    contiguous_grads_.assign(params_.size(), ::torch::Tensor());
  } else if (!sync_->fused_update()) {
    sync_->finish([this](size_t i, const float* avg) { write_back(i, avg); });
  }
}

void DistributedDataParallel::enable_sharding(int stage) {
  if (sync_->sharding_stage() == stage) return;
  sync_->enable_sharding(stage);
  bind_parameters();
  if (stage == 2) {
    ::torch::NoGradGuard no_grad;
    for (auto& p : params_) p.mutable_grad().reset();  // stage 2 keeps no whole-model gradient
  }
  // The parameters' (and gradients') own storage was just freed: they live in bucket memory now.
  return_freed_memory();
}

void DistributedDataParallel::return_freed_memory(size_t at_least_bytes) {
  // glibc keeps freed heap memory resident (it trims only the top of the heap by itself), and most of
  // a model's tensors are below its mmap threshold: memory nothing uses any more would stay in the
  // process's RSS. Host memory only; a no-op with another C library.
#if defined(__GLIBC__)
  if (!device_.is_cpu()) return;
  if (at_least_bytes > 0 && mallinfo2().fordblks < at_least_bytes) return;
  malloc_trim(0);
#else
  (void)at_least_bytes;
#endif
}

void DistributedDataParallel::return_heap_growth(size_t grown_by) {
#if defined(__GLIBC__)
  if (!device_.is_cpu()) return;
  // fordblks counts the free chunks, resident or not: malloc_trim releases their pages, not them.
  const size_t free_now = mallinfo2().fordblks;
  if (free_now < free_heap_at_trim_ + grown_by) return;
  malloc_trim(0);
  free_heap_at_trim_ = free_now;
#else
  (void)grown_by;
#endif
}

void DistributedDataParallel::enable_fused_update() {
  if (!device_.is_cpu()) throw InvalidArgument("DDP: the fused SGD step is for models on the CPU");
  if (sync_->fused_update()) return;
  sync_->enable_fused_update();
  bind_parameters();
}

void DistributedDataParallel::bind_parameters() {
  if (!sync_->fused_update() && sync_->sharding_stage() == 0) return;
  ::torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    std::shared_ptr<float> slot = sync_->parameter_slot(i);
    ::torch::Tensor& param = params_[i];
    if (param.data_ptr<float>() == slot.get()) continue;
    // The current values (also after a bucket rebuild moved the slot, or a checkpoint load replaced
    // the tensor) go into the slot, and the parameter becomes a view of it: the same Variable, so
    // the optimizer and the module keep it, with new storage (what Python's `p.data = ...` does).
    float* data = slot.get();
    ::torch::Tensor view = ::torch::from_blob(data, param.sizes(), [keep = std::move(slot)](void*) mutable { keep.reset(); },
                                              ::torch::TensorOptions().dtype(::torch::kFloat32).device(device_));
    if (device_.is_cpu()) {
      ::torch::Tensor current = param.detach().contiguous();
      std::memcpy(data, current.data_ptr<float>(), static_cast<size_t>(param.numel()) * sizeof(float));
    } else {
      view.copy_(param.detach());
    }
    param.set_data(view);
  }
}

bool DistributedDataParallel::parameter_is_bucket_view(size_t index) const {
  std::shared_ptr<float> slot = sync_->parameter_slot(index);
  return slot && params_.at(index).data_ptr<float>() == slot.get();
}

bool DistributedDataParallel::step_fused(const train::SgdStep& step) {
  if (!sync_->fused_update() || !sync_->sync_enabled() || !sync_->in_iteration()) return false;
  bind_parameters();  // a checkpoint loaded since the last step replaced some tensors
  const bool stepped = sync_->finish_update([step](size_t, size_t count, const float* reduced, float* params) {
    train::sgd_step(params, reduced, count, step);
  });
  // In place, behind autograd's back: tell it, as an in-place optimizer step would have.
  if (stepped)
    for (auto& p : params_) p.unsafeGetTensorImpl()->bump_version();
  bind_parameters();  // the first step rebuilds the buckets in gradient-ready order: new slots
  return stepped;
}

// Makes .grad a view of the parameter's bucket slot, which now holds the same values (mark_ready
// copied them, or they were there already). Later backwards accumulate in place into the slot.
void DistributedDataParallel::bind_to_bucket(size_t index) {
  std::shared_ptr<float> slot = sync_->gradient_slot(index);
  ::torch::Tensor& grad = params_[index].mutable_grad();
  if (!slot || grad.data_ptr<float>() == slot.get()) return;
  float* data = slot.get();
  grad = ::torch::from_blob(data, params_[index].sizes(), [keep = std::move(slot)](void*) mutable { keep.reset(); },
                            ::torch::TensorOptions().dtype(::torch::kFloat32).device(device_));
}

bool DistributedDataParallel::gradient_is_bucket_view(size_t index) const {
  std::shared_ptr<float> slot = sync_->gradient_slot(index);
  const ::torch::Tensor& grad = params_.at(index).grad();
  return slot && grad.defined() && grad.data_ptr<float>() == slot.get();
}

void DistributedDataParallel::zero_grad() {
  ::torch::NoGradGuard no_grad;
  // Every .grad is released, bucket views too. Backward then hands its fresh gradient over, the hook
  // copies it into the bucket slot (mark_ready: one read, one write) and makes .grad the slot's view
  // again. A view zeroed in place would cost a memset and then backward's add into it (two reads, two
  // writes over the model): on 2 ranks that was what the one-process loop no longer paid (issue 51).
  // Before the rebuild after the first iteration this also frees the old buckets' memory before the
  // new buckets take theirs.
  const bool rebuilding = sync_->rebuild_pending();
  for (size_t i = 0; i < params_.size(); ++i) {
    ::torch::Tensor& grad = params_[i].mutable_grad();
    if (!grad.defined()) continue;
    grad.reset();
    contiguous_grads_[i] = ::torch::Tensor();
  }
  // Once, after the first iteration: the optimizer's first step has just created its state tensor by
  // tensor between its temporaries, and left the heap in holes that glibc keeps (355 MB free per rank
  // on BERT-base with Adam, a fifth of the model's states); later steps allocate nothing lasting.
  if (rebuilding) return_freed_memory(size_t{64} << 20);
}

void DistributedDataParallel::write_back(size_t index, const float* averaged) {
  ::torch::NoGradGuard no_grad;
  ::torch::Tensor& param = params_[index];
  ::torch::Tensor& grad = param.mutable_grad();
  if (!grad.defined()) grad = ::torch::zeros_like(param);
  if (grad.is_contiguous() && grad.scalar_type() == ::torch::kFloat32 && grad.data_ptr<float>() == averaged) {
    // a bucket view: the average is already there
  } else if (grad.is_contiguous() && grad.scalar_type() == ::torch::kFloat32 && device_.is_cpu()) {
    std::memcpy(grad.data_ptr<float>(), averaged, static_cast<size_t>(grad.numel()) * sizeof(float));
  } else {
    grad.copy_(::torch::from_blob(const_cast<float*>(averaged), grad.sizes(),
                                  ::torch::TensorOptions().dtype(::torch::kFloat32).device(device_)));
  }
  contiguous_grads_[index] = ::torch::Tensor();
}

void DistributedDataParallel::finish_gradient_sync() {
  if (!sync_->in_iteration()) return;
  if (sync_->sharding_stage() > 0) {
    sync_->finish_sharded();
    contiguous_grads_.assign(params_.size(), ::torch::Tensor());
    return;
  }
  sync_->finish([this](size_t i, const float* avg) { write_back(i, avg); });
}

// ---------------------------------------------------------------------------------------------
std::vector<int64_t> torch_randperm(int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  ::torch::Tensor p = ::torch::randperm(n, gen, ::torch::TensorOptions().dtype(::torch::kLong));
  return std::vector<int64_t>(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + n);
}

DistributedSampler::DistributedSampler(size_t size, int num_replicas, int rank, bool shuffle, uint64_t seed,
                                       bool drop_last)
    : sampler_(static_cast<int64_t>(size), num_replicas, rank, shuffle, seed, drop_last, torch_randperm),
      size_(size),
      num_replicas_(num_replicas),
      rank_(rank),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last) {
  reset();
}

void DistributedSampler::set_epoch(int64_t epoch) {
  sampler_.set_epoch(epoch);
  reset();
}

void DistributedSampler::reset(c10::optional<size_t> new_size) {
  if (new_size && *new_size != size_) {
    int64_t epoch = sampler_.epoch();
    size_ = *new_size;
    sampler_ = train::DistributedSampler(static_cast<int64_t>(size_), num_replicas_, rank_, shuffle_, seed_, drop_last_,
                                         torch_randperm);
    sampler_.set_epoch(epoch);
  }
  current_ = sampler_.indices();
  cursor_ = 0;
}

c10::optional<std::vector<size_t>> DistributedSampler::next(size_t batch_size) {
  if (cursor_ >= current_.size()) return c10::nullopt;
  size_t end = std::min(current_.size(), cursor_ + batch_size);
  std::vector<size_t> batch(current_.begin() + static_cast<std::ptrdiff_t>(cursor_),
                            current_.begin() + static_cast<std::ptrdiff_t>(end));
  cursor_ = end;
  return batch;
}

void DistributedSampler::save(::torch::serialize::OutputArchive& archive) const {
  archive.write("epoch", ::torch::tensor(sampler_.epoch(), ::torch::kLong), /*is_buffer=*/true);
  archive.write("cursor", ::torch::tensor(static_cast<int64_t>(cursor_), ::torch::kLong), true);
}

void DistributedSampler::load(::torch::serialize::InputArchive& archive) {
  ::torch::Tensor epoch, cursor;
  archive.read("epoch", epoch, true);
  archive.read("cursor", cursor, true);
  set_epoch(epoch.item<int64_t>());
  cursor_ = static_cast<size_t>(cursor.item<int64_t>());
}

// ---------------------------------------------------------------------------------------------
void save_checkpoint(const std::string& dir, ::torch::nn::Module& module, ::torch::optim::Optimizer& optimizer,
                     const train::TrainingPosition& position) {
  ::torch::serialize::OutputArchive archive;
  module.save(archive);
  ::torch::serialize::OutputArchive opt_archive;
  optimizer.save(opt_archive);
  archive.write("__cohort_optimizer", opt_archive);
  std::ostringstream out;
  archive.save_to(out);
  train::write_checkpoint(dir, position, out.str());
}

std::optional<train::TrainingPosition> load_checkpoint(const std::string& dir, ::torch::nn::Module& module,
                                                       ::torch::optim::Optimizer& optimizer) {
  auto newest = train::newest_complete_checkpoint(dir);
  if (!newest) return std::nullopt;
  const std::string& path = newest->path;
  const std::string& payload = newest->payload;
  train::TrainingPosition pos = newest->position;
  for (const auto& why : newest->skipped) fmt::print(stderr, "checkpoint: skipped {}\n", why);
  // Module::load replaces tensors with set_ and does not compare shapes: check them ourselves.
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  for (auto& p : module.named_parameters(true)) shapes.emplace_back(p.key(), p.value().sizes().vec());
  for (auto& b : module.named_buffers(true)) shapes.emplace_back(b.key(), b.value().sizes().vec());
  try {
    ::torch::serialize::InputArchive archive;
    std::istringstream in(payload);
    archive.load_from(in);
    module.load(archive);
    size_t i = 0;
    auto check = [&](const std::string& key, const ::torch::Tensor& t) {
      const auto& [name, shape] = shapes[i++];
      if (t.sizes().vec() != shape)
        throw InvalidArgument(fmt::format("{}: cannot load into this model: {} is [{}] in the checkpoint but [{}] in the model",
                                          path, name, fmt::join(t.sizes().vec(), ", "), fmt::join(shape, ", ")));
    };
    for (auto& p : module.named_parameters(true)) check(p.key(), p.value());
    for (auto& b : module.named_buffers(true)) check(b.key(), b.value());
    ::torch::serialize::InputArchive opt_archive;
    archive.read("__cohort_optimizer", opt_archive);
    optimizer.load(opt_archive);
  } catch (const c10::Error& e) {
    throw InvalidArgument(fmt::format("{}: cannot load into this model/optimizer: {}", path, e.what_without_backtrace()));
  }
  return pos;
}

int restart_count() {
  for (const char* v : {"COHORT_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"})
    if (const char* s = std::getenv(v); s && *s) return std::atoi(s);
  return 0;
}

std::optional<train::TrainingPosition> resume_after_restart(const std::string& dir, ::torch::nn::Module& module,
                                                            ::torch::optim::Optimizer& optimizer) {
  if (dir.empty() || restart_count() == 0) return std::nullopt;
  return load_checkpoint(dir, module, optimizer);
}

std::string blas_in_use() {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    std::string path = line.substr(slash);
    if (path.find("blas") != std::string::npos || path.find("libmkl") != std::string::npos) return path;
  }
  return "";
}

}  // namespace cohort::torch
