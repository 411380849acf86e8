#pragma once
// The timeline: each rank writes its events to a rank file; the launcher (or `cohort trace merge`)
// merges the ranks into one Chrome-trace / Perfetto JSON file, one process per rank, one track per
// communicator and one for training (docs/observability.md).
//
// Rank files are written for speed, read once by the merge: a text line "COHORT-TIMELINE-2", a JSON
// line (who wrote it, and the clock anchor), then fixed-size binary records (TimelineRecord, native
// byte order). Turning events into JSON costs microseconds each; a record costs a copy.
//
// Clocks: events are taken on CLOCK_MONOTONIC. Each rank's JSON line holds an anchor: a
// CLOCK_REALTIME reading taken between two monotonic readings. The merge moves every rank onto the
// realtime axis through its anchor. Ranks on one host share both clocks, so they line up to within
// the anchor's bracket (written in the file, typically < 1 µs); ranks on different hosts line up as
// well as their hosts' realtime clocks agree (NTP/PTP: typically < 1 ms on a LAN).

#include <cstdint>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "trace/flight_ring.h"

namespace cohort::trace {

// The merged trace's track (Chrome-trace tid) of training spans; communicators get 1, 2, ...
inline constexpr int kTrainingTrackId = 0;

// One event in a rank file.
struct TimelineRecord {
  enum Type : uint8_t { kOp = 0, kSpan = 1, kInstant = 2, kTruncated = 3 };
  Type type;
  coll::OpKind kind;  // kOp
  uint8_t dtype;
  uint8_t redop;
  OpState state;
  uint8_t reserved[3];
  uint64_t seq;
  uint64_t last_seq;  // kOp: the number of the run's last operation
  uint64_t count;
  uint64_t bytes;  // kTruncated: the events dropped
  int64_t t_queued;
  int64_t t0;
  int64_t t1;
  uint32_t comm;
  int32_t peer;     // kOp: root or peer (-1: none); spans and instants: the index appended to the name
  uint32_t repeat;  // kOp: operations in this slice (a run, see trace::OpRun; their numbers seq..last_seq)
  char name[20];    // spans and instants (NUL-terminated)
};
static_assert(sizeof(TimelineRecord) == 96);

class TimelineWriter {
 public:
  // `path` may hold "{rank}", replaced by the rank once known.
  explicit TimelineWriter(std::string path);
  void set_identity(int rank, int world, const std::string& host);
  // `repeat` operations of the same call, numbered op.seq .. last_seq, drawn as one slice.
  void add_op(const OpRecord& op, uint32_t repeat = 1, uint64_t last_seq = 0);
  void add_span(const char* name, int index, int64_t t0, int64_t t1);
  void add_instant(const char* name, int index, int64_t t);
  // Appends the events so far to the file (its two header lines first) and forgets them. The recorder
  // calls it when the process exits.
  void flush();

 private:
  void add_locked(const TimelineRecord& r);
  void flush_locked();
  std::mutex mutex_;
  std::string path_;
  uint64_t max_events_;
  uint64_t recorded_ = 0, dropped_ = 0;
  bool truncation_noted_ = false;
  int rank_ = -1, world_ = 0;
  std::string host_;
  bool header_written_ = false;
  // Events wait in memory until the rank exits (or flush() is called): writing them as they come
  // put a file write in the middle of a tight loop of small operations. Blocks, not one vector, so
  // that growing never copies what is there.
  static constexpr size_t kBlockRecords = 8192;
  struct Block {
    TimelineRecord records[kBlockRecords];
  };
  std::vector<std::unique_ptr<Block>> blocks_;
  size_t used_ = 0;  // records in the last block
};

// Merges rank files (written by TimelineWriter) into one Chrome-trace JSON document written to `out`:
// {"traceEvents": [...], "displayTimeUnit": "ns", "otherData": {...}}. Streams: memory does not grow
// with the number of events. Throws Error naming a file that cannot be read or parsed.
struct MergeSummary {
  int ranks = 0;
  uint64_t events = 0;
  std::vector<int> truncated_ranks;  // ranks that hit COHORT_TIMELINE_MAX_EVENTS
};
MergeSummary merge_timelines(const std::vector<std::string>& rank_files, std::ostream& out);

// The rank files in `dir` ("rank<N>.timeline"), in rank order.
std::vector<std::string> timeline_rank_files(const std::string& dir);

}  // namespace cohort::trace
