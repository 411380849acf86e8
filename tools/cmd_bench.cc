// `cohort bench {allreduce,allgather,reduce_scatter,broadcast,alltoall,gather,scatter,sendrecv}`: nccl-tests-style
// collective benchmarks, run on every rank under `cohort run -n N` (the communicator comes from
// Communicator::from_env()), or started by hand without any launcher's variables as one rank alone
// (as nccl-tests' all_reduce_perf runs by itself); `cohort bench memcpy` measures this machine's memcpy
// bandwidth.
//
// Flags follow nccl-tests: -b/-e/-f sizes (K/M/G suffixes), -n iterations, -w warm-up, -c/--check,
// -d dtype, -o op, -r root. Columns: size, count, type, redop, root, time (us), algbw, busbw (GB/s)
// and #wrong with --check. busbw = algbw x factor (nccl-tests PERFORMANCE.md): allreduce 2(n-1)/n,
// allgather and reduce_scatter and alltoall (n-1)/n, broadcast and sendrecv 1; gather and scatter
// (which nccl-tests lacks) (n-1)/n, as bench/peers/bench_mpi.c. The size of allgather, reduce_scatter,
// alltoall, gather and scatter is the whole buffer of n blocks.
//
// --no-cache-reuse: every iteration works on the next of several buffer sets, together more than twice
// the last-level cache, so that no iteration finds its inputs in the cache the previous one left them
// in (an application moves fresh data each step; a benchmark that reuses one buffer measures the cache).
//
// --buffers shared: every host buffer comes from Communicator::allocate_shared (memory the ranks of one host
// all map, as DDP's buckets are), so the collectives copy between the ranks' buffers with plain loads and
// stores instead of process_vm_readv/writev, and the in-place allreduce reduces the peers' buffers where
// they lie (docs/algorithms-shm.md). "# copies" says how many bytes went which way.
//
// Timing (the peers' method, bench/peers/README.md, "Method"): values zero during timing after one
// checked run with rank-dependent values (with --check); warm-up of -w ops and then about 0.2 s;
// iterations per trial = the smallest count estimated to take >= --min-time (0.5 s), at least 2,
// unless -n is given; --trials (5) trials, each after a barrier; a trial's time per op is the max
// over ranks; the reported time is the median of the trials.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "cohort/gpu.h"
#include "cohort/types.h"
#include "command.h"
#include "comm/launch_env.h"
#include "common/env.h"
#include "common/elements.h"
#include "common/half.h"
#include "png_plot.h"
#include "store/memory_store.h"

namespace cohort::tools {
namespace {

using Clock = std::chrono::steady_clock;

enum class Kind { kAllreduce, kAllgather, kReduceScatter, kBroadcast, kAlltoall, kGather, kScatter, kSendrecv };

struct BenchOptions {
  uint64_t min_bytes = 8;
  uint64_t max_bytes = 64ull << 20;
  double factor = 2;
  int iters = 0;  // 0: automatic
  int warmup = 5;
  bool check = false;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  int trials = 5;
  double min_time = 0.5;
  std::string csv;
  std::string plot;
  std::string device = "cpu";    // cpu | cuda
  std::string gpu_path = "auto";  // with cuda: auto | nccl | staged
  bool no_cache_reuse = false;
  uint64_t cache_bytes = 0;  // the cache --no-cache-reuse outgrows; 0: the L3 the system reports
  bool shared_buffers = false;  // --buffers shared
};

// One host buffer of a case: ordinary memory, or (--buffers shared) allocate_shared memory, which is a
// collective call: every rank makes the same buffers in the same order. Every page is written here, so
// that no timed call reads a page the kernel has not yet given it (an untouched page reads as the shared
// zero page, from the cache: "Why Open MPI looked twice as fast", docs/algorithms-shm.md).
class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(Communicator& comm, size_t bytes, bool shared) : bytes_(bytes) {
    if (bytes == 0) return;
    if (shared) memory_ = std::static_pointer_cast<char>(comm.allocate_shared(bytes));
    else memory_ = std::shared_ptr<char>(new char[bytes], std::default_delete<char[]>());
    explicit_bzero(memory_.get(), bytes);
  }
  char* data() const { return memory_.get(); }
  size_t size() const { return bytes_; }
  bool empty() const { return bytes_ == 0; }
  char* begin() const { return data(); }
  char* end() const { return data() + bytes_; }

 private:
  std::shared_ptr<char> memory_;
  size_t bytes_ = 0;
};

// The last-level (L3) cache of the CPU this thread runs on, from sysfs (else sysconf); 0 if unknown.
size_t l3_cache_bytes() {
  if (std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index3/size"); f) {
    size_t kib = 0;
    char unit = 0;
    if (f >> kib >> unit && kib > 0) return unit == 'M' ? kib << 20 : kib << 10;
  }
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return l3 > 0 ? static_cast<size_t>(l3) : 0;
}

// --no-cache-reuse: how many buffer sets of `set_bytes` make more than twice the L3 (at least 2).
size_t rotation_sets(size_t set_bytes, size_t l3) {
  if (set_bytes == 0) return 1;
  return std::max<size_t>(2, (2 * l3 + set_bytes) / set_bytes);
}

double bus_factor(Kind k, int n) {
  switch (k) {
    case Kind::kAllreduce: return n > 1 ? 2.0 * (n - 1) / n : 0.0;
    case Kind::kAllgather:
    case Kind::kReduceScatter:
    case Kind::kAlltoall:
    case Kind::kGather:
    case Kind::kScatter: return n > 1 ? static_cast<double>(n - 1) / n : 0.0;
    case Kind::kBroadcast:
    case Kind::kSendrecv: return 1.0;
  }
  return 1.0;
}

bool reduces(Kind k) { return k == Kind::kAllreduce || k == Kind::kReduceScatter; }

// ---- --check: common/elements.h's inputs and references (the test suites use the same) ----
// One benchmark size: buffers and the operation on them. With --device cuda the operation runs on
// GPU copies of the buffers (`device` >= 0); the host vectors then only carry --check's values.
class Case {
 public:
  Case(Communicator& comm, Kind kind, const BenchOptions& o, size_t bytes, int device = -1)
      : comm_(comm), kind_(kind), o_(o), n_(comm.size()), r_(comm.rank()), esize_(dtype_size(o.dtype)),
        device_(device) {
    const size_t n = static_cast<size_t>(n_);
    count_ = bytes / esize_;
    if (kind == Kind::kAllgather || kind == Kind::kReduceScatter || kind == Kind::kAlltoall ||
        kind == Kind::kGather || kind == Kind::kScatter) {
      per_rank_ = count_ / n;
      count_ = per_rank_ * n;
    } else {
      per_rank_ = count_;
    }
    size_t send_bytes = count_ * esize_, recv_bytes = count_ * esize_;
    switch (kind) {
      case Kind::kAllreduce:
      case Kind::kBroadcast: recv_bytes = 0; break;
      case Kind::kAllgather:
      case Kind::kGather: send_bytes = per_rank_ * esize_; break;
      case Kind::kReduceScatter:
      case Kind::kScatter: recv_bytes = per_rank_ * esize_; break;
      case Kind::kAlltoall:
      case Kind::kSendrecv: break;
    }
    const bool shared = o.shared_buffers && device_ < 0;
    send_ = HostBuffer(comm, send_bytes, shared);
    recv_ = HostBuffer(comm, recv_bytes, shared);
    if (o.no_cache_reuse && device_ < 0) {
      // Sets 1.. besides send_/recv_ (set 0), each page touched so that no timed iteration faults.
      sets_ = rotation_sets(send_.size() + recv_.size(), o.cache_bytes);
      for (size_t k = 1; k < sets_; ++k) {
        extra_send_.emplace_back(comm, send_bytes, shared);
        extra_recv_.emplace_back(comm, recv_bytes, shared);
      }
    }
    if (device_ >= 0) {
      dsend_ = gpu::allocate_device(send_.size(), device_);
      if (!recv_.empty()) drecv_ = gpu::allocate_device(recv_.size(), device_);
      to_device();
    }
  }
  size_t bytes() const { return count_ * esize_; }
  // Buffer sets the iterations rotate through (1 without --no-cache-reuse), and their bytes together.
  size_t sets() const { return sets_; }
  size_t footprint() const { return sets_ * (send_.size() + recv_.size()); }
  size_t count() const { return count_; }
  bool empty() const { return count_ == 0; }

  void run() {
    void* s = send_buf();
    void* r = recv_buf();
    switch (kind_) {
      case Kind::kAllreduce: comm_.allreduce(s, s, count_, o_.dtype, o_.op); break;
      case Kind::kBroadcast: comm_.broadcast(s, count_, o_.dtype, o_.root); break;
      case Kind::kAllgather: comm_.allgather(s, r, per_rank_, o_.dtype); break;
      case Kind::kReduceScatter: comm_.reduce_scatter(s, r, per_rank_, o_.dtype, o_.op); break;
      case Kind::kAlltoall: comm_.alltoall(s, r, per_rank_, o_.dtype); break;
      case Kind::kGather: comm_.gather(s, r, per_rank_, o_.dtype, o_.root); break;
      case Kind::kScatter: comm_.scatter(s, r, per_rank_, o_.dtype, o_.root); break;
      case Kind::kSendrecv: sendrecv(s, r); break;
    }
    set_ = (set_ + 1) % sets_;
  }

  // Waits on the host for GPU work queued so far (nothing to do in host memory).
  void synchronize() {
    if (device_ >= 0) gpu::synchronize(comm_);
  }

  // Fills rank-dependent inputs, runs once, counts wrong elements on this rank; leaves zeros.
  int64_t check() {
    set_ = 0;  // the check's values live in set 0
    fill_inputs();
    to_device();
    run();
    from_device();
    int64_t wrong = 0;
    auto expect = [&](const void* buf, size_t i, double want) {
      if (std::fabs(load_element(buf, i, o_.dtype) - want) > check_tolerance(o_.dtype, want)) ++wrong;
    };
    const size_t n = static_cast<size_t>(n_);
    switch (kind_) {
      case Kind::kAllreduce:
        for (size_t i = 0; i < count_; ++i) expect(send_.data(), i, check_expected(n_, i, o_.dtype, o_.op));
        break;
      case Kind::kBroadcast:
        for (size_t i = 0; i < count_; ++i) expect(send_.data(), i, check_input(o_.root, i, o_.dtype, o_.op));
        break;
      case Kind::kAllgather:
        for (size_t i = 0; i < count_; ++i) expect(recv_.data(), i, check_input(static_cast<int>(i / per_rank_), i % per_rank_, o_.dtype, o_.op));
        break;
      case Kind::kReduceScatter:
        for (size_t i = 0; i < per_rank_; ++i) expect(recv_.data(), i, check_expected(n_, static_cast<size_t>(r_) * per_rank_ + i, o_.dtype, o_.op));
        break;
      case Kind::kAlltoall:
        for (size_t i = 0; i < count_; ++i) {
          expect(recv_.data(), i, check_input(static_cast<int>(i / per_rank_), static_cast<size_t>(r_) * per_rank_ + i % per_rank_, o_.dtype, o_.op));
        }
        break;
      case Kind::kGather:
        if (r_ == o_.root)
          for (size_t i = 0; i < count_; ++i)
            expect(recv_.data(), i, check_input(static_cast<int>(i / per_rank_), i % per_rank_, o_.dtype, o_.op));
        break;
      case Kind::kScatter:
        for (size_t i = 0; i < per_rank_; ++i)
          expect(recv_.data(), i, check_input(o_.root, static_cast<size_t>(r_) * per_rank_ + i, o_.dtype, o_.op));
        break;
      case Kind::kSendrecv:
        for (size_t i = 0; i < count_; ++i) expect(recv_.data(), i, check_input((r_ + n_ - 1) % n_, i, o_.dtype, o_.op));
        break;
    }
    set_ = 0;
    (void)n;
    std::fill(send_.begin(), send_.end(), 0);
    std::fill(recv_.begin(), recv_.end(), 0);
    to_device();
    return wrong;
  }

 private:
  void* send_buf() { return dsend_ ? dsend_.get() : set_ == 0 ? send_.data() : extra_send_[set_ - 1].data(); }
  void* recv_buf() { return drecv_ ? drecv_.get() : set_ == 0 ? recv_.data() : extra_recv_[set_ - 1].data(); }
  void to_device() {
    if (dsend_) gpu::copy_memory(dsend_.get(), send_.data(), send_.size());
    if (drecv_) gpu::copy_memory(drecv_.get(), recv_.data(), recv_.size());
  }
  void from_device() {
    if (dsend_) gpu::copy_memory(send_.data(), dsend_.get(), send_.size());
    if (drecv_) gpu::copy_memory(recv_.data(), drecv_.get(), recv_.size());
  }

  void fill_inputs() {
    // Inputs hold this rank's values (broadcast: only the root's matter; the others start at zero).
    const size_t n_in = kind_ == Kind::kAllgather || kind_ == Kind::kGather ? per_rank_ : count_;
    for (size_t i = 0; i < n_in; ++i) {
      double v = check_input(r_, i, o_.dtype, o_.op);
      if ((kind_ == Kind::kBroadcast || kind_ == Kind::kScatter) && r_ != o_.root) v = 0;
      store_element(send_.data(), i, o_.dtype, v);
    }
    std::fill(recv_.begin(), recv_.end(), 0);
  }
  // Each rank sends to r+1 and receives from r-1. The communicator's send/recv block, so the
  // exchange is ordered to avoid a cycle: with an even world, even ranks send first and odd ranks
  // receive first (both directions of every pair run at once); with an odd world, rank 0 starts a
  // chain. (--check verifies the data.)
  void sendrecv(void* s, void* r) {
    if (n_ == 1) {
      if (dsend_) gpu::copy_memory(r, s, send_.size());
      else std::memcpy(r, s, send_.size());
      return;
    }
    const int right = (r_ + 1) % n_, left = (r_ + n_ - 1) % n_;
    const bool send_first = (n_ % 2 == 0) ? (r_ % 2 == 0) : (r_ == 0);
    if (send_first) {
      comm_.send(s, count_, o_.dtype, right);
      comm_.recv(r, count_, o_.dtype, left);
    } else {
      comm_.recv(r, count_, o_.dtype, left);
      comm_.send(s, count_, o_.dtype, right);
    }
  }

  Communicator& comm_;
  Kind kind_;
  const BenchOptions& o_;
  int n_, r_;
  size_t esize_;
  size_t count_ = 0, per_rank_ = 0;
  HostBuffer send_, recv_;
  std::vector<HostBuffer> extra_send_, extra_recv_;  // --no-cache-reuse: sets 1..sets_-1
  size_t sets_ = 1, set_ = 0;                               // the set the next run() uses
  int device_ = -1;
  std::shared_ptr<void> dsend_, drecv_;  // GPU copies (--device cuda)
};

double max_over_ranks(Communicator& comm, double v) {
  comm.allreduce(&v, &v, 1, DataType::kFloat64, ReduceOp::kMax);
  return v;
}

// Seconds per op of `iters` back-to-back operations on this rank. GPU operations are queued in
// stream order: the time runs until the last has run on the GPU (as nccl-tests synchronises).
double time_ops(Case& c, int64_t iters) {
  auto t0 = Clock::now();
  for (int64_t i = 0; i < iters; ++i) c.run();
  c.synchronize();
  return std::chrono::duration<double>(Clock::now() - t0).count() / static_cast<double>(iters);
}

struct Row {
  size_t bytes, count;
  double time_us, algbw, busbw;
  int64_t wrong;  // -1 when not checked
};

std::string root_column(Kind k, const BenchOptions& o) {
  return k == Kind::kBroadcast || k == Kind::kGather || k == Kind::kScatter ? std::to_string(o.root) : "-1";
}

int run_bench(Kind kind, const std::string& name, std::vector<std::string> args) {
  BenchOptions o;
  std::string min_s = "8", max_s = "64M", dtype_s = "float", op_s = "sum", cache_s = "0";
  // nccl-tests spells "-c 1" / "-c 0"; accept that as well as a bare -c / --check.
  std::vector<std::string> argv{args[0]};
  for (size_t i = 1; i < args.size(); ++i) {
    if ((args[i] == "-c" || args[i] == "--check") && i + 1 < args.size() && (args[i + 1] == "0" || args[i + 1] == "1")) {
      if (args[i + 1] == "1") argv.push_back("--check");
      ++i;
      continue;
    }
    argv.push_back(args[i]);
  }
  CLI::App app("cohort " + name + ": nccl-tests-style benchmark; run under `cohort run -n N`, or alone as one rank",
               "cohort " + name);
  app.add_option("-b,--minbytes", min_s, "smallest size in bytes (K/M/G suffixes)")->capture_default_str();
  app.add_option("-e,--maxbytes", max_s, "largest size in bytes (K/M/G suffixes)")->capture_default_str();
  app.add_option("-f,--stepfactor", o.factor, "multiply the size by this between steps")->capture_default_str();
  app.add_option("-n,--iters", o.iters, "iterations per trial (0: smallest count taking >= --min-time)")
      ->capture_default_str();
  app.add_option("-w,--warmup_iters", o.warmup, "warm-up iterations (then ~0.2 s more when -n is 0)")
      ->capture_default_str();
  app.add_flag("-c,--check", o.check, "check results once per size (rank-dependent inputs); prints #wrong");
  app.add_option("-d,--datatype", dtype_s, "int8 uint8 int32 int64 half bfloat16 float double")->capture_default_str();
  app.add_option("-o,--op", op_s, "sum prod min max avg")->capture_default_str();
  app.add_option("-r,--root", o.root, "root rank (broadcast, gather, scatter)")->capture_default_str();
  app.add_flag("--no-cache-reuse", o.no_cache_reuse,
               "rotate the iterations through buffer sets larger than twice the L3 cache, so that no iteration "
               "finds its data in the cache");
  app.add_option("--cache-bytes", cache_s,
                 "with --no-cache-reuse: the cache to outgrow (K/M/G; 0: the L3 this CPU reports, 32M if none)")
      ->capture_default_str();
  std::string buffers = "private";
  app.add_option("--buffers", buffers,
                 "host buffers: private (ordinary memory) or shared (Communicator::allocate_shared: the ranks of a "
                 "host map each other's, and the collectives copy between them directly)")
      ->capture_default_str();
  app.add_option("--trials", o.trials, "timed trials per size; the median is reported")->capture_default_str();
  app.add_option("--min-time", o.min_time, "seconds each trial should last when -n is 0")->capture_default_str();
  app.add_option("--csv", o.csv, "also write the table as CSV to this file (rank 0)");
  app.add_option("--plot", o.plot, "also draw busbw against size into this PNG file (rank 0)");
  app.add_option("--device", o.device, "cpu, or cuda: buffers in GPU memory, moved by NCCL (one GPU per rank)")
      ->capture_default_str();
  app.add_option("--gpu-path", o.gpu_path, "with --device cuda: auto, nccl, or staged (through host memory)")
      ->capture_default_str();
  if (!parse_command_line(app, argv)) return 0;
  o.min_bytes = env::parse_bytes("-b", min_s);
  o.max_bytes = env::parse_bytes("-e", max_s);
  o.cache_bytes = env::parse_bytes("--cache-bytes", cache_s);
  if (o.cache_bytes == 0) o.cache_bytes = l3_cache_bytes() ? l3_cache_bytes() : size_t{32} << 20;
  auto dt = parse_dtype(dtype_s);
  if (!dt) throw InvalidArgument(fmt::format("unknown datatype '{}'", dtype_s));
  o.dtype = *dt;
  auto op = parse_reduce_op(op_s);
  if (!op) throw InvalidArgument(fmt::format("unknown op '{}'", op_s));
  o.op = *op;
  if (reduces(kind) && !op_supported(o.dtype, o.op)) {
    throw InvalidArgument(fmt::format("op {} is not defined on {}", op_s, dtype_s));
  }
  if (o.factor <= 1.0 && o.min_bytes != o.max_bytes) throw InvalidArgument("-f must be > 1");
  if (o.min_bytes > o.max_bytes) throw InvalidArgument("-b must not exceed -e");
  if (o.trials < 1 || o.warmup < 0 || o.iters < 0) throw InvalidArgument("--trials >= 1, -w >= 0, -n >= 0");

  if (o.device != "cpu" && o.device != "cuda")
    throw InvalidArgument(fmt::format("--device {}: expected cpu or cuda", o.device));
  if (buffers != "private" && buffers != "shared")
    throw InvalidArgument(fmt::format("--buffers {}: expected private or shared", buffers));
  o.shared_buffers = buffers == "shared";
  if (o.shared_buffers && o.device != "cpu") throw InvalidArgument("--buffers shared is for host memory (--device cpu)");
  if (o.no_cache_reuse && o.device != "cpu")
    throw InvalidArgument("--no-cache-reuse is for host memory (--device cpu)");
  if (o.gpu_path != "auto" && o.gpu_path != "nccl" && o.gpu_path != "staged")
    throw InvalidArgument(fmt::format("--gpu-path {}: expected auto, nccl or staged", o.gpu_path));
  // Started by hand: one rank, its own world (the operations copy within the process). Under a
  // launcher, the job's world.
  std::shared_ptr<Communicator> comm =
      comm::has_launch_env([](const std::string& n) { return env::get_raw(n); })
          ? Communicator::from_env()
          : Communicator::create(std::make_shared<MemoryStore>(), 0, 1);
  const std::string link = comm->link_report();  // rank 0's view of the intra-host link, measured at start
  int device = -1;
  std::string device_line = "host memory";
  if (o.device == "cuda") {
    gpu::DeviceOptions d;
    d.path = o.gpu_path == "nccl" ? gpu::DevicePath::kNccl
             : o.gpu_path == "staged" ? gpu::DevicePath::kStaged
                                      : gpu::DevicePath::kAuto;
    d.device = gpu::local_device();
    device = d.device;
    comm = gpu::make_device_communicator(comm, d);
    device_line = fmt::format("GPU memory (device {} of rank 0; {})", device, gpu::device_path_of(*comm));
  }
  const int n = comm->size();
  if (o.root < 0 || o.root >= n) throw InvalidArgument(fmt::format("root {} out of range (0..{})", o.root, n - 1));
  const bool leader = comm->rank() == 0;
  const std::string redop = reduces(kind) ? std::string(reduce_op_name(o.op)) : "none";
  if (leader) {
    fmt::print("# cohort {}: {} ranks, dtype {}, op {}, {}, {} trials (median; time = max over ranks)\n", name, n,
               dtype_name(o.dtype), redop,
               o.iters ? fmt::format("{} iterations per trial", o.iters)
                       : fmt::format("iterations per trial: smallest count taking >= {} s", o.min_time),
               o.trials);
    fmt::print("# buffers: {}{}{}\n", device_line, o.shared_buffers ? " (allocate_shared: the peers map them)" : "",
               o.no_cache_reuse
                   ? fmt::format("; --no-cache-reuse: each size rotates through buffer sets > 2 x the cache ({} MiB)",
                                 o.cache_bytes >> 20)
                   : "");
    if (!link.empty()) fmt::print("# link: {}\n", link);
    fmt::print("#\n# {:>12} {:>12} {:>8} {:>6} {:>6} {:>10} {:>8} {:>8} {:>7}\n", "size", "count", "type", "redop",
               "root", "time", "algbw", "busbw", "#wrong");
    fmt::print("# {:>12} {:>12} {:>8} {:>6} {:>6} {:>10} {:>8} {:>8} {:>7}\n", "(B)", "(elements)", "", "", "", "(us)",
               "(GB/s)", "(GB/s)", "");
    std::fflush(stdout);
  }
  std::vector<Row> rows;
  for (double sz = static_cast<double>(o.min_bytes); sz <= static_cast<double>(o.max_bytes) * (1 + 1e-9);
       sz = o.factor > 1 ? sz * o.factor : sz + 1) {
    Case c(*comm, kind, o, static_cast<size_t>(sz), device);
    if (c.empty()) {
      if (o.factor <= 1) break;
      continue;
    }
    if (leader && c.sets() > 1)
      fmt::print("# {} B: {} buffer sets, {} MiB per rank\n", c.bytes(), c.sets(), c.footprint() >> 20);
    int64_t wrong = -1;
    if (o.check) {
      int64_t w = c.check();
      comm->allreduce(&w, &w, 1, DataType::kInt64, ReduceOp::kSum);
      wrong = w;
    }
    int64_t iters = o.iters;
    double est = o.warmup > 0 ? max_over_ranks(*comm, time_ops(c, o.warmup)) : 0;
    if (iters == 0) {
      if (est <= 0) est = max_over_ranks(*comm, time_ops(c, 1));
      // About 0.2 s more warm-up, then re-estimate from it.
      int64_t more = std::clamp<int64_t>(static_cast<int64_t>(0.2 / est), 1, 1 << 24);
      est = max_over_ranks(*comm, time_ops(c, more));
      iters = std::clamp<int64_t>(static_cast<int64_t>(std::ceil(o.min_time / est)), 2, 1 << 26);
    }
    std::vector<double> trials;
    for (int t = 0; t < o.trials; ++t) {
      comm->barrier();
      trials.push_back(max_over_ranks(*comm, time_ops(c, iters)));
    }
    std::sort(trials.begin(), trials.end());
    const double sec = trials.size() % 2 ? trials[trials.size() / 2]
                                         : 0.5 * (trials[trials.size() / 2 - 1] + trials[trials.size() / 2]);
    Row row{c.bytes(), c.count(), sec * 1e6, static_cast<double>(c.bytes()) / sec / 1e9, 0, wrong};
    row.busbw = row.algbw * bus_factor(kind, n);
    rows.push_back(row);
    if (leader) {
      fmt::print("  {:>12} {:>12} {:>8} {:>6} {:>6} {:>10.2f} {:>8.3f} {:>8.3f} {:>7}\n", row.bytes, row.count,
                 dtype_name(o.dtype), redop, root_column(kind, o), row.time_us, row.algbw, row.busbw,
                 wrong < 0 ? std::string("N/A") : std::to_string(wrong));
      std::fflush(stdout);
    }
    if (o.factor <= 1) break;
  }
  // Every rank's share of the copies (the single-copy path splits them between the ranks; a rank that
  // copies much more than another is the slowest). Means over all calls, warm-up included: exact for a
  // run of one size.
  if (const std::string copies = comm->copy_report(); !copies.empty())
    fmt::print("# copies, rank {}: {}\n", comm->rank(), copies);
  int64_t total_wrong = 0;
  double sum_bus = 0;
  for (const auto& r : rows) total_wrong += std::max<int64_t>(0, r.wrong), sum_bus += r.busbw;
  if (leader) {
    fmt::print("# Out of bounds values : {} {}\n", total_wrong, total_wrong ? "FAILED" : "OK");
    fmt::print("# Avg bus bandwidth    : {:.4f}\n#\n", rows.empty() ? 0.0 : sum_bus / static_cast<double>(rows.size()));
    if (!o.csv.empty()) {
      std::ofstream f(o.csv);
      f << "op,ranks,size_bytes,count,type,redop,root,time_us,algbw_gbps,busbw_gbps,wrong\n";
      for (const auto& r : rows) {
        f << fmt::format("{},{},{},{},{},{},{},{:.3f},{:.4f},{:.4f},{}\n", name.substr(6), n, r.bytes, r.count,
                         dtype_name(o.dtype), redop, root_column(kind, o), r.time_us, r.algbw, r.busbw,
                         r.wrong < 0 ? std::string("") : std::to_string(r.wrong));
      }
      if (!f) throw Error("cannot write " + o.csv);
    }
    if (!o.plot.empty()) {
      png::Series s{{}, {}, {31, 119, 180}};
      for (const auto& r : rows) s.bytes.push_back(static_cast<double>(r.bytes)), s.gbps.push_back(r.busbw);
      png::plot_bandwidth(o.plot, {s});
    }
  }
  return total_wrong ? 1 : 0;
}

// Single-process memcpy bandwidth over the same size sweep, the ceiling for any copy-based path.
int run_memcpy(std::vector<std::string> args) {
  std::string min_s = "1K", max_s = "256M";
  double factor = 4, min_time = 0.2;
  CLI::App app("cohort bench memcpy: memcpy bandwidth of this machine (one thread)", "cohort bench memcpy");
  app.add_option("-b,--minbytes", min_s)->capture_default_str();
  app.add_option("-e,--maxbytes", max_s)->capture_default_str();
  app.add_option("-f,--stepfactor", factor)->capture_default_str();
  app.add_option("--min-time", min_time, "seconds per size")->capture_default_str();
  if (!parse_command_line(app, args)) return 0;
  const uint64_t lo = env::parse_bytes("-b", min_s), hi = env::parse_bytes("-e", max_s);
  if (factor <= 1 || lo == 0 || lo > hi) throw InvalidArgument("need 0 < -b <= -e and -f > 1");
  fmt::print("# memcpy, 1 thread; GB/s = bytes copied per second (read+write traffic is twice that)\n");
  fmt::print("# {:>12} {:>10} {:>8}\n", "size (B)", "time (us)", "GB/s");
  for (double sz = static_cast<double>(lo); sz <= static_cast<double>(hi) * (1 + 1e-9); sz *= factor) {
    const size_t bytes = static_cast<size_t>(sz);
    std::vector<char> a(bytes, 1), b(bytes, 2);
    std::memcpy(b.data(), a.data(), bytes);  // touch and warm
    int64_t iters = 1;
    double sec = 0;
    for (;;) {
      auto t0 = Clock::now();
      for (int64_t i = 0; i < iters; ++i) {
        std::memcpy(b.data(), a.data(), bytes);
        asm volatile("" : : "r"(b.data()) : "memory");
      }
      sec = std::chrono::duration<double>(Clock::now() - t0).count();
      if (sec >= min_time || iters >= (1ll << 40)) break;
      iters *= 2;
    }
    const double per = sec / static_cast<double>(iters);
    fmt::print("  {:>12} {:>10.2f} {:>8.2f}\n", bytes, per * 1e6, static_cast<double>(bytes) / per / 1e9);
  }
  return 0;
}

Registration r_allreduce("bench allreduce", "nccl-tests-style allreduce benchmark (under cohort run)",
                         [](std::vector<std::string> a) { return run_bench(Kind::kAllreduce, "bench allreduce", a); });
Registration r_allgather("bench allgather", "nccl-tests-style allgather benchmark (under cohort run)",
                         [](std::vector<std::string> a) { return run_bench(Kind::kAllgather, "bench allgather", a); });
Registration r_reduce_scatter("bench reduce_scatter", "nccl-tests-style reduce_scatter benchmark (under cohort run)",
                              [](std::vector<std::string> a) {
                                return run_bench(Kind::kReduceScatter, "bench reduce_scatter", a);
                              });
Registration r_broadcast("bench broadcast", "nccl-tests-style broadcast benchmark (under cohort run)",
                         [](std::vector<std::string> a) { return run_bench(Kind::kBroadcast, "bench broadcast", a); });
Registration r_alltoall("bench alltoall", "nccl-tests-style alltoall benchmark (under cohort run)",
                        [](std::vector<std::string> a) { return run_bench(Kind::kAlltoall, "bench alltoall", a); });
Registration r_gather("bench gather", "nccl-tests-style gather benchmark to rank -r (under cohort run)",
                      [](std::vector<std::string> a) { return run_bench(Kind::kGather, "bench gather", a); });
Registration r_scatter("bench scatter", "nccl-tests-style scatter benchmark from rank -r (under cohort run)",
                       [](std::vector<std::string> a) { return run_bench(Kind::kScatter, "bench scatter", a); });
Registration r_sendrecv("bench sendrecv", "nccl-tests-style send/recv ring benchmark (under cohort run)",
                        [](std::vector<std::string> a) { return run_bench(Kind::kSendrecv, "bench sendrecv", a); });
Registration r_memcpy("bench memcpy", "memcpy bandwidth of this machine", run_memcpy);

}  // namespace
}  // namespace cohort::tools
