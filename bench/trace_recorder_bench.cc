// What recording one communicator operation costs, without the noise of a 2-rank job
// (docs/observability.md "What it costs"): the calls execute_locked makes, in each mode.
//   BM_RecorderOff        the flight recorder off (COHORT_FLIGHT_RECORDER=0): the null-ring branch
//   BM_FlightRecorder     the default: append to the ring, mark it done
//   BM_RecorderWithClock  ... and the end time (what live stats add)
//   BM_Timeline           ... and the timeline's record (what --timeline adds), written to a file
#include <benchmark/benchmark.h>

#include <cstdio>
#include <string>

#include "trace/flight_ring.h"
#include "trace/timeline.h"

namespace cohort::trace {
namespace {

OpBegin an_allreduce(uint32_t seq) {
  return OpBegin{0x1234, seq, coll::OpKind::kAllreduce, 7, 0, -1, 2, 8, 0, monotonic_ns()};
}

// The shape of Recorder::op_begin/op_end: a ring pointer that may be null.
void BM_RecorderOff(benchmark::State& state) {
  RingHeader* ring = nullptr;
  benchmark::DoNotOptimize(ring);
  uint32_t seq = 0;
  for (auto _ : state) {
    OpBegin op{0x1234, ++seq, coll::OpKind::kAllreduce, 7, 0, -1, 2, 8, 0, 0};
    uint64_t h = ring ? ring_append(*ring, op) : 0;
    benchmark::DoNotOptimize(h);
    if (h) ring_finish(*ring, h, op, true, 0);
  }
}
BENCHMARK(BM_RecorderOff);

void BM_FlightRecorder(benchmark::State& state) {
  Ring ring = Ring::create(2000, 0, 2, "bench", false);
  uint32_t seq = 0;
  for (auto _ : state) {
    OpBegin op{0x1234, ++seq, coll::OpKind::kAllreduce, 7, 0, -1, 2, 8, 0, 0};
    uint64_t h = ring_append(ring.header(), op);
    ring_finish(ring.header(), h, op, true, 0);
  }
}
BENCHMARK(BM_FlightRecorder);

void BM_RecorderWithClock(benchmark::State& state) {
  Ring ring = Ring::create(2000, 0, 2, "bench", true);
  uint32_t seq = 0;
  for (auto _ : state) {
    OpBegin op{0x1234, ++seq, coll::OpKind::kAllreduce, 7, 0, -1, 2, 8, 0, 0};
    uint64_t h = ring_append(ring.header(), op);
    ring_finish(ring.header(), h, op, true, monotonic_ns());
  }
}
BENCHMARK(BM_RecorderWithClock);

void BM_Timeline(benchmark::State& state) {
  Ring ring = Ring::create(2000, 0, 2, "bench", true);
  std::string path = "/tmp/cohort-trace-recorder-bench.timeline";
  TimelineWriter writer(path);
  writer.set_identity(0, 2, "bench");
  uint32_t seq = 0;
  for (auto _ : state) {
    OpBegin op = an_allreduce(++seq);
    uint64_t h = ring_append(ring.header(), op);
    int64_t t_end = monotonic_ns();
    ring_finish(ring.header(), h, op, true, t_end);
    OpRecord r = finished_record(op, true, t_end);
    writer.add_op(r);
  }
  writer.flush();
  std::remove(path.c_str());
}
BENCHMARK(BM_Timeline);

}  // namespace
}  // namespace cohort::trace
