// Allreduce benchmark for Gloo, the C++ library under torch.distributed's gloo backend, without Python:
// the Gloo C++ peer. Its TCP transport binds 127.0.0.1; the ranks meet through a gloo FileStore directory.
// Build (Debian: apt-get install libgloo-dev):
//   g++ -O2 -std=c++17 -o bench_gloo bench_gloo.cc -lgloo -lpthread
// Run N ranks with run_gloo.sh, which sets each process's RANK, SIZE and STORE_DIR (PREFIX optional).
// Usage: bench_gloo [ALGO=ring_chunked] [SIZES=8,1024,...,268435456] [TRIALS=5] [MIN_TIME=0.5]
//   ALGO  ring          gloo::AllreduceRing<float>: the whole buffer goes round the ring n-1 times
//         ring_chunked  gloo::AllreduceRingChunked<float>: reduce-scatter then allgather round the ring
//         new           gloo::allreduce(AllreduceOptions), the call torch's ProcessGroupGloo makes
// Method and RESULT line as bench_mpi.c (peer=gloo-cpp-ALGO, op=allreduce, fp32 sum in place). Counts the
// ranks agree on, and each trial's slowest-rank time, go through a separate max-allreduce outside the
// timed loops.
#include <gloo/allreduce.h>
#include <gloo/allreduce_ring.h>
#include <gloo/allreduce_ring_chunked.h>
#include <gloo/barrier_all_to_all.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {

using ReduceFn = void (*)(void*, const void*, const void*, size_t);

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

std::string env(const char* name, const char* fallback = nullptr) {
  const char* value = std::getenv(name);
  if (value) return value;
  if (fallback) return fallback;
  std::fprintf(stderr, "bench_gloo: %s is not set (start the ranks with run_gloo.sh)\n", name);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  const int rank = std::stoi(env("RANK"));
  const int size = std::stoi(env("SIZE"));
  const std::string algo = argc > 1 ? argv[1] : "ring_chunked";
  std::stringstream sizes(argc > 2 ? argv[2] : "8,1024,65536,1048576,4194304,16777216,67108864,268435456");
  const int trials = argc > 3 ? std::atoi(argv[3]) : 5;
  const double min_time = argc > 4 ? std::atof(argv[4]) : 0.5;
  if ((algo != "ring" && algo != "ring_chunked" && algo != "new") || trials < 1) {
    std::fprintf(stderr, "bench_gloo: ALGO is ring, ring_chunked or new; TRIALS at least 1\n");
    return 2;
  }

  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  attr.ai_family = AF_INET;
  auto device = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore file_store(env("STORE_DIR"));
  gloo::rendezvous::PrefixStore store(env("PREFIX", "run"), file_store);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  context->setTimeout(std::chrono::seconds(300));
  context->connectFullMesh(store, device);

  uint32_t tag = 1000;  // the new API's operations each need a tag of their own
  auto max_over_ranks = [&](double x) {
    gloo::AllreduceOptions options(context);
    options.setOutput(&x, 1);
    options.setReduceFunction(static_cast<ReduceFn>(&gloo::max<double>));
    options.setTag(tag++);
    gloo::allreduce(options);
    return x;
  };
  gloo::BarrierAllToAll barrier(context);

  for (std::string item; std::getline(sizes, item, ',');) {
    const size_t count = std::max<size_t>(std::stoull(item) / 4, 1);
    std::vector<float> buf(count, float(rank + 1));
    float* data = buf.data();
    std::unique_ptr<gloo::Algorithm> legacy;  // the ring algorithms are built once per buffer
    const std::vector<float*> buffers{data};
    if (algo == "ring") legacy = std::make_unique<gloo::AllreduceRing<float>>(context, buffers, int(count));
    if (algo == "ring_chunked")
      legacy = std::make_unique<gloo::AllreduceRingChunked<float>>(context, buffers, int(count));
    std::function<void()> run = [&] {
      if (legacy) return legacy->run();
      gloo::AllreduceOptions options(context);
      options.setOutput(data, count);
      options.setReduceFunction(static_cast<ReduceFn>(&gloo::sum<float>));
      options.setTag(tag++);
      gloo::allreduce(options);
    };

    run();  // correctness, then zeros for timing
    const float expected = float(size * (size + 1) / 2);
    if (std::any_of(buf.begin(), buf.end(), [&](float v) { return v != expected; })) {
      std::fprintf(stderr, "bench_gloo: allreduce gave a wrong result on rank %d\n", rank);
      return 1;
    }
    std::fill(buf.begin(), buf.end(), 0.0f);

    auto seconds_per_op = [&](long iters) {  // the slowest rank's
      barrier.run();
      const double start = now();
      for (long i = 0; i < iters; i++) run();
      return max_over_ranks((now() - start) / double(iters));
    };
    double per_op = seconds_per_op(5);
    per_op = seconds_per_op(long(max_over_ranks(std::ceil(0.2 / std::max(per_op, 1e-9)))));
    const long iters = long(max_over_ranks(std::max(2.0, std::ceil(min_time / std::max(per_op, 1e-9)))));
    std::vector<double> times;
    for (int t = 0; t < trials; t++) times.push_back(seconds_per_op(iters));
    std::sort(times.begin(), times.end());
    const double median = trials % 2 ? times[trials / 2] : (times[trials / 2 - 1] + times[trials / 2]) / 2;
    const double algbw = double(count) * 4 / median / 1e9;
    if (rank == 0) {
      std::printf("RESULT peer=gloo-cpp-%s op=allreduce n=%d bytes=%zu iters=%ld trials=%d time_us_median=%.2f "
                  "time_us_min=%.2f time_us_max=%.2f algbw_GBps=%.4f busbw_GBps=%.4f\n",
                  algo.c_str(), size, count * 4, iters, trials, median * 1e6, times.front() * 1e6,
                  times.back() * 1e6, algbw, algbw * 2.0 * (size - 1) / size);
      std::fflush(stdout);
    }
  }
  barrier.run();
  return 0;
}
