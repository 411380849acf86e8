// What the communicator layer costs per small call, apart from moving data (issue 51: an 8-byte
// allreduce of 2 ranks on one host takes about 0.5 us, so every 20 ns of bookkeeping is 4 %).
// Each step that CommunicatorImpl::run_blocking / execute_locked takes per operation, alone:
//   BM_MutexLockUnlock         one uncontended std::mutex lock and unlock (the drive lock; the queue
//                              lock that drain_queue_locked took to find the queue empty)
//   BM_QueuedCountLoad         the atomic load that replaces that queue lock on the blocking path
//   BM_SteadyClockNow          one clock read (the operation's start: its deadline, slow warnings and
//                              the flight recorder's start time)
//   BM_CoarseClockNow          CLOCK_MONOTONIC_COARSE (the last timer tick: no counter read)
//   BM_ClearEmptyIndexes       clearing the two per-operation index maps and the request list, empty
//   BM_SkipEmptyIndexes        the same guarded by empty(): what execute_locked does now
//   BM_FlightRecorderOp        op_begin + op_end of the process's recorder (the default: on)
// and the whole layer, with the data movement reduced to nothing:
//   BM_OneRankAllreduce8B      allreduce of 2 floats on a communicator of one rank (validation, the
//                              locks, the clock, the recorder, the dispatch; the "collective" is a copy)
//   BM_OneRankBroadcast8B      the same for broadcast
// Run: build/bench/comm_call_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
// (COHORT_FLIGHT_RECORDER=0 shows the layer without the recorder).
#include <benchmark/benchmark.h>

#include <time.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cohort/communicator.h"
#include "store/memory_store.h"
#include "trace/recorder.h"

namespace cohort {
namespace {

void BM_MutexLockUnlock(benchmark::State& state) {
  std::mutex m;
  for (auto _ : state) {
    std::lock_guard<std::mutex> g(m);
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_MutexLockUnlock);

void BM_QueuedCountLoad(benchmark::State& state) {
  std::atomic<uint32_t> queued{0};
  for (auto _ : state) {
    uint32_t n = queued.load(std::memory_order_acquire);
    benchmark::DoNotOptimize(n);
  }
}
BENCHMARK(BM_QueuedCountLoad);

void BM_SteadyClockNow(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(std::chrono::steady_clock::now());
}
BENCHMARK(BM_SteadyClockNow);

void BM_CoarseClockNow(benchmark::State& state) {
  for (auto _ : state) {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    benchmark::DoNotOptimize(ts);
  }
}
BENCHMARK(BM_CoarseClockNow);

struct Indexes {
  std::unordered_map<uint64_t, uint32_t> send, recv;
  std::vector<int> pending;
};

void BM_ClearEmptyIndexes(benchmark::State& state) {
  Indexes x;
  for (auto _ : state) {
    benchmark::DoNotOptimize(&x);
    x.send.clear();
    x.recv.clear();
    x.pending.clear();
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_ClearEmptyIndexes);

void BM_SkipEmptyIndexes(benchmark::State& state) {
  Indexes x;
  for (auto _ : state) {
    benchmark::DoNotOptimize(&x);
    if (!x.send.empty()) x.send.clear();
    if (!x.recv.empty()) x.recv.clear();
    x.pending.clear();
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_SkipEmptyIndexes);

void BM_FlightRecorderOp(benchmark::State& state) {
  trace::Recorder& recorder = trace::Recorder::instance();
  trace::OpRun run;
  uint64_t seq = 0;
  for (auto _ : state) {
    trace::OpBegin op{0x1234, ++seq, coll::OpKind::kAllreduce, 7, 0, -1, 2, 8, 0, int64_t(seq) * 300};
    recorder.op_end(recorder.op_begin(op), op, true, run);
  }
}
BENCHMARK(BM_FlightRecorderOp);

std::shared_ptr<Communicator> one_rank() {
  CommOptions o;
  o.timeout = std::chrono::seconds(30);
  return Communicator::create(make_memory_store(), 0, 1, o);
}

void BM_OneRankAllreduce8B(benchmark::State& state) {
  auto comm = one_rank();
  float in[2] = {1, 2}, out[2];
  for (auto _ : state) {
    comm->allreduce(in, out, 2, DataType::kFloat32, ReduceOp::kSum);
    benchmark::DoNotOptimize(out);
  }
}
BENCHMARK(BM_OneRankAllreduce8B);

void BM_OneRankBroadcast8B(benchmark::State& state) {
  auto comm = one_rank();
  float buf[2] = {1, 2};
  for (auto _ : state) {
    comm->broadcast(buf, 2, DataType::kFloat32, 0);
    benchmark::DoNotOptimize(buf);
  }
}
BENCHMARK(BM_OneRankBroadcast8B);

}  // namespace
}  // namespace cohort
