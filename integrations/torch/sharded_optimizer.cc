// cohort::torch::ShardedOptimizer (ZeRO stages 1 and 2): the design is in the header and in
// docs/training.md, "The sharded optimizer".
#include "cohort/torch/sharded_optimizer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <sstream>
#include <type_traits>
#include <tuple>

#include "cohort/error.h"
#include "zero_shards.h"

namespace cohort::torch {

namespace {

constexpr size_t kDescriptionBytes = 256;  // a configuration's text, as every rank compares it

// This rank's chunks as runs of parameters (the padding at a bucket's end belongs to none).
std::vector<zero::Piece> pieces_of(const train::GradientSync& sync) {
  const auto layout = sync.bucket_layout();
  const auto& params = sync.parameters();
  const auto chunks = sync.shard_chunks();
  std::vector<zero::Piece> out;
  size_t position = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const auto& chunk = chunks[c];
    const size_t lo = chunk.bucket_offset, hi = chunk.bucket_offset + chunk.count;
    size_t at = 0;  // where the current parameter starts in the bucket
    for (size_t index : layout[chunk.bucket]) {
      const size_t n = params[index].numel();
      const size_t from = std::max(lo, at), to = std::min(hi, at + n);
      if (from < to) out.push_back({index, from - at, to - from, position + (from - lo), c, from - lo});
      at += n;
    }
    position += chunk.count;
  }
  return out;
}

std::string format_double(double v) { return fmt::format("{}", v); }

// What Module::load(archive) would stop at or change the shape of, found without changing `module`: ""
// when the archive holds every parameter and buffer with the module's shape. Module::load replaces
// tensors with set_, compares no shapes, and stops at the first missing tensor with the earlier ones
// already replaced; this walks the module tree the way it does.
std::string archive_mismatch(const ::torch::nn::Module& module, ::torch::serialize::InputArchive& archive,
                             const std::string& prefix) {
  auto check = [&](const std::string& key, const ::torch::Tensor& tensor, bool is_buffer) -> std::string {
    ::torch::Tensor stored;
    if (!archive.try_read(key, stored, is_buffer)) return fmt::format("{}{} is not in the checkpoint", prefix, key);
    if (stored.sizes() != tensor.sizes())
      return fmt::format("{}{} is [{}] in the checkpoint, [{}] in this model", prefix, key,
                         fmt::join(stored.sizes().vec(), ", "), fmt::join(tensor.sizes().vec(), ", "));
    return "";
  };
  for (const auto& p : module.named_parameters(/*recurse=*/false))
    if (auto why = check(p.key(), p.value(), false); !why.empty()) return why;
  for (const auto& b : module.named_buffers(/*recurse=*/false))
    if (auto why = check(b.key(), b.value(), true); !why.empty()) return why;
  for (const auto& child : module.named_children()) {
    if (!child.value()->is_serializable()) continue;
    ::torch::serialize::InputArchive child_archive;
    if (!archive.try_read(child.key(), child_archive))
      return fmt::format("{}{} is not in the checkpoint", prefix, child.key());
    if (auto why = archive_mismatch(*child.value(), child_archive, prefix + child.key() + "."); !why.empty()) return why;
  }
  return "";
}

}  // namespace

ShardedOptimizer::ShardedOptimizer(DistributedDataParallel& ddp, ::torch::optim::SGDOptions o, ShardedOptions sharding)
    : ShardedOptimizer(ddp, "sgd",
                       fmt::format("lr={} momentum={} dampening={} weight_decay={} nesterov={}", format_double(o.lr()),
                                   format_double(o.momentum()), format_double(o.dampening()),
                                   format_double(o.weight_decay()), o.nesterov()),
                       [o](std::vector<::torch::Tensor> chunks) -> std::unique_ptr<::torch::optim::Optimizer> {
                         return std::make_unique<::torch::optim::SGD>(std::move(chunks), o);
                       },
                       sharding) {}

ShardedOptimizer::ShardedOptimizer(DistributedDataParallel& ddp, ::torch::optim::AdamOptions o, ShardedOptions sharding)
    : ShardedOptimizer(ddp, "adam",
                       fmt::format("lr={} betas=({}, {}) eps={} weight_decay={} amsgrad={}", format_double(o.lr()),
                                   format_double(std::get<0>(o.betas())), format_double(std::get<1>(o.betas())),
                                   format_double(o.eps()), format_double(o.weight_decay()), o.amsgrad()),
                       [o](std::vector<::torch::Tensor> chunks) -> std::unique_ptr<::torch::optim::Optimizer> {
                         return std::make_unique<::torch::optim::Adam>(std::move(chunks), o);
                       },
                       sharding) {}

ShardedOptimizer::ShardedOptimizer(DistributedDataParallel& ddp, ::torch::optim::AdamWOptions o, ShardedOptions sharding)
    : ShardedOptimizer(ddp, "adamw",
                       fmt::format("lr={} betas=({}, {}) eps={} weight_decay={} amsgrad={}", format_double(o.lr()),
                                   format_double(std::get<0>(o.betas())), format_double(std::get<1>(o.betas())),
                                   format_double(o.eps()), format_double(o.weight_decay()), o.amsgrad()),
                       [o](std::vector<::torch::Tensor> chunks) -> std::unique_ptr<::torch::optim::Optimizer> {
                         return std::make_unique<::torch::optim::AdamW>(std::move(chunks), o);
                       },
                       sharding) {}

ShardedOptimizer::ShardedOptimizer(DistributedDataParallel& ddp, std::string kind, std::string options_text,
                                   Factory factory, ShardedOptions sharding)
    : ddp_(ddp), kind_(std::move(kind)), options_text_(std::move(options_text)), stage_(sharding.stage) {
  if (stage_ != 1 && stage_ != 2)
    throw InvalidArgument(fmt::format("sharded optimizer: stage {} does not exist (1: optimizer state sharded, "
                                      "2: gradients too)",
                                      stage_));
  // The whole configuration first, so that a difference is said as such rather than as a stage.
  check_same_configuration();
  ddp_.enable_sharding(stage_);
  const auto options = ::torch::TensorOptions().dtype(::torch::kFloat32).device(ddp_.device());
  for (const auto& chunk : ddp_.sync().shard_chunks()) {
    // Views of the DDP's bucket memory, which lives as long as the DDP (no rebuild in sharded mode).
    ::torch::Tensor p = ::torch::from_blob(chunk.parameters, {static_cast<int64_t>(chunk.count)}, options);
    p.set_requires_grad(true);
    p.mutable_grad() = ::torch::from_blob(chunk.gradients, {static_cast<int64_t>(chunk.count)}, options);
    chunks_.push_back(p);
  }
  optimizer_ = factory(chunks_);
}

std::string ShardedOptimizer::describe() const {
  return fmt::format("{} {}, stage {}", kind_, options_text_, stage_);
}

void ShardedOptimizer::check_same_configuration() {
  Communicator& comm = ddp_.communicator();
  const int size = comm.size();
  if (size == 1) return;
  std::string mine = describe();
  mine.resize(kDescriptionBytes, '\0');
  std::string all(kDescriptionBytes * static_cast<size_t>(size), '\0');
  comm.allgather(mine.data(), all.data(), kDescriptionBytes, DataType::kUInt8);
  auto text = [&](int r) { return std::string(all.c_str() + static_cast<size_t>(r) * kDescriptionBytes); };
  for (int r = 1; r < size; ++r)
    if (text(r) != text(0))
      throw MismatchError(fmt::format("sharded optimizer: the configuration differs between ranks: rank 0 has '{}' "
                                      "but rank {} has '{}'",
                                      text(0), r, text(r)));
}

void ShardedOptimizer::zero_grad() {
  // The model's .grad are released (stage 1: backward copies the fresh ones into the buckets and makes
  // .grad their views again; stage 2: the gradients live in the buckets, then in the chunks).
  ddp_.zero_grad();
  ::torch::NoGradGuard no_grad;
  for (auto& c : chunks_) c.mutable_grad().zero_();
}

void ShardedOptimizer::step() {
  ddp_.finish_gradient_sync();  // normally done by the last gradient's hook
  ddp_.bind_parameters();       // a checkpoint loaded with Module::load replaced some tensors
  {
    ::torch::NoGradGuard no_grad;
    create_state();  // nothing once the state exists (after the first step, or a checkpoint's)
    optimizer_->step();
  }
  ddp_.sync().gather_parameters();
  // In place, behind autograd's back: tell it, as an in-place optimizer step would have.
  for (auto& p : ddp_.parameters()) p.unsafeGetTensorImpl()->bump_version();
  // Stage 2: backward made a fresh gradient for every parameter and freed it once it was in its
  // bucket, and the step made temporaries. Their sizes differ, so the heap grows step by step, to a
  // high-water mark near the whole model's gradients (460 MB of free heap per rank after each BERT-base
  // step) that glibc keeps: the memory stage 2 is there to save. It is given back when it grew by more
  // than a few buckets' worth since the last time, not after every step: most of a step's free heap
  // is taken again by the next one, and given back it was faulted in again page by page (BERT-mini,
  // 2 ranks: about 11,000 more page faults per step and rank than DDP, the trim every step since its
  // free heap after a step, 64-110 MB, is never under the threshold). (Given back before the step
  // instead, the peak was 100 MB higher: measured, not explained.)
  // Stage 1: once, after the first step. That step created the optimizer's state tensor by tensor
  // between its temporaries, which left the heap in holes (460 MB free per rank on BERT-base, Adam);
  // later steps allocate nothing lasting, so the holes only ever serve the next forward's activations.
  if (stage_ == 2) ddp_.return_heap_growth(size_t{64} << 20);
  else if (!stepped_) ddp_.return_freed_memory(size_t{64} << 20);
  stepped_ = true;
}

double ShardedOptimizer::clip_grad_norm(double max_norm) {
  ddp_.finish_gradient_sync();
  ::torch::NoGradGuard no_grad;
  double sum = 0;
  for (auto& c : chunks_) sum += c.grad().to(::torch::kFloat64).pow(2).sum().item<double>();
  Communicator& comm = ddp_.communicator();
  if (comm.size() > 1) comm.allreduce(&sum, &sum, 1, DataType::kFloat64, ReduceOp::kSum);
  const double norm = std::sqrt(sum);
  const double coef = max_norm / (norm + 1e-6);  // torch::nn::utils::clip_grad_norm_'s rule
  if (coef < 1)
    for (auto& c : chunks_) c.mutable_grad().mul_(coef);
  return norm;
}

void ShardedOptimizer::set_lr(double lr) {
  for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
}

double ShardedOptimizer::lr() const { return optimizer_->param_groups().at(0).options().get_lr(); }

int64_t ShardedOptimizer::shard_numel() const {
  int64_t n = 0;
  for (const auto& c : chunks_) n += c.numel();
  return n;
}

std::vector<std::string> ShardedOptimizer::state_names() const { return zero::state_names(*optimizer_, kind_); }

// The state tensor `name` of chunk `chunk`, or an undefined tensor before the first step (and for
// SGD without momentum, which keeps none).
::torch::Tensor ShardedOptimizer::state_tensor(size_t chunk, const std::string& name) const {
  return zero::state_tensor(*optimizer_, kind_, chunks_.at(chunk), name);
}

int64_t ShardedOptimizer::state_step() const {
  return chunks_.empty() ? 0 : zero::state_step(*optimizer_, kind_, chunks_.front());
}

void ShardedOptimizer::set_state(size_t chunk, const std::vector<::torch::Tensor>& tensors, int64_t step) {
  zero::set_state(*optimizer_, kind_, chunks_.at(chunk), tensors, step);
}

// Adam's and AdamW's state, made before their first step as they would make it (zeros, step 0), but in
// one allocation: libtorch makes it tensor by tensor between each tensor's temporaries, which left the
// heap in holes that raised the first step's peak by about as much as the state itself (stage 1,
// BERT-base, Adam: 2044 MB peak RSS per rank, 1490 MB after the step). SGD's momentum buffer starts
// as a copy of the first gradient, not zeros: left to SGD. Any state that exists is kept (a
// checkpoint's, or the steps'); a checkpoint written before the first step leaves none, and then this
// makes it at the next step.
void ShardedOptimizer::create_state() {
  if (kind_ == "sgd" || chunks_.empty() || !optimizer_->state().empty()) return;
  const auto names = state_names();
  int64_t total = 0;
  for (const auto& c : chunks_) total += c.numel();
  ::torch::Tensor all = ::torch::zeros({static_cast<int64_t>(names.size()), total}, chunks_.front().options());
  for (size_t c = 0, at = 0; c < chunks_.size(); at += static_cast<size_t>(chunks_[c].numel()), ++c) {
    std::vector<::torch::Tensor> tensors;
    for (size_t n = 0; n < names.size(); ++n)
      tensors.push_back(all[static_cast<int64_t>(n)].narrow(0, static_cast<int64_t>(at), chunks_[c].numel()));
    set_state(c, tensors, 0);
  }
}

size_t ShardedOptimizer::state_bytes() const {
  size_t bytes = 0;
  for (size_t c = 0; c < chunks_.size(); ++c)
    for (const auto& name : state_names())
      if (auto t = state_tensor(c, name); t.defined()) bytes += static_cast<size_t>(t.numel()) * t.element_size();
  return bytes;
}

size_t ShardedOptimizer::gradient_bytes() const { return ddp_.sync().gradient_bytes(); }

// ---- checkpoints ----

void ShardedOptimizer::save(const std::string& dir, const train::TrainingPosition& position) {
  Communicator& comm = ddp_.communicator();
  const int rank = comm.rank(), world = comm.size();
  const auto pieces = pieces_of(ddp_.sync());
  const auto& params = ddp_.sync().parameters();
  const auto names = state_names();
  // This rank's shard: a JSON header line, then each state's values over the pieces, back to back.
  nlohmann::json header;
  header["kind"] = kind_;
  header["options"] = options_text_;
  header["world"] = world;
  header["rank"] = rank;
  header["global_step"] = position.global_step;
  header["step"] = state_step();
  std::vector<std::string> present;
  for (size_t i = 0; i < names.size(); ++i)
    if (!chunks_.empty() && state_tensor(0, names[i]).defined()) present.push_back(names[i]);
  const std::string bytes = zero::encode_shard(header, params, pieces, present, [&](size_t k, size_t chunk) {
    return state_tensor(chunk, present[k]).to(::torch::kCPU).contiguous();
  });
  train::write_file_atomically(zero::shard_path(dir, position.global_step, rank, world), bytes);
  // Every shard on disk before the checkpoint that names them.
  if (world > 1) comm.barrier();
  if (rank == 0) {
    ::torch::serialize::OutputArchive archive;
    ddp_.module()->save(archive);
    nlohmann::json record{{"world", world}, {"global_step", position.global_step}, {"kind", kind_}};
    archive.write("__cohort_sharded", c10::IValue(record.dump()));
    std::ostringstream payload;
    archive.save_to(payload);
    train::write_checkpoint(dir, position, payload.str());
    zero::remove_old_shard_dirs(dir, position.global_step);
  }
  if (world > 1) comm.barrier();
}

std::optional<train::TrainingPosition> ShardedOptimizer::load(const std::string& dir) {
  // Everything is read and checked before anything changes: a load that fails (a missing or damaged
  // shard, another model or optimizer) leaves the model's weights and this optimizer's state as they
  // were, so a program that catches the error does not train from checkpoint weights with fresh state.
  auto newest = train::newest_complete_checkpoint(dir);
  if (!newest) return std::nullopt;
  const std::string& path = newest->path;
  for (const auto& why : newest->skipped) fmt::print(stderr, "checkpoint: skipped {}\n", why);
  auto& module = *ddp_.module();
  ::torch::serialize::InputArchive archive;
  nlohmann::json record;
  try {
    std::istringstream in(newest->payload);
    archive.load_from(in);
    c10::IValue value;
    if (!archive.try_read("__cohort_sharded", value))
      throw InvalidArgument(fmt::format("{}: not a sharded optimizer's checkpoint (load it with "
                                        "cohort::torch::load_checkpoint)",
                                        path));
    record = nlohmann::json::parse(value.toStringRef());
    if (record.at("kind").get<std::string>() != kind_)
      throw InvalidArgument(fmt::format("{}: the checkpoint holds {} state; this optimizer is {}", path,
                                        record.at("kind").get<std::string>(), kind_));
    if (const std::string why = archive_mismatch(module, archive, ""); !why.empty())
      throw InvalidArgument(fmt::format("{}: cannot load into this model: {}", path, why));
  } catch (const c10::Error& e) {
    throw InvalidArgument(fmt::format("{}: cannot load into this model: {}", path, e.what_without_backtrace()));
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(fmt::format("{}: a damaged sharded optimizer record: {}", path, e.what()));
  }
  const int old_world = record.at("world").get<int>();
  const int64_t global_step = record.at("global_step").get<int64_t>();

  // Every old shard's header, checked against this model and its file's length.
  const auto& params = ddp_.sync().parameters();
  const auto names = state_names();
  std::vector<zero::OldShard> shards;
  for (int s = 0; s < old_world; ++s)
    shards.push_back(zero::read_shard_header(zero::shard_path(dir, global_step, s, old_world), s, old_world, path, params));
  std::vector<bool> found(names.size(), false);
  for (const auto& shard : shards)
    for (const auto& name : shard.states)
      if (auto at = std::find(names.begin(), names.end(), name); at != names.end()) found[size_t(at - names.begin())] = true;
  const bool any_state = std::find(found.begin(), found.end(), true) != found.end();

  std::vector<std::vector<::torch::Tensor>> state(names.size());  // [name][chunk], on the CPU
  if (any_state) {
    for (auto& per_chunk : state)
      for (const auto& c : chunks_) per_chunk.push_back(::torch::zeros({c.numel()}, ::torch::kFloat32));
    zero::read_overlaps(shards, pieces_of(ddp_.sync()), names, state);  // none to read before the first step
  }
  std::vector<std::vector<::torch::Tensor>> on_device(chunks_.size());  // [chunk][name]
  if (any_state)
    for (size_t c = 0; c < chunks_.size(); ++c)
      for (size_t n = 0; n < names.size(); ++n)
        on_device[c].push_back(state[n][c].to(ddp_.device()));  // a state the shards lack starts at zero

  // Only now the model and the state change.
  try {
    module.load(archive);
  } catch (const c10::Error& e) {
    throw InvalidArgument(fmt::format("{}: cannot load into this model: {}", path, e.what_without_backtrace()));
  }
  ddp_.bind_parameters();  // the loaded values into the buckets' parameter memory
  if (any_state) {
    for (size_t c = 0; c < chunks_.size(); ++c) set_state(c, on_device[c], shards.back().step);
  } else {
    optimizer_->state().clear();  // written before the first step
  }
  return newest->position;
}

std::optional<train::TrainingPosition> resume_after_restart(const std::string& dir, ShardedOptimizer& optimizer) {
  if (dir.empty() || restart_count() == 0) return std::nullopt;
  return optimizer.load(dir);
}

}  // namespace cohort::torch
