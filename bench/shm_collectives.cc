// Intra-host collective benchmark for shm::Group, same method and output as the peers' bench_mpi.c
// (bench/peers): fp32, in-place allreduce (sum) / broadcast (root 0) / allgather, one correctness
// check per size, warm-up 5 ops + ~0.2 s, iterations per trial = ceil(min_time / t_op) (>= 2, max over
// ranks), `trials` timed trials after a barrier, time/op = max over ranks, median/min/max printed as
//   RESULT peer=cohort-shm op=allreduce n=2 bytes=... time_us_median=... busbw_GBps=...
// The ranks are forked processes (COHORT_BENCH_RANKS, default 2) meeting at a pre-agreed address;
// COHORT_BENCH_BIND=1 pins rank r to core r (what mpirun does by default for small jobs);
// COHORT_BENCH_COMM=1 calls the collectives through a Communicator (peer=cohort-shm-comm), whose group
// is the same shm::Group: the difference between the two runs is the communicator layer's cost per call.
// Usage: shm_collectives [allreduce|broadcast|allgather] [sizes,comma,separated] [trials=5] [min_time=0.5] [tag]
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "collectives/reduce_kernels.h"
#include "cohort/communicator.h"
#include "collectives/shm/group.h"
#include "common/strings.h"
#include "store/tcp_store.h"

using cohort::DataType;
using cohort::ReduceOp;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// The three collectives and the barrier, on the group itself or through a Communicator over it
// (COHORT_BENCH_COMM=1: the layer a program calls, with its validation, locks, flight recorder and
// signature checks; the difference between the two is what the layer costs per call).
struct GroupCalls {
  cohort::shm::Group& g;
  int rank() const { return g.rank(); }
  int size() const { return g.size(); }
  void allreduce(void* buf, size_t count, DataType dt, ReduceOp op) { g.allreduce(buf, buf, count, dt, op); }
  void broadcast(float* buf, size_t count, int root) { g.broadcast(buf, count * 4, root); }
  void allgather(const float* in, float* out, size_t per) { g.allgather(in, out, per * 4); }
  void barrier() { g.barrier(); }
};
struct CommCalls {
  cohort::Communicator& c;
  int rank() const { return c.rank(); }
  int size() const { return c.size(); }
  void allreduce(void* buf, size_t count, DataType dt, ReduceOp op) { c.allreduce(buf, buf, count, dt, op); }
  void broadcast(float* buf, size_t count, int root) { c.broadcast(buf, count, DataType::kFloat32, root); }
  void allgather(const float* in, float* out, size_t per) { c.allgather(in, out, per, DataType::kFloat32); }
  void barrier() { c.barrier(); }
};

template <typename Calls>
int run_rank(Calls& g, const std::string& op, const std::vector<size_t>& sizes, int trials,
             double min_time, const std::string& tag) {
  const int n = g.size(), rank = g.rank();
  const int kind = op == "allreduce" ? 0 : op == "broadcast" ? 1 : 2;
  auto maxall = [&](double x) {
    g.allreduce(&x, 1, DataType::kFloat64, ReduceOp::kMax);
    return x;
  };
  for (size_t nbytes : sizes) {
    size_t count, per = 0, total_bytes;
    std::vector<float> buf, recv;
    if (kind == 2) {
      per = std::max<size_t>(1, nbytes / n / 4);
      buf.assign(per, static_cast<float>(rank + 1));
      recv.assign(per * n, 0.0f);
      count = per;
      total_bytes = per * 4 * n;
      g.allgather(buf.data(), recv.data(), per);
      for (int r = 0; r < n; ++r)
        for (size_t i = 0; i < per; ++i)
          if (recv[r * per + i] != r + 1) { std::fprintf(stderr, "allgather wrong\n"); return 1; }
      std::fill(buf.begin(), buf.end(), 0.0f);
      std::fill(recv.begin(), recv.end(), 0.0f);
    } else {
      count = std::max<size_t>(1, nbytes / 4);
      total_bytes = count * 4;
      buf.assign(count, kind == 0 ? rank + 1.0f : rank + 7.0f);
      if (kind == 0) {
        g.allreduce(buf.data(), count, DataType::kFloat32, ReduceOp::kSum);
        for (float v : buf)
          if (v != n * (n + 1) / 2) { std::fprintf(stderr, "allreduce wrong\n"); return 1; }
      } else {
        g.broadcast(buf.data(), count, 0);
        for (float v : buf)
          if (v != 7) { std::fprintf(stderr, "broadcast wrong\n"); return 1; }
      }
      std::fill(buf.begin(), buf.end(), 0.0f);
    }
    auto do_op = [&] {
      if (kind == 0) g.allreduce(buf.data(), count, DataType::kFloat32, ReduceOp::kSum);
      else if (kind == 1) g.broadcast(buf.data(), count, 0);
      else g.allgather(buf.data(), recv.data(), per);
    };
    g.barrier();
    double t0 = now();
    for (int i = 0; i < 5; ++i) do_op();
    double per_op = maxall((now() - t0) / 5);
    long k = static_cast<long>(maxall(std::ceil(0.2 / std::max(per_op, 1e-9))));
    g.barrier();
    t0 = now();
    for (long i = 0; i < k; ++i) do_op();
    per_op = maxall((now() - t0) / k);
    long iters = std::max(2L, static_cast<long>(std::ceil(min_time / std::max(per_op, 1e-9))));
    iters = static_cast<long>(maxall(static_cast<double>(iters)));
    std::vector<double> times(trials);
    for (int t = 0; t < trials; ++t) {
      g.barrier();
      double s = now();
      for (long i = 0; i < iters; ++i) do_op();
      times[t] = maxall((now() - s) / iters);
    }
    std::sort(times.begin(), times.end());
    double med = trials % 2 ? times[trials / 2] : 0.5 * (times[trials / 2 - 1] + times[trials / 2]);
    double algbw = total_bytes / med / 1e9;
    double busbw = kind == 0 ? algbw * 2.0 * (n - 1) / n : kind == 1 ? algbw : algbw * (n - 1.0) / n;
    if (rank == 0)
      std::printf("RESULT peer=cohort-shm%s op=%s n=%d bytes=%zu iters=%ld trials=%d time_us_median=%.2f "
                  "time_us_min=%.2f time_us_max=%.2f algbw_GBps=%.4f busbw_GBps=%.4f kernels=%s\n",
                  tag.c_str(), op.c_str(), n, total_bytes, iters, trials, med * 1e6, times[0] * 1e6,
                  times[trials - 1] * 1e6, algbw, busbw, cohort::kernels::kernel_family());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string op = argc > 1 ? argv[1] : "allreduce";
  if (op != "allreduce" && op != "broadcast" && op != "allgather") {
    std::fprintf(stderr, "usage: %s [allreduce|broadcast|allgather] [sizes] [trials] [min_time] [tag]\n", argv[0]);
    return 2;
  }
  std::vector<size_t> sizes;
  for (const auto& s : cohort::str::split(argc > 2 ? argv[2] : "8,1024,65536,1048576,4194304,16777216,67108864,268435456", ','))
    sizes.push_back(std::stoull(s));
  const int trials = argc > 3 ? std::atoi(argv[3]) : 5;
  const double min_time = argc > 4 ? std::atof(argv[4]) : 0.5;
  const std::string tag = argc > 5 ? argv[5] : "";
  const char* ranks_env = std::getenv("COHORT_BENCH_RANKS");
  const int world = ranks_env ? std::atoi(ranks_env) : 2;
  const char* bind_env = std::getenv("COHORT_BENCH_BIND");
  const bool bind = bind_env != nullptr && std::string(bind_env) == "1";
  const std::string address = cohort::shm::random_address("bench");
  const char* comm_env = std::getenv("COHORT_BENCH_COMM");
  const bool comm = comm_env != nullptr && std::string(comm_env) == "1";
  // The ranks' store for COHORT_BENCH_COMM=1: a file of their own, removed at the end.
  const std::string store_path =
      (std::filesystem::temp_directory_path() / (address.substr(address.find_last_of('/') + 1) + ".store")).string();
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    pid_t pid = ::fork();
    if (pid == 0) {
      if (bind) {  // like mpirun's default --bind-to core for small jobs: rank r on core r
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(r % static_cast<int>(std::max(1u, std::thread::hardware_concurrency())), &set);
        ::sched_setaffinity(0, sizeof set, &set);
      }
      int code = 1;
      try {
        if (comm) {
          cohort::CommOptions o;
          o.timeout = std::chrono::seconds(120);
          auto c = cohort::Communicator::create(cohort::make_file_store(store_path), r, world, o);
          CommCalls calls{*c};
          code = run_rank(calls, op, sizes, trials, min_time, tag + "-comm");
        } else {
          auto g = cohort::shm::Group::create_at(address, r, world, std::chrono::seconds(120),
                                                 cohort::shm::GroupOptions::from_env(world));
          GroupCalls calls{*g};
          code = run_rank(calls, op, sizes, trials, min_time, tag);
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      }
      std::fflush(stdout);
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  int rc = 0;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
  }
  if (comm) ::unlink(store_path.c_str());
  return rc;
}
