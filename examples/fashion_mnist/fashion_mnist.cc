// fashion_mnist: cohort's main job. Data-parallel Fashion-MNIST training with libtorch and
// cohort::torch::DistributedDataParallel, the C++ counterpart of the data-parallel MNIST example in
// MindSpore's tutorial (Huawei's framework; one of the users' documents the project is built for).
//
//   cohort run --nproc-per-node 2 build/examples/fashion_mnist/fashion_mnist --model mlp
//   build/examples/fashion_mnist/fashion_mnist            (no launcher: one process)
//
// The conversion from one process to data parallel is the four marked steps below; the training
// loop itself is the same as a single-process libtorch loop.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/torch.h>

#include <csignal>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "cohort/gpu.h"
#include "cohort/torch/ddp.h"
#include "common/gpu_report.h"
#include "common/launch.h"
#include "cohort/torch/distributed_sgd.h"
#include "store/memory_store.h"
#include "dataset/fashion_mnist_files.h"

namespace nn = torch::nn;
using cohort::examples::kAtLeastOne;
using cohort::examples::kNotNegative;
using cohort::examples::kPositive;
using cohort::examples::launched;
using cohort::ConfigError;

namespace {

// ---- data: examples/dataset/fashion_mnist_files.h ----
struct Split {
  torch::Tensor x;  // N,1,28,28 float in [0,1] (like torchvision's ToTensor)
  torch::Tensor y;  // N int64
};

Split load_split(const std::string& dir, const std::string& prefix) {
  auto split = cohort::examples::read_fashion_mnist(dir, prefix);
  auto x = torch::from_blob(split.pixels.data(), {split.count, 1, 28, 28}, torch::kUInt8).to(torch::kFloat32).div_(255.0);
  auto y = torch::from_blob(split.labels.data(), {split.count}, torch::kUInt8).to(torch::kLong);
  return {x, y};
}

// ---- models ----
nn::Sequential make_model(const std::string& name) {
  if (name == "seed")  // the MindSpore tutorial's model: the ReLU on the logits is theirs (it slows learning)
    return nn::Sequential(nn::Flatten(), nn::Linear(784, 10), nn::ReLU());
  if (name == "mlp")
    return nn::Sequential(nn::Flatten(), nn::Linear(784, 1024), nn::ReLU(), nn::Linear(1024, 1024), nn::ReLU(),
                          nn::Linear(1024, 10));
  // cnn
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 32, 3)), nn::ReLU(), nn::MaxPool2d(2),
                        nn::Conv2d(nn::Conv2dOptions(32, 64, 3)), nn::ReLU(), nn::MaxPool2d(2), nn::Flatten(),
                        nn::Linear(64 * 5 * 5, 128), nn::ReLU(), nn::Linear(128, 10));
}

std::string progress_bar(int64_t done, int64_t total, int width = 30) {
  int filled = total > 0 ? static_cast<int>(width * done / total) : width;
  return fmt::format("[{}{}] {:3d}%", std::string(static_cast<size_t>(filled), '#'),
                     std::string(static_cast<size_t>(width - filled), '.'), total > 0 ? 100 * done / total : 100);
}

uint64_t weights_digest(nn::Module& m) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the bytes of every parameter
  for (auto& p : m.parameters()) {
    auto c = p.detach().to(torch::kCPU).contiguous();
    auto* b = static_cast<const unsigned char*>(c.data_ptr());
    for (size_t i = 0; i < static_cast<size_t>(c.numel()) * c.element_size(); ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  return h;
}

struct Args {
  std::string model = "seed";
  int64_t batch = 32;
  double lr = 0.01;
  int64_t epochs = 1;
  std::string data_dir = cohort::examples::kFashionMnistDir;
  uint64_t seed = 0;
  int64_t train_samples = 0;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  bool resume = false;
  std::string compression = "none";
  std::string sgd = "fused";
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

  // Data first: a missing data set fails before any rank waits for another.
  Split train = load_split(a.data_dir, "train");
  Split test = load_split(a.data_dir, "t10k");
  if (a.train_samples > 0 && a.train_samples < train.x.size(0)) {
    train.x = train.x.narrow(0, 0, a.train_samples);
    train.y = train.y.narrow(0, 0, a.train_samples);
  }

  // (1) Rank and world from the environment (cohort run, torchrun, mpirun, Slurm); one process otherwise.
  std::shared_ptr<cohort::Communicator> comm =
      launched() ? cohort::Communicator::from_env() : cohort::Communicator::create(cohort::make_memory_store(), 0, 1);
  const int rank = comm->rank(), world = comm->size();
  const bool lead = rank == 0;
  // Ranks sharing a node would fight over the cores with several intra-op threads each.
  int threads = a.threads > 0 ? a.threads : (comm->local_size() > 1 ? 1 : torch::get_num_threads());
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

  torch::manual_seed(static_cast<uint64_t>(a.seed));
  auto model = make_model(a.model);
  model->to(device);
  train.x = train.x.to(device), train.y = train.y.to(device);
  test.x = test.x.to(device), test.y = test.y.to(device);
  // (3) Wrap the model: parameters broadcast from rank 0, gradients averaged during backward.
  cohort::torch::DDPOptions ddp_options;
  ddp_options.compression = *compression;
  ddp_options.bucket_cap_bytes = static_cast<size_t>(a.bucket_mb * 1024 * 1024);
  cohort::torch::DistributedDataParallel ddp(model, comm, ddp_options);
  // SGD whose step averages the gradients and updates the parameters in one pass over memory (one rank,
  // ranks on several hosts or over TCP, compression, or --sgd torch: DDP's averaging during backward,
  // then torch's SGD step).
  std::unique_ptr<torch::optim::SGD> optimizer;
  cohort::torch::DistributedSGD* fused_sgd = nullptr;
  if (a.sgd == "fused") {
    auto sgd = std::make_unique<cohort::torch::DistributedSGD>(ddp, torch::optim::SGDOptions(a.lr));
    fused_sgd = sgd.get();
    optimizer = std::move(sgd);
  } else {
    optimizer = std::make_unique<torch::optim::SGD>(ddp.parameters(), torch::optim::SGDOptions(a.lr));
  }

  // (2) The distributed sampler: torch.utils.data.DistributedSampler's indices.
  cohort::torch::DistributedSampler sampler(static_cast<size_t>(train.x.size(0)), world, rank, /*shuffle=*/true, a.seed);

  // Resume: with --resume, and on every restart of the job (`cohort run --max-restarts`, an elastic
  // job's new generation, torchrun's restarts) from the newest complete checkpoint, when there is one.
  // The world size may differ from the one that wrote it: the interrupted epoch goes on where its
  // sample order stands, split over the ranks there are now (docs/training.md, "Resuming").
  cohort::train::TrainingPosition pos{0, 0, 0, world, 0, world};
  const int restart = cohort::torch::restart_count();
  if (a.resume || (restart > 0 && !a.checkpoint_dir.empty())) {
    auto loaded = a.resume ? cohort::torch::load_checkpoint(a.checkpoint_dir, *model, *optimizer)
                           : cohort::torch::resume_after_restart(a.checkpoint_dir, *model, *optimizer);
    if (!loaded && a.resume) throw ConfigError(fmt::format("--resume: no checkpoint in {}", a.checkpoint_dir));
    if (loaded) {
      pos = *loaded;
      if (pos.epoch_cursor < 0)  // written before checkpoints kept the cursor: same batch assumed
        pos.epoch_cursor = std::min(pos.step_in_epoch * a.batch * pos.world_size, sampler.total_size_for(pos.world_size));
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
    int64_t nparams = 0;
    for (auto& p : model->parameters()) nparams += p.numel();
    fmt::print("world {} ({} on this host), model {} ({} parameters), batch {} per rank, intra-op threads {}\n", world,
               comm->local_size(), a.model, nparams, a.batch, threads);
    fmt::print("BLAS in use: {}\n", cohort::torch::blas_in_use().empty() ? "(none mapped)" : cohort::torch::blas_in_use());
    fmt::print("buckets: {}, compression {}, SGD step: {}\n", ddp.sync().bucket_layout().size(),
               cohort::train::compression_name(*compression),
               fused_sgd && fused_sgd->fused()
                   ? "fused with the averaging"
                   : "torch's, after DDP's averaging (" + (fused_sgd ? fused_sgd->why_not_fused() : "--sgd torch") + ")");
  }

  auto save = [&](const cohort::train::TrainingPosition& p) {
    if (lead && !a.checkpoint_dir.empty()) cohort::torch::save_checkpoint(a.checkpoint_dir, *model, *optimizer, p);
  };

  comm->barrier();
  const auto t0 = std::chrono::steady_clock::now();
  int64_t samples = 0, steps_run = 0;
  double last_loss = 0;
  for (int64_t epoch = pos.epoch; epoch < a.epochs; ++epoch) {
    sampler.set_epoch(epoch);
    // (4) Shard the data: this rank's indices, cut into batches. A resumed epoch takes the rest of
    // its order (every rank runs as many steps as the longest share: a shorter one ends with a
    // smaller, possibly empty, batch).
    const bool resumed = epoch == pos.epoch && pos.epoch_cursor > 0;
    const int epoch_world = resumed ? pos.epoch_world : world;
    const int64_t cursor0 = resumed ? pos.epoch_cursor : 0, steps_before = resumed ? pos.step_in_epoch : 0;
    const auto indices = resumed ? sampler.indices_from(cursor0, epoch_world) : sampler.indices();
    const int64_t share = resumed ? sampler.longest_share(cursor0, epoch_world) : sampler.num_samples();
    const int64_t steps = (share + a.batch - 1) / a.batch, epoch_positions = sampler.total_size_for(epoch_world);
    const auto index_tensor = torch::tensor(indices, torch::kLong).to(device);
    for (int64_t step = 0; step < steps; ++step) {
      const int64_t begin = std::min<int64_t>(step * a.batch, static_cast<int64_t>(indices.size()));
      const int64_t len = std::min<int64_t>(a.batch, static_cast<int64_t>(indices.size()) - begin);
      auto batch = index_tensor.narrow(0, begin, len);
      auto x = train.x.index_select(0, batch), y = train.y.index_select(0, batch);

      ddp.zero_grad();  // as torch 2.x's zero_grad(): released, or zeroed in place where .grad is a bucket view
      auto out = ddp->forward(x);
      // An empty batch still takes part in the step (every rank's gradients are averaged): zero loss.
      auto loss = len > 0 ? torch::nn::functional::cross_entropy(out, y) : out.sum() * 0.0;
      loss.backward();   // collects the gradients (averaged over the ranks here, unless the step is fused)
      optimizer->step();  // fused: averages the gradients and updates the parameters in one pass

      samples += len;
      ++steps_run;
      ++pos.global_step;
      if (lead && restart > 0 && steps_run == 1) {
        // How long a restart took, measurable from outside: the wall clock of the first step.
        const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
        fmt::print("restart {}: first step done at {:.3f} (unix time), world size {}\n", restart, now, world);
        std::fflush(stdout);
      }
      const int64_t shown = steps_before + step, shown_total = steps_before + steps;
      if (lead && shown % 10 == 0) {
        last_loss = loss.item<double>();
        fmt::print("epoch: {}, step: {}, loss is {}  {} {}/{}\n", epoch, shown, loss.item<float>(),
                   progress_bar(shown + 1, shown_total), shown + 1, shown_total);
        std::fflush(stdout);
      }
      // Where the epoch's order stands after this step: every rank took a.batch positions.
      const int64_t cursor = std::min(cursor0 + (step + 1) * a.batch * world, epoch_positions);
      cohort::train::TrainingPosition next{epoch, shown + 1, pos.global_step, world, cursor, epoch_world};
      if (step + 1 == steps) next = {epoch + 1, 0, pos.global_step, world, 0, world};
      if (a.checkpoint_every > 0 && pos.global_step % a.checkpoint_every == 0) save(next);
      if (a.kill_after_steps > 0 && steps_run == a.kill_after_steps) {
        std::fflush(stdout);
        std::raise(SIGKILL);  // fault injection for the resume test: no cleanup, no final checkpoint
      }
    }
  }
  examples::wait_for_device(device);
  comm->barrier();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  save({a.epochs, 0, pos.global_step, world, 0, world});

  int64_t total_samples = samples;
  comm->allreduce(&total_samples, &total_samples, 1, cohort::DataType::kInt64, cohort::ReduceOp::kSum);
  double wait = ddp.stats().wait_seconds;
  comm->allreduce(&wait, &wait, 1, cohort::DataType::kFloat64, cohort::ReduceOp::kAvg);
  examples::print_gpu_overlap(ddp.stats(), *comm, lead);

  if (lead) {
    torch::NoGradGuard no_grad;
    model->eval();
    int64_t correct = 0;
    for (int64_t i = 0; i < test.x.size(0); i += 1000) {  // chunks: the cnn's activations are large
      const int64_t n = std::min<int64_t>(1000, test.x.size(0) - i);
      correct += model->forward(test.x.narrow(0, i, n)).argmax(1).eq(test.y.narrow(0, i, n)).sum().item<int64_t>();
    }
    double accuracy = static_cast<double>(correct) / static_cast<double>(test.x.size(0));
    fmt::print("test accuracy: {:.4f}\n", accuracy);
    fmt::print("samples/s: {:.1f} ({} samples on {} ranks in {:.3f} s, {} steps per rank)\n",
               seconds > 0 ? static_cast<double>(total_samples) / seconds : 0.0, total_samples, world, seconds, steps_run);
    fmt::print("communication wait: {:.1f}% of step time ({:.3f} s per rank, averaged over ranks)\n",
               seconds > 0 ? 100.0 * wait / seconds : 0.0, wait);
    if (a.print_digest) fmt::print("final weights digest: {:016x}\n", weights_digest(*model));
    (void)last_loss;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Data-parallel Fashion-MNIST with libtorch and cohort (run under `cohort run`)", "fashion_mnist"};
  Args a;
  app.add_option("--model", a.model, "seed (Flatten, Linear 784->10, ReLU), mlp (784-1024-1024-10) or cnn")
      ->check(CLI::IsMember({"seed", "mlp", "cnn"}));
  app.add_option("--batch", a.batch, "batch size per rank")->check(kAtLeastOne);
  app.add_option("--lr", a.lr, "SGD learning rate")->check(kPositive);
  app.add_option("--epochs", a.epochs, "epochs")->check(kAtLeastOne);
  app.add_option("--data-dir", a.data_dir, "folder with the gzip idx files");
  app.add_option("--seed", a.seed, "seed of the model init and the sampler");
  app.add_option("--train-samples", a.train_samples, "use only the first N training images (0 = all)")->check(kNotNegative);
  app.add_option("--checkpoint-dir", a.checkpoint_dir,
                 "rank 0 writes <dir>/checkpoint.bin (atomically) here; a restarted job resumes from it");
  app.add_option("--checkpoint-every", a.checkpoint_every, "checkpoint every N steps (and at the end)")->check(kNotNegative);
  app.add_flag("--resume", a.resume, "continue from the newest complete checkpoint in --checkpoint-dir (restarts do so anyway)");
  app.add_option("--compression", a.compression, "gradients on the wire: none, fp16 or bf16");
  app.add_option("--sgd", a.sgd,
                 "fused: the SGD step and the averaging of gradients in one pass (cohort::torch::DistributedSGD); "
                 "torch: DDP averages during backward, then torch's SGD step")
      ->check(CLI::IsMember({"fused", "torch"}));
  app.add_option("--device", a.device, "cpu, or cuda: the model on this rank's GPU, gradients reduced by NCCL");
  app.add_option("--bucket-mb", a.bucket_mb, "gradient bucket size in MiB")->check(kPositive);
  app.add_option("--threads", a.threads, "intra-op threads per rank (0: 1 when ranks share a host)")->check(kNotNegative);
  app.add_flag("--verbose", a.verbose, "print the setup (world, BLAS library in use, buckets)");
  app.add_option("--kill-after-steps", a.kill_after_steps, "testing: SIGKILL every rank after N steps of this run");
  app.add_flag("--print-digest", a.print_digest, "print a digest of the final weights (resume tests)");
  return cohort::examples::parse_and_run("fashion_mnist", app, argc, argv, [&] { return run(a); });
}
