// resnet: ResNet-18 with the CIFAR-style stem on Fashion-MNIST padded to 32x32, data parallel with
// libtorch and cohort::torch::DistributedDataParallel. Batch norm's running statistics are buffers:
// the DDP broadcasts them from rank 0 before every training forward, as torch's DDP does
// (broadcast_buffers). bench/resnet_twin.py is the same job in PyTorch (same model, data, padding,
// normalisation, batch, seed and threads); bench/bench_resnet.sh runs the two side by side.
//
//   cohort run --nproc-per-node 2 build/examples/resnet/resnet
//   cohort run --nproc-per-node 2 build/examples/resnet/resnet --optimizer adam --zero 2
//   cohort run --nproc-per-node 2 build/examples/resnet/resnet --fsdp      the parameters sharded too
//   build/examples/resnet/resnet --width 16            (no launcher: one process, a narrower net)
//
// The loop is examples/fashion_mnist's (its four marked steps), with --zero 1|2 stepping through
// cohort::torch::ShardedOptimizer (ZeRO), which checkpoints with its own save() and load().
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "cohort/gpu.h"
#include "cohort/torch/ddp.h"
#include "cohort/torch/fsdp.h"
#include "common/gpu_report.h"
#include "cohort/torch/distributed_sgd.h"
#include "cohort/torch/sharded_optimizer.h"
#include "common/launch.h"
#include "dataset/fashion_mnist_files.h"
#include "store/memory_store.h"

namespace nn = torch::nn;
using cohort::examples::kAtLeastOne;
using cohort::examples::kNotNegative;
using cohort::examples::kPositive;
using cohort::examples::launched;
using cohort::ConfigError;

namespace {

// ---- data ----
// torchvision's Compose([Pad(2), ToTensor(), Normalize((0.2860,), (0.3530,))]): zero-padded to 32x32,
// scaled to [0,1], then normalised with the training set's mean and standard deviation (of the 28x28
// pixels: 0.28604 and 0.35302), so a padded pixel becomes -0.8102. The twin uses the same constants.
constexpr double kMean = 0.2860, kStd = 0.3530;

struct Split {
  torch::Tensor x;  // N,1,32,32 float32, normalised
  torch::Tensor y;  // N int64
};

// The first `limit` images of a split (0: all), padded and normalised.
Split load_split(const std::string& dir, const std::string& prefix, int64_t limit) {
  auto split = cohort::examples::read_fashion_mnist(dir, prefix);
  const int64_t n = limit > 0 ? std::min(limit, split.count) : split.count;
  auto x = torch::from_blob(split.pixels.data(), {split.count, 1, 28, 28}, torch::kUInt8).narrow(0, 0, n);
  auto y = torch::from_blob(split.labels.data(), {split.count}, torch::kUInt8).narrow(0, 0, n);
  x = torch::constant_pad_nd(x.to(torch::kFloat32).div_(255.0), {2, 2, 2, 2}, 0.0).sub_(kMean).div_(kStd);
  return {x.contiguous(), y.to(torch::kLong)};
}

// ---- model: ResNet-18, CIFAR-style (He et al. 2016, section 4.2's stem on the ImageNet net's blocks) ----
// A 3x3 stride-1 stem and no max-pool keep 32x32 images at 32x32 into the first stage. Default
// initialisation (torch's kaiming_uniform_(a=sqrt(5)) for conv and linear), modules registered in the
// order bench/resnet_twin.py creates them: with the same seed both start from the same weights.
struct BasicBlockImpl : nn::Module {
  BasicBlockImpl(int64_t in, int64_t out, int64_t stride)
      : conv1(register_module("conv1", nn::Conv2d(nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false)))),
        bn1(register_module("bn1", nn::BatchNorm2d(out))),
        conv2(register_module("conv2", nn::Conv2d(nn::Conv2dOptions(out, out, 3).stride(1).padding(1).bias(false)))),
        bn2(register_module("bn2", nn::BatchNorm2d(out))) {
    if (stride != 1 || in != out)  // a 1x1 projection where the shape changes
      shortcut = register_module(
          "shortcut", nn::Sequential(nn::Conv2d(nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)),
                                     nn::BatchNorm2d(out)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto out = torch::relu(bn1(conv1(x)));
    out = bn2(conv2(out));
    out += shortcut ? shortcut->forward(x) : x;
    return torch::relu(out);
  }
  // Declared in the order of registration (members are initialised in declaration order): the
  // parameters' order is the twin's.
  nn::Conv2d conv1;
  nn::BatchNorm2d bn1;
  nn::Conv2d conv2;
  nn::BatchNorm2d bn2;
  nn::Sequential shortcut{nullptr};
};
TORCH_MODULE(BasicBlock);

struct ResNetImpl : nn::Module {
  // width 64: ResNet-18's 64/128/256/512 channels; a smaller width scales every stage (tests).
  explicit ResNetImpl(int64_t width)
      : conv1(register_module("conv1", nn::Conv2d(nn::Conv2dOptions(1, width, 3).stride(1).padding(1).bias(false)))),
        bn1(register_module("bn1", nn::BatchNorm2d(width))) {
    int64_t in = width;
    for (int stage = 0; stage < 4; ++stage) {
      const int64_t out = width << stage, stride = stage == 0 ? 1 : 2;
      // [2, 2, 2, 2] blocks. One statement each: the order in which a call's arguments are evaluated is
      // unspecified (GCC builds the last first), and the order decides which random numbers each gets.
      BasicBlock first(in, out, stride);
      BasicBlock second(out, out, 1);
      nn::Sequential layer(first, second);
      layers.push_back(register_module(fmt::format("layer{}", stage + 1), layer));
      in = out;
    }
    fc = register_module("fc", nn::Linear(in, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto out = torch::relu(bn1(conv1(x)));
    for (auto& layer : layers) {
      auto run_layer = [&] { return layer->forward(out); };
      out = around_layer ? around_layer(*layer, run_layer) : run_layer();
    }
    out = torch::adaptive_avg_pool2d(out, {1, 1}).flatten(1);
    return fc(out);
  }
  nn::Conv2d conv1;
  nn::BatchNorm2d bn1;
  std::vector<nn::Sequential> layers;
  nn::Linear fc{nullptr};
  // --fsdp: each stage runs through FullyShardedDataParallel::unit_forward (its unit gathered).
  std::function<torch::Tensor(nn::Module&, const std::function<torch::Tensor()>&)> around_layer;
};
TORCH_MODULE(ResNet);

std::string progress_bar(int64_t done, int64_t total, int width = 30) {
  int filled = total > 0 ? static_cast<int>(width * done / total) : width;
  return fmt::format("[{}{}] {:3d}%", std::string(static_cast<size_t>(filled), '#'),
                     std::string(static_cast<size_t>(width - filled), '.'), total > 0 ? 100 * done / total : 100);
}

// FNV-1a over the bytes of every parameter and every buffer (batch norm's running statistics and
// counts): equal on every rank exactly when the ranks hold the same model.
// Parameters first, then buffers: what FullyShardedDataParallel::full_state_dict() lists.
uint64_t digest_of(const std::vector<torch::Tensor>& tensors) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& t : tensors) {
    auto c = t.detach().to(torch::kCPU).contiguous();
    auto* b = static_cast<const unsigned char*>(c.data_ptr());
    for (size_t i = 0; i < static_cast<size_t>(c.numel()) * c.element_size(); ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  return h;
}
uint64_t model_digest(nn::Module& m) {
  std::vector<torch::Tensor> tensors = m.parameters();
  for (auto& b : m.buffers()) tensors.push_back(b);
  return digest_of(tensors);
}

// Rank 0's buffers on every rank, once. The DDP broadcasts them before each training forward, so
// after the last one every rank's running statistics hold rank 0's plus its own last batch (torch's
// DDP leaves them so too); evaluating on every rank wants the same statistics everywhere.
void broadcast_buffers(nn::Module& m, cohort::Communicator& comm) {
  if (comm.size() == 1) return;
  torch::NoGradGuard no_grad;
  for (auto& b : m.buffers()) {
    auto host = b.to(torch::kCPU).contiguous();  // the example's communicator moves host memory
    const auto dtype = host.scalar_type() == torch::kLong ? cohort::DataType::kInt64 : cohort::DataType::kFloat32;
    if (host.scalar_type() != torch::kLong && host.scalar_type() != torch::kFloat32)
      throw cohort::InvalidArgument(fmt::format("a buffer of type {} (expected float32 or int64)",
                                                std::string(c10::toString(host.scalar_type()))));
    comm.broadcast(host.data_ptr(), static_cast<size_t>(host.numel()), dtype, 0);
    b.copy_(host);
  }
}

struct Args {
  int64_t width = 64;
  int64_t batch = 32;
  double lr = 0;  // 0: the optimizer's default here (0.01 for SGD, 0.001 for Adam and AdamW)
  double momentum = 0.9;
  std::string optimizer = "sgd";
  int zero = 0;
  bool fsdp = false;
  int64_t epochs = 1;
  int64_t max_steps = 0;
  std::string data_dir = cohort::examples::kFashionMnistDir;
  uint64_t seed = 0;
  int64_t train_samples = 2048;
  int64_t test_samples = 1000;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  bool resume = false;
  std::string compression = "none";
  double bucket_mb = 25;
  int threads = 0;
  bool verbose = false;
  int64_t kill_after_steps = 0;
  bool print_digest = false;
  std::string device = "cpu";
};

int run(const Args& a) {
  auto compression = cohort::train::parse_compression(a.compression);
  if (!compression) throw ConfigError(fmt::format("--compression must be none, fp16 or bf16, not '{}'", a.compression));
  if (a.resume && a.checkpoint_dir.empty()) throw ConfigError("--resume needs --checkpoint-dir");
  if (a.fsdp && (a.zero || *compression != cohort::train::WireCompression::kNone))
    throw ConfigError("--fsdp shards the parameters, gradients and optimizer state itself: it takes neither --zero nor "
                      "--compression");
  const double lr = a.lr > 0 ? a.lr : a.optimizer == "sgd" ? 0.01 : 0.001;

  // Data first: a missing data set fails before any rank waits for another.
  Split train = load_split(a.data_dir, "train", a.train_samples);
  Split test = load_split(a.data_dir, "t10k", a.test_samples);

  // (1) Rank and world from the environment (cohort run, torchrun, mpirun, Slurm); one process otherwise.
  std::shared_ptr<cohort::Communicator> comm =
      launched() ? cohort::Communicator::from_env() : cohort::Communicator::create(cohort::make_memory_store(), 0, 1);
  const int rank = comm->rank(), world = comm->size();
  const bool lead = rank == 0;
  // Ranks sharing a node would fight over the cores with several intra-op threads each.
  const int threads = a.threads > 0 ? a.threads : (comm->local_size() > 1 ? 1 : torch::get_num_threads());
  torch::set_num_threads(threads);

  // --device cuda: this rank's GPU (COHORT_LOCAL_GPU from `cohort run --gpus-per-node`, else LOCAL_RANK).
  torch::Device device(torch::kCPU);
  if (a.device == "cuda") {
    if (!torch::cuda::is_available())
      throw ConfigError("--device cuda: this libtorch has no CUDA, or sees no GPU (torch::cuda::is_available() is false)");
    device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(cohort::gpu::local_device()));
  } else if (a.device != "cpu") {
    throw ConfigError(fmt::format("--device must be cpu or cuda, not '{}'", a.device));
  }

  torch::manual_seed(a.seed);
  ResNet model(a.width);
  double initial_sum = 0;  // compared with the twin's in --verbose: same seed, same initial weights
  for (auto& p : model->parameters()) initial_sum += p.detach().sum().item<double>();
  model->to(device);
  train.x = train.x.to(device), train.y = train.y.to(device);
  test.x = test.x.to(device), test.y = test.y.to(device);

  // (3) Wrap the model: parameters and buffers broadcast from rank 0, gradients averaged during
  // backward, buffers broadcast again before every training forward (DDPOptions::broadcast_buffers).
  cohort::torch::DDPOptions ddp_options;
  ddp_options.compression = *compression;
  ddp_options.bucket_cap_bytes = static_cast<size_t>(a.bucket_mb * 1024 * 1024);
  // The first bucket (1 MiB, torch's default: it starts reducing early in backward) no bigger than the rest.
  ddp_options.first_bucket_cap_bytes = std::min(ddp_options.first_bucket_cap_bytes, ddp_options.bucket_cap_bytes);
  // --fsdp: each of the four stages a unit; the stem and the classifier form the root. Batch norm's
  // running statistics stay each rank's own until the evaluation broadcasts rank 0's.
  std::unique_ptr<cohort::torch::DistributedDataParallel> ddp;
  std::unique_ptr<cohort::torch::FullyShardedDataParallel> fsdp;
  if (a.fsdp) {
    std::vector<std::shared_ptr<nn::Module>> units;
    for (auto& layer : model->layers) units.push_back(layer.ptr());
    fsdp = std::make_unique<cohort::torch::FullyShardedDataParallel>(model, comm, cohort::torch::FSDPOptions{}, units);
    model->around_layer = [&fsdp](nn::Module& layer, const std::function<torch::Tensor()>& run_layer) {
      return fsdp->unit_forward(layer, run_layer);
    };
  } else {
    ddp = std::make_unique<cohort::torch::DistributedDataParallel>(model, comm, ddp_options);
  }
  auto forward = [&](const torch::Tensor& x) {
    return fsdp ? fsdp->forward_with([&] { return model->forward(x); }) : ddp->forward(x);
  };

  // --zero 0: a whole optimizer on every rank (SGD through DistributedSGD: its step fuses with the
  // averaging where it can, i.e. momentum 0, else it is DDP's average and then torch's step).
  // --zero 1|2: the sharded optimizer; each rank keeps the state of 1/N of the parameters.
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  cohort::torch::DistributedSGD* distributed_sgd = nullptr;  // --zero 0 --optimizer sgd
  std::unique_ptr<cohort::torch::ShardedOptimizer> sharded;
  const auto sgd_options = torch::optim::SGDOptions(lr).momentum(a.momentum);
  if (a.zero > 0) {
    cohort::torch::ShardedOptions so{a.zero};
    if (a.optimizer == "sgd") sharded = std::make_unique<cohort::torch::ShardedOptimizer>(*ddp, sgd_options, so);
    else if (a.optimizer == "adam")
      sharded = std::make_unique<cohort::torch::ShardedOptimizer>(*ddp, torch::optim::AdamOptions(lr), so);
    else sharded = std::make_unique<cohort::torch::ShardedOptimizer>(*ddp, torch::optim::AdamWOptions(lr), so);
  } else if (fsdp) {  // torch's own optimizers, over the shards
    if (a.optimizer == "sgd") optimizer = std::make_unique<torch::optim::SGD>(fsdp->parameters(), sgd_options);
    else if (a.optimizer == "adam")
      optimizer = std::make_unique<torch::optim::Adam>(fsdp->parameters(), torch::optim::AdamOptions(lr));
    else optimizer = std::make_unique<torch::optim::AdamW>(fsdp->parameters(), torch::optim::AdamWOptions(lr));
  } else if (a.optimizer == "sgd") {
    auto sgd = std::make_unique<cohort::torch::DistributedSGD>(*ddp, sgd_options);
    distributed_sgd = sgd.get();
    optimizer = std::move(sgd);
  } else if (a.optimizer == "adam") {
    optimizer = std::make_unique<torch::optim::Adam>(ddp->parameters(), torch::optim::AdamOptions(lr));
  } else {
    optimizer = std::make_unique<torch::optim::AdamW>(ddp->parameters(), torch::optim::AdamWOptions(lr));
  }
  auto zero_grad = [&] { sharded ? sharded->zero_grad() : fsdp ? optimizer->zero_grad() : ddp->zero_grad(); };
  auto step = [&] { sharded ? sharded->step() : static_cast<void>(optimizer->step()); };

  // (2) The distributed sampler: torch.utils.data.DistributedSampler's indices.
  cohort::torch::DistributedSampler sampler(static_cast<size_t>(train.x.size(0)), world, rank, /*shuffle=*/true, a.seed);

  // Resume: with --resume, and on every restart of the job (`cohort run --max-restarts`, an elastic
  // job's new generation) from the newest complete checkpoint, when there is one, at any world size
  // (docs/training.md, "Resuming"). The sharded optimizer's checkpoint is collective: every rank
  // reads the pieces of the old shards that overlap its own.
  cohort::train::TrainingPosition pos{0, 0, 0, world, 0, world};
  const int restart = cohort::torch::restart_count();
  if (a.resume || (restart > 0 && !a.checkpoint_dir.empty())) {
    std::optional<cohort::train::TrainingPosition> loaded;
    if (fsdp)  // collective, as the sharded optimizer's: the shards, the buffers and the optimizer's state
      loaded = fsdp->load(a.checkpoint_dir, *optimizer);
    else if (sharded)
      loaded = a.resume ? sharded->load(a.checkpoint_dir) : cohort::torch::resume_after_restart(a.checkpoint_dir, *sharded);
    else
      loaded = a.resume ? cohort::torch::load_checkpoint(a.checkpoint_dir, *model, *optimizer)
                        : cohort::torch::resume_after_restart(a.checkpoint_dir, *model, *optimizer);
    if (!loaded && a.resume) throw ConfigError(fmt::format("--resume: no checkpoint in {}", a.checkpoint_dir));
    if (loaded) {
      pos = *loaded;
      if (lead)
        fmt::print("resuming from {} at epoch {}, step {} (sample {} of the epoch's {}; written by {} ranks, {} now{})\n",
                   a.checkpoint_dir, pos.epoch, pos.step_in_epoch, pos.epoch_cursor,
                   sampler.total_size_for(pos.epoch_world), pos.world_size, world,
                   a.resume ? "" : fmt::format("; restart {}", restart));
    } else if (lead) {
      fmt::print("restart {}: no checkpoint in {} yet, starting from the beginning\n", restart, a.checkpoint_dir);
    }
  }

  if (lead && a.verbose) {
    int64_t nparams = 0, nbuffers = 0;
    for (auto& p : model->parameters()) nparams += p.numel();
    for (auto& b : model->buffers()) nbuffers += b.numel();
    fmt::print("world {} ({} on this host), ResNet-18 width {}: {} parameters (initial sum {:.9g}), {} buffer "
               "elements; batch {} per rank, intra-op threads {}\n",
               world, comm->local_size(), a.width, nparams, initial_sum, nbuffers, a.batch, threads);
    fmt::print("BLAS in use: {}; oneDNN (MKL-DNN) for convolutions: {}\n",
               cohort::torch::blas_in_use().empty() ? "(none mapped)" : cohort::torch::blas_in_use(),
               at::globalContext().userEnabledMkldnn() && at::hasMKLDNN() ? "yes" : "no");
    fmt::print("{}, compression {}, optimizer: {}\n",
               fsdp ? fmt::format("FSDP units: {}", fsdp->units().size())
                    : fmt::format("buckets: {}", ddp->sync().bucket_layout().size()),
               cohort::train::compression_name(*compression),
               sharded ? "sharded (ZeRO) " + sharded->describe()
                       : fmt::format("{} lr={}{}", a.optimizer, lr,
                                     !distributed_sgd ? ""
                                     : distributed_sgd->fused()
                                         ? fmt::format(" momentum={}, step fused with the averaging", a.momentum)
                                         : fmt::format(" momentum={}, DDP's averaging then torch's step ({})",
                                                       a.momentum, distributed_sgd->why_not_fused())));
  }

  // Every rank takes part in FSDP's and the sharded optimizer's save (each writes its shard); otherwise
  // rank 0 writes the whole checkpoint.
  auto save = [&](const cohort::train::TrainingPosition& p) {
    if (a.checkpoint_dir.empty()) return;
    if (fsdp) fsdp->save(a.checkpoint_dir, *optimizer, p);
    else if (sharded) sharded->save(a.checkpoint_dir, p);
    else if (lead) cohort::torch::save_checkpoint(a.checkpoint_dir, *model, *optimizer, p);
  };

  comm->barrier();
  const auto t0 = std::chrono::steady_clock::now();
  int64_t samples = 0, steps_run = 0;
  cohort::train::TrainingPosition last = pos;  // where the run stands: the final checkpoint's position
  bool stop = false;
  for (int64_t epoch = pos.epoch; epoch < a.epochs && !stop; ++epoch) {
    sampler.set_epoch(epoch);
    // (4) Shard the data: this rank's indices, cut into batches. A resumed epoch takes the rest of
    // its order (every rank runs as many steps as the longest share).
    const bool resumed = epoch == pos.epoch && pos.epoch_cursor > 0;
    const int epoch_world = resumed ? pos.epoch_world : world;
    const int64_t cursor0 = resumed ? pos.epoch_cursor : 0, steps_before = resumed ? pos.step_in_epoch : 0;
    const auto indices = resumed ? sampler.indices_from(cursor0, epoch_world) : sampler.indices();
    const int64_t share = resumed ? sampler.longest_share(cursor0, epoch_world) : sampler.num_samples();
    const int64_t steps = (share + a.batch - 1) / a.batch, epoch_positions = sampler.total_size_for(epoch_world);
    const auto index_tensor = torch::tensor(indices, torch::kLong).to(device);
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t begin = std::min<int64_t>(s * a.batch, static_cast<int64_t>(indices.size()));
      const int64_t len = std::min<int64_t>(a.batch, static_cast<int64_t>(indices.size()) - begin);
      auto batch = index_tensor.narrow(0, begin, len);
      auto x = train.x.index_select(0, batch), y = train.y.index_select(0, batch);

      zero_grad();
      torch::Tensor loss;
      if (len > 0) {
        loss = torch::nn::functional::cross_entropy(forward(x), y);
      } else {
        // A rank with no samples left still takes part in the step (its gradients are averaged in)
        // with a zero loss. Batch norm cannot normalise an empty batch, so it runs one image of the
        // training set with the loss multiplied by 0; in eval mode, so the running statistics stay.
        model->eval();
        loss = forward(train.x.narrow(0, 0, 1)).sum() * 0.0;
        model->train();
      }
      loss.backward();  // collects the gradients (averaged over the ranks, or reduce-scattered)
      step();

      samples += len;
      ++steps_run;
      ++pos.global_step;
      if (lead && restart > 0 && steps_run == 1) {
        const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
        fmt::print("restart {}: first step done at {:.3f} (unix time), world size {}\n", restart, now, world);
        std::fflush(stdout);
      }
      const int64_t shown = steps_before + s, shown_total = steps_before + steps;
      if (lead && shown % 10 == 0) {
        fmt::print("epoch: {}, step: {}, loss is {}  {} {}/{}\n", epoch, shown, loss.item<float>(),
                   progress_bar(shown + 1, shown_total), shown + 1, shown_total);
        std::fflush(stdout);
      }
      // Where the epoch's order stands after this step: every rank took a.batch positions.
      const int64_t cursor = std::min(cursor0 + (s + 1) * a.batch * world, epoch_positions);
      last = {epoch, shown + 1, pos.global_step, world, cursor, epoch_world};
      if (s + 1 == steps) last = {epoch + 1, 0, pos.global_step, world, 0, world};
      if (a.checkpoint_every > 0 && pos.global_step % a.checkpoint_every == 0) save(last);
      if (a.kill_after_steps > 0 && steps_run == a.kill_after_steps && restart == 0) {
        std::fflush(stdout);
        std::raise(SIGKILL);  // fault injection for the resume test: no cleanup, no final checkpoint
      }
      if (a.max_steps > 0 && steps_run == a.max_steps) {
        stop = true;
        break;
      }
    }
  }
  examples::wait_for_device(device);
  comm->barrier();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Where it stopped (the end of the last epoch, or the middle of one after --max-steps): a later
  // --resume goes on from there.
  save(last);

  int64_t total_samples = samples;
  comm->allreduce(&total_samples, &total_samples, 1, cohort::DataType::kInt64, cohort::ReduceOp::kSum);
  double wait = ddp ? ddp->stats().wait_seconds : 0.0;
  comm->allreduce(&wait, &wait, 1, cohort::DataType::kFloat64, cohort::ReduceOp::kAvg);
  if (ddp) examples::print_gpu_overlap(ddp->stats(), *comm, lead);

  // Test accuracy: every rank evaluates its contiguous share of the test images with rank 0's
  // running statistics, and the counts are summed (one rank alone would take N times as long).
  broadcast_buffers(*model, *comm);
  int64_t correct = 0;
  {
    torch::NoGradGuard no_grad;
    model->eval();
    const int64_t n = test.x.size(0), lo = n * rank / world, hi = n * (rank + 1) / world;
    for (int64_t i = lo; i < hi; i += 200) {  // chunks: a ResNet's activations are large
      const int64_t len = std::min<int64_t>(200, hi - i);
      correct += (fsdp ? forward(test.x.narrow(0, i, len)) : model->forward(test.x.narrow(0, i, len)))
                     .argmax(1)
                     .eq(test.y.narrow(0, i, len))
                     .sum()
                     .item<int64_t>();
    }
    model->train();
  }
  comm->allreduce(&correct, &correct, 1, cohort::DataType::kInt64, cohort::ReduceOp::kSum);

  if (lead) {
    fmt::print("samples/s: {:.1f} ({} samples on {} ranks in {:.3f} s, {} steps per rank)\n",
               seconds > 0 ? static_cast<double>(total_samples) / seconds : 0.0, total_samples, world, seconds, steps_run);
    fmt::print("communication wait: {:.1f}% of step time ({:.3f} s per rank, averaged over ranks)\n",
               seconds > 0 ? 100.0 * wait / seconds : 0.0, wait);
    fmt::print("test accuracy: {:.4f} ({} test images)\n",
               static_cast<double>(correct) / static_cast<double>(test.x.size(0)), test.x.size(0));
  }
  if (a.print_digest) {
    // Every rank: equal lines mean every rank ends with the same parameters and buffers.
    // Under --fsdp the whole model exists only gathered (collective: every rank prints).
    uint64_t digest = 0;
    if (fsdp) {
      std::vector<torch::Tensor> tensors;
      for (auto& [name, t] : fsdp->full_state_dict()) tensors.push_back(t);
      digest = digest_of(tensors);
    } else {
      digest = model_digest(*model);
    }
    fmt::print("rank {} final digest (parameters and buffers): {:016x}\n", rank, digest);
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ResNet-18 on Fashion-MNIST (32x32), data parallel with libtorch and cohort (run under `cohort run`)",
               "resnet"};
  Args a;
  app.add_option("--width", a.width, "channels of the first stage (64: ResNet-18; the stages have 1x, 2x, 4x, 8x)")
      ->check(kAtLeastOne);
  app.add_option("--batch", a.batch, "batch size per rank")->check(kAtLeastOne);
  app.add_option("--lr", a.lr, "learning rate (default: 0.01 for sgd, 0.001 for adam and adamw)")->check(kPositive);
  app.add_option("--momentum", a.momentum, "SGD momentum")->check(kNotNegative);
  app.add_option("--optimizer", a.optimizer, "sgd, adam or adamw (torch's defaults besides --lr and --momentum)")
      ->check(CLI::IsMember({"sgd", "adam", "adamw"}));
  app.add_option("--zero", a.zero,
                 "0: every rank keeps the whole optimizer; 1: the optimizer state sharded over the ranks "
                 "(cohort::torch::ShardedOptimizer); 2: the gradients too")
      ->check(CLI::IsMember({0, 1, 2}));
  app.add_flag("--fsdp", a.fsdp,
               "fully sharded data parallel (cohort::torch::FullyShardedDataParallel): each rank keeps 1/N of the "
               "parameters, gradients and optimizer state; each of the four stages is a unit");
  app.add_option("--epochs", a.epochs, "epochs")->check(kAtLeastOne);
  app.add_option("--max-steps", a.max_steps, "stop after N steps of this run (benchmarks; 0: no limit)")
      ->check(kNotNegative);
  app.add_option("--data-dir", a.data_dir, "folder with the gzip idx files");
  app.add_option("--seed", a.seed, "seed of the model init and the sampler");
  app.add_option("--train-samples", a.train_samples, "use only the first N training images (0 = all 60,000)")
      ->check(kNotNegative);
  app.add_option("--test-samples", a.test_samples, "evaluate on the first N test images (0 = all 10,000)")
      ->check(kNotNegative);
  app.add_option("--checkpoint-dir", a.checkpoint_dir,
                 "checkpoints go here (rank 0 writes checkpoint.bin; with --zero, every rank its optimizer shard); a "
                 "restarted job resumes from them");
  app.add_option("--checkpoint-every", a.checkpoint_every, "checkpoint every N steps (and at the end)")->check(kNotNegative);
  app.add_flag("--resume", a.resume, "continue from the newest complete checkpoint in --checkpoint-dir (restarts do so anyway)");
  app.add_option("--compression", a.compression, "gradients on the wire: none, fp16 or bf16");
  app.add_option("--device", a.device, "cpu, or cuda: the model on this rank's GPU, gradients reduced by NCCL");
  app.add_option("--bucket-mb", a.bucket_mb, "gradient bucket size in MiB")->check(kPositive);
  app.add_option("--threads", a.threads, "intra-op threads per rank (0: 1 when ranks share a host)")->check(kNotNegative);
  app.add_flag("--verbose", a.verbose, "print the setup (world, model size, BLAS and oneDNN, buckets, optimizer)");
  app.add_option("--kill-after-steps", a.kill_after_steps,
                 "testing: SIGKILL every rank after N steps of a first start (a restart goes on)")
      ->check(kNotNegative);
  app.add_flag("--print-digest", a.print_digest, "every rank prints a digest of its final parameters and buffers");
  return cohort::examples::parse_and_run("resnet", app, argc, argv, [&] { return run(a); });
}
