#pragma once
// The process's recorder: what the communicators and the data-parallel layer of this process did,
// written where people can read it (docs/observability.md).
//
// * Flight recorder (on by default): every communicator operation goes into a ring of the last
//   COHORT_FLIGHT_RECORDER (2,000) operations. Under `cohort run` the ring is the launcher's memfd
//   (COHORT_FLIGHT_RECORDER_FD), so the launcher reads it live (stall inspector, live stats) and after
//   a failure (the failure summary and the dumps). Without the launcher it is this process's memory,
//   written to COHORT_TRACE_DIR when a communicator fails.
// * Timeline (off by default): with COHORT_TIMELINE_RANK_FILE (set by `cohort run --timeline`) or
//   COHORT_TIMELINE (without the launcher), every operation (or run of operations, see OpRun) and
//   training span is kept as a record and written to a rank file at exit (trace/timeline.h); the
//   launcher merges the ranks into one Chrome-trace file.
//
// Cost: recording one operation is a handful of plain stores into one cache line of the ring and
// one atomic increment; the end time (a clock read) is only taken when the timeline or live stats
// want it. With COHORT_FLIGHT_RECORDER=0 and no timeline every call is one predictable branch.

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "collectives/op_kind.h"
#include "trace/flight_ring.h"

namespace cohort::trace {

// The timeline's view of one communicator's latest operations: a run of back-to-back identical short
// operations (a loop of small allreduces) is kept as one slice "allreduce x N" instead of N slices.
// Why: the end of every operation would cost a clock read (26 ns here, 8 % of an 8-byte allreduce) and
// a record; in a run only the first operation's end is read, and the run ends at the last one's start
// plus the run's mean period. An operation joins the run when it is the same call (kind, dtype, op,
// count, peer) and starts within max(2 x the first one's length, 1 us) + the first's length of the
// previous start, and at most 20 us after it: a slower loop, or one with work between its
// operations, is drawn operation by operation. Owned by the communicator (under its drive lock).
struct OpRun {
  OpBegin first;            // the run's first operation
  int64_t first_end = 0;    // its measured end
  int64_t last_start = 0;   // the latest operation's start
  uint64_t last_seq = 0;
  uint32_t n = 0;           // operations in the run (0: none)
  bool ok = true;           // the first operation succeeded
  // Set by start(), so that extends() is a few compares (it runs once per operation of a loop).
  uint64_t call = 0;        // the first operation's communicator, kind, dtype and op, packed
  int64_t max_period = -1;  // the longest start-to-start period that joins (-1: nothing joins)

  static uint64_t call_of(const OpBegin& op) {
    return uint64_t(op.comm) << 32 | uint64_t(op.kind) << 16 | uint64_t(op.dtype) << 8 | op.redop;
  }
  // `op` (measured to end at `t_end`, `ok` or not) begins a new run.
  void start(const OpBegin& op, int64_t t_end, bool ok);
  bool extends(const OpBegin& op) const {
    int64_t period = op.t_start - last_start;
    return call_of(op) == call && op.count == first.count && op.peer == first.peer && op.t_queued == 0 &&
           period >= 0 && period <= max_period;
  }
};

class Recorder {
 public:
  // The process's recorder, configured from the environment on first use.
  static Recorder& instance();

  // What a recorder records. A process uses instance(); benchmarks build their own.
  struct Settings {
    int64_t capacity = 2000;    // flight recorder entries (0: off)
    std::string timeline_path;  // "" = no timeline
    int ring_fd = -1;           // the launcher's ring
    std::string trace_dir;      // dumps without the launcher
    static Settings from_env();
  };
  explicit Recorder(const Settings& settings);

  // Handle of a recorded operation (0: not recorded).
  using Handle = uint64_t;
  Handle op_begin(const OpBegin& op) {
    return ring_ ? ring_append(*ring_, op) : 0;
  }
  // `op` is what op_begin was given; `run` the communicator's (see OpRun).
  void op_end(Handle h, const OpBegin& op, bool ok, OpRun& run) {
    if (h) end_slow(h, op, ok, run);
  }
  // Writes `run` out as a timeline slice and empties it (the communicator's destructor; a different
  // operation does it too).
  void close_run(OpRun& run);
  // Whether spans and end times are measured (the timeline or live stats are on): callers skip
  // their clock reads otherwise.
  bool timing() const { return timing_; }
  bool timeline_on() const { return timeline_ != nullptr; }

  // A training span ("backward", "allreduce bucket 3", ...) on the training track; `name` must be a
  // string literal (kept by pointer), `index` >= 0 is appended to it ("bucket 3").
  void span(const char* name, int index, int64_t t0, int64_t t1);
  // A moment on the training track ("bucket 3 ready").
  void instant(const char* name, int index, int64_t t);
  // One data-parallel step: its length and the part spent waiting for communication (live stats).
  void add_step(int64_t step_ns, int64_t wait_ns);

  // Who this process is, once its first communicator knows (the timeline's header, a dump's name).
  void set_identity(int rank, int world, const std::string& host);
  // Writes the timeline events so far (also done at exit).
  void flush_timeline();
  // Without the launcher: writes the ring to COHORT_TRACE_DIR/rank<N>.json when set (communicator
  // failure). Under the launcher this does nothing: the launcher reads the ring itself.
  void dump_on_failure(const std::string& why);

  // This process's ring as a snapshot (tests, dumps).
  RankSnapshot snapshot() const;

  ~Recorder();
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;

 private:
  void end_slow(Handle h, const OpBegin& op, bool ok, OpRun& run);
  struct Timeline;

  Ring shared_ring_;            // the launcher's (empty without it)
  std::unique_ptr<RingHeader, void (*)(RingHeader*)> own_ring_{nullptr, nullptr};  // without the launcher
  // Whichever of the two is used; null: flight recorder off (with the timeline on, a small ring of its
  // own stays: op_end works on the handles op_begin returns).
  RingHeader* ring_ = nullptr;
  bool under_launcher_ = false;
  bool timing_ = false;
  bool stats_ = false;  // live stats want every operation's end
  std::unique_ptr<Timeline> timeline_;
  mutable std::mutex mutex_;  // identity
  int rank_ = -1;
  int world_ = 0;
  std::string host_;
  std::string trace_dir_;
};

}  // namespace cohort::trace
