// A worker for fsdp_memory_limit_test.cc, run under `cohort run`: an MLP whose data-parallel training does
// not fit the process's memory limit under DDP but does under FSDP.
//
//   memory_limit_worker ddp|fsdp LIMIT_IN_MODELS
//
// The limit is the process's own data segment before the model (libtorch, the communicator, a warmed-up
// wrapper: what this process needs besides the model) plus LIMIT_IN_MODELS times the model's float32
// bytes S, set as RLIMIT_DATA (private writable memory: the heap and anonymous mappings; cohort's
// shared-memory buckets are not in it). AdamW under DDP keeps the whole parameters (S) and two moments
// (2 S) on every rank: 3 S, so a limit of 2 S fails at the first step. FSDP at N ranks keeps the shard, its
// gradient and the moments, 4 S / N, plus a few gathered units of S / 8 each: about 1.6 S at 4 ranks.
// Out of memory is one line on stderr and exit code 3; a run that trains prints its losses.
#include <fmt/format.h>
#include <malloc.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <new>
#include <string>

#include "cohort/communicator.h"
#include "cohort/torch/ddp.h"
#include "cohort/torch/fsdp.h"

namespace {

constexpr int64_t kWidth = 1024, kLayers = 8, kBatch = 16, kSteps = 3;

// This process's data segment now (VmData of /proc/self/status: what RLIMIT_DATA counts), in bytes.
int64_t status_field(const char* name) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(name, 0) == 0) return std::stoll(line.substr(std::strlen(name)));
  throw std::runtime_error(fmt::format("/proc/self/status has no {} line", name));
}
int64_t data_bytes() { return status_field("VmData:") * 1024; }

torch::nn::Sequential make_mlp(int64_t width, int64_t layers) {
  torch::nn::Sequential net;
  for (int64_t i = 0; i < layers; ++i) {
    net->push_back(torch::nn::Linear(width, width));
    if (i + 1 < layers) net->push_back(torch::nn::Tanh());
  }
  return net;
}

int64_t numel(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

// kSteps steps of AdamW on a fixed regression batch (every rank its own rows); returns the losses.
template <typename Wrapper>
std::vector<double> train(Wrapper& model, const std::vector<torch::Tensor>& params, int rank, int64_t width) {
  torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(1e-3));
  torch::manual_seed(100 + rank);
  const auto x = torch::randn({kBatch, width}), y = torch::randn({kBatch, width}) * 0.1;
  std::vector<double> losses;
  for (int64_t step = 0; step < kSteps; ++step) {
    optimizer.zero_grad();
    auto loss = torch::mse_loss(model.forward(x), y);
    loss.backward();
    optimizer.step();
    losses.push_back(loss.template item<double>());
    if (rank == 0 && std::getenv("MEMORY_LIMIT_TRACE"))
      fmt::print("step {}: data segment {:.1f} MB, {} threads\n", step, data_bytes() / 1e6, status_field("Threads:"));
  }
  return losses;
}

std::vector<double> run(const std::string& mode, torch::nn::Sequential net, std::shared_ptr<cohort::Communicator> comm,
                        int64_t width) {
  const int rank = comm->rank();
  if (rank == 0 && std::getenv("MEMORY_LIMIT_TRACE"))
    fmt::print("before wrapping: data segment {:.1f} MB, {} threads\n", data_bytes() / 1e6, status_field("Threads:"));
  if (mode == "ddp") {
    cohort::torch::DistributedDataParallel ddp(net, comm);
    return train(ddp, ddp.parameters(), rank, width);
  }
  cohort::torch::FSDPOptions options;
  options.auto_wrap_module_types = {"torch::nn::LinearImpl"};  // every layer a unit
  cohort::torch::FullyShardedDataParallel fsdp(net, comm, options);
  return train(fsdp, fsdp.parameters(), rank, width);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 || (std::string(argv[1]) != "ddp" && std::string(argv[1]) != "fsdp")) {
    std::fprintf(stderr, "usage: memory_limit_worker ddp|fsdp LIMIT_IN_MODELS\n");
    return 2;
  }
  const std::string mode = argv[1];
  const double models = std::stod(argv[2]);
  // RLIMIT_DATA counts address space, not resident pages: glibc's heap, whose mmap threshold rises to
  // the largest block freed, would keep a layer's 4 MiB tensors in holes of a heap that only grows, and
  // the limit would measure the heap's fragmentation. A fixed threshold maps every block of 1 MiB or
  // more and unmaps it when freed, so the data segment follows the live tensors (as a cgroup's resident
  // memory does after malloc_trim, what DDP and FSDP call).
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
#endif
  torch::set_num_threads(1);
  auto comm = cohort::Communicator::from_env();
  const int rank = comm->rank();
  try {
    // Warm up with the same wrapper on a tiny model: whatever libtorch, the wrapper and the communicator
    // allocate once (threads, pools) is in the data segment measured next, not charged to the model.
    torch::manual_seed(0);
    run(mode, make_mlp(16, 2), comm, 16);

    torch::manual_seed(0);
    torch::nn::Sequential net = make_mlp(kWidth, kLayers);
    const int64_t model_bytes = numel(*net) * static_cast<int64_t>(sizeof(float));
    // The model exists on every rank before it is wrapped (as in any libtorch program): it is in the
    // data segment measured here, and the limit grants LIMIT_IN_MODELS models on top of it.
    const int64_t base = data_bytes() - model_bytes;
    const auto limit = static_cast<rlim_t>(base + static_cast<int64_t>(models * static_cast<double>(model_bytes)));
    rlimit rl{limit, limit};
    if (setrlimit(RLIMIT_DATA, &rl) != 0) throw std::runtime_error("setrlimit(RLIMIT_DATA) failed");
    if (rank == 0)
      fmt::print("{}: model {:.1f} MB of float32 parameters; RLIMIT_DATA {:.1f} MB = the process {:.1f} MB + {} models\n",
                 mode, model_bytes / 1e6, static_cast<double>(limit) / 1e6, base / 1e6, models);
    const auto losses = run(mode, net, comm, kWidth);
    if (rank == 0) fmt::print("{}: trained {} steps under the limit, losses {:.5f} -> {:.5f}\n", mode, losses.size(),
                              losses.front(), losses.back());
    std::fflush(stdout);
    comm->barrier();
    return 0;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "rank %d: out of memory under RLIMIT_DATA (%s): std::bad_alloc\n", rank, mode.c_str());
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    what = what.substr(0, what.find('\n'));
    if (what.find("can't allocate memory") == std::string::npos) throw;
    std::fprintf(stderr, "rank %d: out of memory under RLIMIT_DATA (%s): %s\n", rank, mode.c_str(), what.c_str());
  }
  return 3;
}
