#pragma once
// The flight recorder's ring: each rank's last N communicator operations, in memory that the
// launcher can read while the rank runs and after it died (docs/observability.md).
//
// Why shared memory: the launcher creates the ring (a memfd) before it starts a worker and hands the
// worker its descriptor (COHORT_FLIGHT_RECORDER_FD). The worker writes operations into it as plain
// stores; nothing is sent anywhere. The launcher keeps its own mapping, so it can inspect a rank that
// hangs, is SIGSTOPped or was SIGKILLed, with no dump code that has to run in the dying process. A
// memfd has no name: nothing is left behind when the job's processes are gone.
//
// Writers and readers never lock: each entry is a seqlock whose version says which operation wrote
// the slot last and whether a write is in progress (odd). A writer takes the slot with a
// compare-and-swap from an even version, so two writers of one slot (the ring went round onto an
// operation still being appended or finished) never interleave their fields; a reader copies an
// entry and keeps it only when the version was even, named the operation it expects, and was
// unchanged around the copy.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cohort/error.h"
#include "collectives/op_kind.h"

namespace cohort::trace {

// The ring's first bytes: "COHFRNG" and the layout's number. A reader of another layout (a worker
// built from another cohort than the launcher that made its ring) says so instead of misreading it.
// Layout 1: 32-bit sequence numbers, versions taken with a plain load and store. Layout 2: 64-bit
// sequence numbers, versions taken with a compare-and-swap and naming their operation.
inline constexpr char kRingLayout = '2';
inline constexpr char kRingMagic[8] = {'C', 'O', 'H', 'F', 'R', 'N', 'G', kRingLayout};

// A ring of another layout than this build's (Ring::adopt).
class RingLayoutError : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

// Where an operation is. Values are stored in the ring: only append.
enum class OpState : uint8_t { kEmpty = 0, kQueued = 1, kRunning = 2, kDone = 3, kFailed = 4 };
const char* op_state_name(OpState s);

// One operation (64 bytes, one cache line). Times are CLOCK_MONOTONIC nanoseconds.
//
// The version names the write: 4 x (the entry's position in the history, modulo 2^30) + 1 while the
// operation is appended, + 2 once appended (running), + 3 while it is marked done or failed, + 4 once
// marked (which is also "+ 0" of the next position). So versions of one slot only grow (modulo 2^32),
// every write changes the version, and a reader knows which operation an even version belongs to.
struct alignas(64) RingEntry {
  std::atomic<uint32_t> version;
  uint32_t comm;  // communicator id (the same on every rank of that communicator)
  uint64_t seq;   // the operation's number in its communicator (0: point-to-point)
  int32_t peer;   // root of a rooted collective, peer of send/recv, -1 otherwise
  coll::OpKind kind;
  uint8_t dtype;
  uint8_t redop;
  OpState state;
  uint64_t count;  // elements
  uint64_t bytes;  // this rank's payload
  int64_t t_queued;
  int64_t t_start;
  int64_t t_end;  // 0 until done (and only measured when the timeline or live stats want it)
};
static_assert(sizeof(RingEntry) == 64);

// Counters for live stats. Updated with relaxed loads and stores (see ring_finish); readers take what
// they see.
struct RingCounters {
  std::atomic<uint64_t> ops;       // operations finished
  std::atomic<uint64_t> bytes;     // their payload
  std::atomic<uint64_t> op_ns;     // time spent inside them (only with timing on)
  std::atomic<uint64_t> steps;     // data-parallel steps (train::GradientSync::finish)
  std::atomic<uint64_t> step_ns;   // their length, start of backward to finish
  std::atomic<uint64_t> wait_ns;   // of which waiting for communication backward did not hide
};

struct alignas(64) RingHeader {
  char magic[8];
  uint32_t capacity;  // entries after the header
  uint32_t timing;    // 1: writers also measure end times (the launcher asked for live stats)
  int32_t rank;
  int32_t world;
  char host[64];
  std::atomic<int32_t> pid;         // set by the worker when it maps the ring (0: never started)
  uint32_t reserved;
  std::atomic<uint64_t> next;       // entries written so far (the slot of entry i is i % capacity)
  RingCounters counters;
};
static_assert(sizeof(RingHeader) % 64 == 0);

size_t ring_bytes(uint32_t capacity);

// An operation as read back: a plain copy of an entry.
struct OpRecord {
  uint64_t index = 0;  // position in the rank's history (0 = first operation it ever recorded)
  uint64_t seq = 0;
  uint32_t comm = 0;
  int32_t peer = -1;
  coll::OpKind kind = coll::OpKind::kNone;
  uint8_t dtype = 0;
  uint8_t redop = 0;
  OpState state = OpState::kEmpty;
  uint64_t count = 0;
  uint64_t bytes = 0;
  int64_t t_queued = 0, t_start = 0, t_end = 0;
};
// "allreduce #12 (count=1024, float32, sum, 4 KiB)"
std::string describe(const OpRecord& r);

struct CounterSnapshot {
  uint64_t ops = 0, bytes = 0, op_ns = 0, steps = 0, step_ns = 0, wait_ns = 0;
};

// One rank's ring as read at one moment (or loaded from a dump).
struct RankSnapshot {
  int rank = -1;
  int world = 0;
  std::string host;
  int pid = 0;
  bool started = false;        // the worker mapped its ring
  std::string process_state;   // "running", "stopped (SIGSTOP)", "exited", ... as the launcher saw it
  int64_t taken_at = 0;        // CLOCK_MONOTONIC of the read
  bool unreported = false;     // stands for a rank of another node that has published nothing yet
  uint64_t total = 0;          // operations recorded overall (entries holds the last ones)
  std::vector<OpRecord> entries;  // oldest first
  CounterSnapshot counters;
};

// What the reader of a ring knows of it without reading the ring: the launcher's own record of a ring
// it created. The ring's memory is the worker's to write, and a worker whose memory is corrupt (when
// the recorder matters most) may have written anything there, its header included; the reader takes
// the size and the identity from here and checks the rest it reads (docs/security.md).
struct RingIdentity {
  uint32_t capacity = 0;
  int rank = -1;
  int world = 0;
  std::string host;
};

// A ring the launcher created: the memfd (inherited by the worker) and the launcher's mapping.
class Ring {
 public:
  // Creates and maps a ring of `capacity` entries for `rank` (a close-on-exec memfd).
  static Ring create(uint32_t capacity, int rank, int world, const std::string& host, bool timing);
  // Maps the ring behind an inherited descriptor (the worker side); throws ConfigError when it is not
  // one, RingLayoutError when it is one of another layout.
  static Ring adopt(int fd);
  Ring() = default;
  Ring(Ring&&) noexcept;
  Ring& operator=(Ring&&) noexcept;
  ~Ring();

  bool valid() const { return header_ != nullptr; }
  int fd() const { return fd_; }
  void close_fd();  // the mapping stays
  RingHeader& header() const { return *header_; }
  RingEntry& slot(uint64_t i) const { return entries_[i % identity_.capacity]; }
  // The size and identity the ring was created (or, by the worker, adopted) with.
  const RingIdentity& identity() const { return identity_; }
  // A consistent copy of the last `max` entries (entries being written are skipped).
  RankSnapshot snapshot(size_t max = SIZE_MAX) const;

 private:
  void unmap();
  int fd_ = -1;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  RingHeader* header_ = nullptr;
  RingEntry* entries_ = nullptr;
  RingIdentity identity_;
};

// Writing (the recorder; tests): append an operation as running, then finish it. Several threads may
// append and finish at once. Neither waits for a reader. ring_finish ignores a handle whose slot was
// taken by a later operation meanwhile (the ring went round). ring_append gives way to a later
// operation that already holds its slot (this entry would have been overwritten anyway), and waits for
// an earlier one that is still being written there, at most kRingAppendWaitNs: a writer preempted in
// the middle of its few stores; past that the entry is left out rather than make an operation wait.
inline constexpr int64_t kRingAppendWaitNs = 1000000;
// One communicator operation as the communicator describes it.
struct OpBegin {
  uint32_t comm = 0;
  uint64_t seq = 0;
  coll::OpKind kind = coll::OpKind::kNone;
  uint8_t dtype = 0;
  uint8_t redop = 0;
  int32_t peer = -1;
  uint64_t count = 0;
  uint64_t bytes = 0;
  int64_t t_queued = 0;  // 0: called blocking
  int64_t t_start = 0;
};
uint64_t ring_append(RingHeader& h, const OpBegin& op);  // a handle (entry position + 1)
// The record of a finished operation (what the timeline keeps).
OpRecord finished_record(const OpBegin& op, bool ok, int64_t t_end);
// `op` is what was appended (the counters take its bytes and start even when the slot was reused).
void ring_finish(RingHeader& h, uint64_t handle, const OpBegin& op, bool ok, int64_t t_end);

// A consistent copy of the last `max` entries of a ring of `known.capacity` entries (entries being
// written are skipped), its rank, world and host those of `known`. The header's capacity and identity
// are not read; an entry whose operation, state or times cannot be (a corrupt worker's) is left out,
// as is a process id below 0.
RankSnapshot snapshot_of(const RingHeader& h, const RingIdentity& known, size_t max = SIZE_MAX);

int64_t monotonic_ns();

}  // namespace cohort::trace
