// What recording one communicator operation costs, without the noise of a 2-rank job
// (docs/observability.md "What it costs"): the calls execute_locked makes, in each mode.
//   BM_RecorderOff        the flight recorder off (COHORT_FLIGHT_RECORDER=0): the null-ring branch
//   BM_FlightRecorder     the default: append to the ring, mark it done
//   BM_RecorderWithClock  ... and the end time (what live stats add)
//   BM_Timeline           ... and the timeline's record of each operation (an operation that does not
//                         join a run: the first of a loop, or one with work around it)
//   BM_RecorderLoop       a loop of identical small operations through a Recorder (the default)
//   BM_TimelineLoop       ... with --timeline: they join one run (trace::OpRun), no clock read; the
//                         difference from BM_RecorderLoop is what the timeline costs such a loop
#include <benchmark/benchmark.h>

#include <cstdio>
#include <string>

#include "trace/flight_ring.h"
#include "trace/recorder.h"
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

// A loop of identical small operations through a Recorder, as execute_locked drives it: starts 300 ns
// apart, as an 8-byte allreduce loop's (the communicator reads each start anyway).
void recorder_loop(benchmark::State& state, Recorder& recorder) {
  OpRun run;
  int64_t base = monotonic_ns();
  uint32_t seq = 0;
  for (auto _ : state) {
    ++seq;
    OpBegin op{0x1234, seq, coll::OpKind::kAllreduce, 7, 0, -1, 2, 8, 0, base + int64_t(seq) * 300};
    recorder.op_end(recorder.op_begin(op), op, true, run);
  }
  recorder.close_run(run);
}

void BM_RecorderLoop(benchmark::State& state) {
  Recorder recorder(Recorder::Settings{});
  recorder_loop(state, recorder);
}
BENCHMARK(BM_RecorderLoop);

void BM_TimelineLoop(benchmark::State& state) {
  std::string path = "/tmp/cohort-trace-recorder-bench-loop.timeline";
  {
    Recorder::Settings settings;
    settings.timeline_path = path;
    Recorder recorder(settings);
    recorder_loop(state, recorder);
  }
  std::remove(path.c_str());
}
BENCHMARK(BM_TimelineLoop);

}  // namespace
}  // namespace cohort::trace
