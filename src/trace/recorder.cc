#include "trace/recorder.h"

#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/core.h>

#include "cohort/error.h"
#include "common/env.h"
#include "common/log.h"
#include "trace/dump.h"
#include "trace/timeline.h"

namespace cohort::trace {
namespace {

const env::IntSetting kFlightRecorder(
    "COHORT_FLIGHT_RECORDER", 2000,
    "operations each rank keeps in its flight recorder ring for failure and stall reports (0: off)");
const env::IntSetting kFlightRecorderFd(
    "COHORT_FLIGHT_RECORDER_FD", -1,
    "set by cohort run: the descriptor of this rank's ring, which the launcher reads (do not set it yourself)");
const env::StringSetting kTimelineRankFile(
    "COHORT_TIMELINE_RANK_FILE", "",
    "set by cohort run --timeline: where this rank writes its timeline records at exit");
const env::StringSetting kTimeline(
    "COHORT_TIMELINE", "",
    "record a timeline: `cohort run` merges the ranks into this Chrome-trace file; a process started without "
    "the launcher writes <path>.rank<N>.timeline (merge with `cohort trace merge`)");
const env::StringSetting kTraceDir(
    "COHORT_TRACE_DIR", "",
    "where flight recorder dumps go: cohort run writes every rank's ring there when a job fails or stalls "
    "(default: a directory under $TMPDIR named after the job); a process without the launcher writes its own "
    "ring there when a communicator fails");

// The longest start-to-start period an operation may have to join a run (OpRun).
constexpr int64_t kRunMaxPeriodNs = 20000;

// The timeline keeps a ring of its own when the flight recorder is off: events are taken from the
// entries as operations end, so a few in flight at once is all it needs.
constexpr uint32_t kTimelineOnlyRing = 64;

RingHeader* allocate_ring(uint32_t capacity) {
  void* p = std::aligned_alloc(64, ring_bytes(capacity));
  if (!p) throw std::bad_alloc();
  std::memset(p, 0, ring_bytes(capacity));
  auto* h = static_cast<RingHeader*>(p);
  std::memcpy(h->magic, kRingMagic, sizeof h->magic);
  h->capacity = capacity;
  return h;
}

}  // namespace

struct Recorder::Timeline {
  TimelineWriter writer;
  explicit Timeline(std::string path) : writer(std::move(path)) {}
};

Recorder& Recorder::instance() {
  static Recorder recorder(Settings::from_env());
  return recorder;
}

Recorder::Settings Recorder::Settings::from_env() {
  Settings s;
  s.capacity = kFlightRecorder.get();
  if (s.capacity < 0 || s.capacity > (int64_t(1) << 24))
    throw ConfigError(fmt::format("COHORT_FLIGHT_RECORDER={}: expected 0 (off) to 16777216 entries", s.capacity));
  s.trace_dir = kTraceDir.get();
  s.timeline_path = kTimelineRankFile.get();
  if (s.timeline_path.empty() && !kTimeline.get().empty()) s.timeline_path = kTimeline.get() + ".rank{rank}.timeline";
  s.ring_fd = int(kFlightRecorderFd.get());
  return s;
}

Recorder::Recorder(const Settings& settings) {
  int64_t capacity = settings.capacity;
  trace_dir_ = settings.trace_dir;
  if (!settings.timeline_path.empty()) timeline_ = std::make_unique<Timeline>(settings.timeline_path);

  int fd = settings.ring_fd;
  if (fd >= 0) {
    // The launcher's ring: it was sized by COHORT_FLIGHT_RECORDER there. Close the descriptor so that
    // processes this worker starts do not hold the ring too; the mapping stays. A process that
    // inherited the variable but not the descriptor (a worker's own child, started after the worker
    // mapped it) keeps a ring of its own instead.
    try {
      shared_ring_ = Ring::adopt(fd);
      shared_ring_.close_fd();
    } catch (const RingLayoutError& e) {
      log::warn("flight recorder: {}", e.what());
      fd = -1;
    } catch (const ConfigError& e) {
      log::debug("flight recorder: {}; keeping it in this process", e.what());
      fd = -1;
    }
  }
  if (fd >= 0) {
    ring_ = &shared_ring_.header();
    under_launcher_ = true;
    ring_->pid.store(int32_t(getpid()), std::memory_order_release);
    rank_ = ring_->rank;
    world_ = ring_->world;
    host_ = std::string(ring_->host, strnlen(ring_->host, sizeof ring_->host));
  } else if (capacity > 0 || timeline_) {
    uint32_t n = capacity > 0 ? uint32_t(capacity) : kTimelineOnlyRing;
    own_ring_ = std::unique_ptr<RingHeader, void (*)(RingHeader*)>(allocate_ring(n), [](RingHeader* h) { std::free(h); });
    ring_ = own_ring_.get();
    ring_->pid.store(int32_t(getpid()), std::memory_order_relaxed);
  }
  stats_ = ring_ && ring_->timing != 0;
  timing_ = timeline_ != nullptr || stats_;
  if (timeline_ && rank_ >= 0) timeline_->writer.set_identity(rank_, world_, host_);
}

Recorder::~Recorder() {
  try {
    flush_timeline();
  } catch (const std::exception& e) {
    log::warn("timeline not written: {}", e.what());
  }
}

void OpRun::start(const OpBegin& op, int64_t t_end, bool ok) {
  first = op;
  first_end = t_end;
  last_start = op.t_start;
  last_seq = op.seq;
  n = 1;
  this->ok = ok;
  call = call_of(op);
  // Nothing joins a failed operation or an async one (its queue time is worth seeing on its own).
  int64_t length = t_end - op.t_start;
  max_period = !ok || op.t_queued != 0 ? -1
                                       : std::min<int64_t>(kRunMaxPeriodNs, length + std::max<int64_t>(2 * length, 1000));
}

void Recorder::end_slow(Handle h, const OpBegin& op, bool ok, OpRun& run) {
  if (timeline_ && ok && !stats_ && run.extends(op)) {
    // Inside a run: no end time (see OpRun).
    ring_finish(*ring_, h, op, ok, 0);
    ++run.n;
    run.last_start = op.t_start;
    run.last_seq = op.seq;
    return;
  }
  // A failure is timed always: "waited N s" in the failure summary is its length.
  int64_t t_end = timing_ || !ok ? monotonic_ns() : 0;
  ring_finish(*ring_, h, op, ok, t_end);
  if (!timeline_) return;
  close_run(run);
  run.start(op, t_end, ok);
}

void Recorder::close_run(OpRun& run) {
  if (!timeline_ || run.n == 0) return;
  OpRecord r = finished_record(run.first, run.ok, run.first_end);
  if (run.n > 1) {
    // The run ends one mean period after its last operation started.
    int64_t period = (run.last_start - run.first.t_start) / int64_t(run.n - 1);
    r.t_end = run.last_start + period;
  }
  timeline_->writer.add_op(r, run.n, run.last_seq);
  run.n = 0;
}

void Recorder::span(const char* name, int index, int64_t t0, int64_t t1) {
  if (timeline_) timeline_->writer.add_span(name, index, t0, t1);
}

void Recorder::instant(const char* name, int index, int64_t t) {
  if (timeline_) timeline_->writer.add_instant(name, index, t);
}

void Recorder::add_step(int64_t step_ns, int64_t wait_ns) {
  if (!ring_) return;
  auto& c = ring_->counters;
  c.steps.fetch_add(1, std::memory_order_relaxed);
  c.step_ns.fetch_add(uint64_t(std::max<int64_t>(step_ns, 0)), std::memory_order_relaxed);
  c.wait_ns.fetch_add(uint64_t(std::max<int64_t>(wait_ns, 0)), std::memory_order_relaxed);
}

void Recorder::set_identity(int rank, int world, const std::string& host) {
  std::lock_guard<std::mutex> g(mutex_);
  if (rank_ >= 0) return;  // the first communicator (the world, as a rule) names the process
  rank_ = rank;
  world_ = world;
  host_ = host;
  if (own_ring_) {
    own_ring_->rank = rank;
    own_ring_->world = world;
    std::snprintf(own_ring_->host, sizeof own_ring_->host, "%s", host.c_str());
  }
  if (timeline_) timeline_->writer.set_identity(rank, world, host);
}

void Recorder::flush_timeline() {
  if (timeline_) timeline_->writer.flush();
}

RankSnapshot Recorder::snapshot() const {
  RankSnapshot s;
  if (!ring_) return s;
  // A non-owning view with the same reading rules as the launcher's.
  // This process's own ring (or the one the launcher made for it): its header is its own to trust.
  s = snapshot_of(*ring_, {ring_->capacity, ring_->rank, ring_->world,
                           std::string(ring_->host, strnlen(ring_->host, sizeof ring_->host))});
  s.process_state = "running";
  return s;
}

void Recorder::dump_on_failure(const std::string& why) {
  if (under_launcher_ || trace_dir_.empty() || !ring_) return;
  try {
    std::filesystem::create_directories(trace_dir_);
    RankSnapshot s = snapshot();
    s.process_state = "failed: " + why;
    std::string path = fmt::format("{}/rank{}.json", trace_dir_, rank_ < 0 ? int(getpid()) : rank_);
    write_dump(path, s);
    log::warn("flight recorder of rank {} written to {}", rank_, path);
  } catch (const std::exception& e) {
    log::warn("flight recorder not written to COHORT_TRACE_DIR={}: {}", trace_dir_, e.what());
  }
}

}  // namespace cohort::trace
