// cohort's side of the parameter-server comparison of issue 18 (peer: bench/ps_torch_rpc.py, the
// torch.distributed.rpc parameter-server tutorial's pattern). Not a Google Benchmark: a worker program
// for a parameter-server job,
//
//   cohort run --ps N --nproc-per-node 2 build/bench/ps_bench [--steps 500] [--warmup 50]
//              [--ids 4096] [--dim 64] [--rows 1048576] [--mode pullpush|pushpull] [--prefill] [--no-comm]
//              [--expected-rows N]
//
// The servers are the launcher's built-in `cohort ps serve`; every worker calls
// cohort::ps::Client::from_env() and declares a sparse table "emb" (dim floats, SGD, lr 0.01, zero
// rows created on first touch). Work per step per worker, as in the peer: draw `--ids` ids uniform over
// [0, rows) (std::mt19937_64 seeded with 1 + the worker index; drawing is inside the timed step, as
// torch.randint is in the peer), then
//   pullpush (default): pull the rows, push a constant 1e-3 gradient for the same ids, step();
//   pushpull: one push_pull: push the previous step's ids' gradient and pull this step's ids.
// Both count 2 * ids rows per step. --prefill: before the warm-up, the workers pull every id of
// [0, rows) once (split between them), so the timed steps never create rows, like the peer's
// preallocated tensor. --expected-rows N: the table's TableConfig::expected_rows (default 0: not given),
// so that the servers' indexes are sized for N rows from the start.
//
// After the warm-up the workers meet at a barrier of a cohort::Communicator over the workers
// (Communicator::from_env(): RANK/WORLD_SIZE count the workers), time `--steps` steps, and gather
// their step latencies and start/end times (steady_clock = CLOCK_MONOTONIC) to worker 0, which prints
//
//   RESULT impl=cohort servers=S workers=W steps=N ids=I dim=D rows_per_s=R p50_ms=.. p99_ms=.. max_ms=.. mode=M
//
// rows_per_s: (pulled + pushed rows over all workers) / (last worker's end - first worker's start);
// latencies over every timed step of every worker (same definitions as the peer). With --no-comm there
// is no communicator: each worker prints its own line with worker=i start_s=.. end_s=.. (CLOCK_MONOTONIC)
// and its own figures, for a script to combine. At the end every worker pulls its last ids again and
// checks each value is at most -lr * 1e-3 (each row was pushed at least once).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cohort/communicator.h"
#include "cohort/ps.h"

namespace {

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

struct Options {
  int steps = 500, warmup = 50;
  size_t ids = 4096;
  uint32_t dim = 64;
  uint64_t rows = 1ull << 20;
  std::string mode = "pullpush";
  bool prefill = false, comm = true;
  uint64_t expected_rows = 0;
  float lr = 0.01f;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "ps_bench: %s\nusage: cohort run --ps N --nproc-per-node W ps_bench [--steps S] [--warmup S] [--ids N] "
               "[--dim D] [--rows R] [--mode pullpush|pushpull] [--prefill] [--expected-rows N] [--no-comm]\n",
               why);
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value after " + a).c_str());
      return argv[++i];
    };
    if (a == "--steps") o.steps = std::stoi(value());
    else if (a == "--warmup") o.warmup = std::stoi(value());
    else if (a == "--ids") o.ids = std::stoul(value());
    else if (a == "--dim") o.dim = uint32_t(std::stoul(value()));
    else if (a == "--rows") o.rows = std::stoull(value());
    else if (a == "--mode") o.mode = value();
    else if (a == "--lr") o.lr = std::stof(value());
    else if (a == "--prefill") o.prefill = true;
    else if (a == "--expected-rows") o.expected_rows = std::stoull(value());
    else if (a == "--no-comm") o.comm = false;
    else usage(("unknown argument " + a).c_str());
  }
  if (o.mode != "pullpush" && o.mode != "pushpull") usage("--mode must be pullpush or pushpull");
  if (o.steps < 1 || o.warmup < 1 || o.ids < 1 || o.dim < 1 || o.rows < 1) usage("counts must be positive");
  return o;
}

double percentile(const std::vector<double>& sorted, double q) {
  long k = std::lround(q * double(sorted.size() - 1));
  k = std::clamp<long>(k, 0, long(sorted.size()) - 1);
  return sorted[size_t(k)];
}

int run(const Options& o) {
  auto ps = cohort::ps::Client::from_env();
  const int me = ps->worker_index(), workers = ps->num_workers(), servers = ps->num_servers();
  std::shared_ptr<cohort::Communicator> comm;
  if (o.comm) comm = cohort::Communicator::from_env();

  cohort::ps::TableConfig config;
  config.dim = o.dim;
  config.optimizer = cohort::ps::Optimizer::kSgd;
  config.lr = o.lr;
  config.init = cohort::ps::Initializer::kZeros;
  config.expected_rows = o.expected_rows;
  ps->create_table("emb", config);

  std::mt19937_64 gen(1 + uint64_t(me));
  std::uniform_int_distribution<uint64_t> dist(0, o.rows - 1);
  std::vector<uint64_t> ids(o.ids), prev(o.ids);
  std::vector<float> rows(o.ids * o.dim), grads(o.ids * o.dim, 1e-3f);

  if (o.prefill) {  // worker w pulls ids w, w + workers, ... in chunks of o.ids
    std::vector<uint64_t> chunk;
    for (uint64_t id = uint64_t(me); id < o.rows; id += uint64_t(workers)) {
      chunk.push_back(id);
      if (chunk.size() == o.ids || id + uint64_t(workers) >= o.rows) {
        ps->pull("emb", chunk.data(), chunk.size(), rows.data());
        chunk.clear();
      }
    }
  }

  const bool pushpull = o.mode == "pushpull";
  auto draw = [&] {
    for (auto& id : ids) id = dist(gen);
  };
  auto one_step = [&] {
    if (pushpull) {
      prev.swap(ids);
      draw();
      ps->push_pull("emb", prev.data(), prev.size(), grads.data(), ids.data(), ids.size(), rows.data());
    } else {
      draw();
      ps->pull("emb", ids.data(), ids.size(), rows.data());
      ps->push("emb", ids.data(), ids.size(), grads.data());
      ps->step();
    }
  };

  if (pushpull) {  // the first push_pull pushes for ids pulled here
    draw();
    ps->pull("emb", ids.data(), ids.size(), rows.data());
  }
  for (int i = 0; i < o.warmup; ++i) one_step();
  if (comm) comm->barrier();

  std::vector<double> lat(size_t(o.steps));
  const double start = now_s();
  for (int i = 0; i < o.steps; ++i) {
    const double t0 = now_s();
    one_step();
    lat[size_t(i)] = now_s() - t0;
  }
  const double end = now_s();

  // Sanity: every row of this step's ids has had at least one push of lr * 1e-3 (pushpull: the last
  // pulled ids have not been pushed yet, so push them first).
  if (pushpull) ps->push("emb", ids.data(), ids.size(), grads.data());
  ps->pull("emb", ids.data(), ids.size(), rows.data());
  const float bound = -o.lr * 1e-3f * 0.999f;
  for (size_t i = 0; i < rows.size(); ++i)
    if (!(rows[i] <= bound)) {
      std::fprintf(stderr, "ps_bench: worker %d: check failed: id %llu column %zu is %g, expected <= %g\n", me,
                   static_cast<unsigned long long>(ids[i / o.dim]), i % o.dim, double(rows[i]), double(bound));
      return 1;
    }

  const double rows_per_step = 2.0 * double(o.ids);
  char head[256];
  std::snprintf(head, sizeof head, "RESULT impl=cohort servers=%d workers=%d steps=%d ids=%zu dim=%u", servers,
                workers, o.steps, o.ids, o.dim);
  if (!comm) {
    std::vector<double> sorted = lat;
    std::sort(sorted.begin(), sorted.end());
    std::printf("%s rows_per_s=%.0f p50_ms=%.3f p99_ms=%.3f max_ms=%.3f mode=%s worker=%d start_s=%.6f end_s=%.6f\n",
                head, rows_per_step * o.steps / (end - start), percentile(sorted, 0.5) * 1e3,
                percentile(sorted, 0.99) * 1e3, sorted.back() * 1e3, o.mode.c_str(), me, start, end);
    std::fflush(stdout);
    return 0;
  }
  if (comm->size() != workers)
    std::fprintf(stderr, "ps_bench: warning: the communicator has %d ranks, the job %d workers\n", comm->size(),
                 workers);
  const int n = comm->size();
  std::vector<double> all(size_t(n) * lat.size()), times(size_t(n) * 2);
  double mine[2] = {start, end};
  comm->gather(lat.data(), all.data(), lat.size(), cohort::DataType::kFloat64, 0);
  comm->gather(mine, times.data(), 2, cohort::DataType::kFloat64, 0);
  if (comm->rank() == 0) {
    double first = times[0], last = times[1];
    for (int r = 1; r < n; ++r) {
      first = std::min(first, times[size_t(2 * r)]);
      last = std::max(last, times[size_t(2 * r + 1)]);
    }
    std::sort(all.begin(), all.end());
    std::printf("%s rows_per_s=%.0f p50_ms=%.3f p99_ms=%.3f max_ms=%.3f mode=%s\n", head,
                rows_per_step * o.steps * n / (last - first), percentile(all, 0.5) * 1e3, percentile(all, 0.99) * 1e3,
                all.back() * 1e3, o.mode.c_str());
    std::fflush(stdout);
  }
  comm->barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ps_bench: %s\n", e.what());
    return 1;
  }
}
