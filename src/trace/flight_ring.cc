#include "trace/flight_ring.h"

#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <utility>

#include <fmt/core.h>

#include "cohort/error.h"
#include "cohort/types.h"
#include "common/strings.h"
#include "trace/describe.h"

namespace cohort::trace {

const char* op_state_name(OpState s) {
  switch (s) {
    case OpState::kEmpty: return "empty";
    case OpState::kQueued: return "queued";
    case OpState::kRunning: return "running";
    case OpState::kDone: return "done";
    case OpState::kFailed: return "failed";
  }
  return "unknown";
}

int64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

size_t ring_bytes(uint32_t capacity) { return sizeof(RingHeader) + size_t(capacity) * sizeof(RingEntry); }

std::string describe(const OpRecord& r) {
  if (r.kind == coll::OpKind::kSendRecv)
    return fmt::format("send/recv with rank {} ({})", r.peer, str::format_bytes(r.bytes));
  transport::Signature s;
  s.op = uint8_t(r.kind);
  s.dtype = r.dtype;
  s.redop = r.redop;
  s.root = uint32_t(std::max(r.peer, 0));
  s.count = r.count;
  return fmt::format("#{} {} ({})", r.seq, describe_signature(s), str::format_bytes(r.bytes));
}

namespace {

// Entry fields are written and read through relaxed atomic accesses (plain moves on x86): a reader
// copying an entry while its writer changes it gets values the seqlock then rejects, not undefined
// behaviour. (Writers of one slot never overlap: each holds its odd version, taken by a CAS.)
template <typename T>
void put(T& field, T value) {
  std::atomic_ref<T>(field).store(value, std::memory_order_relaxed);
}
template <typename T>
T get(const T& field) {
  return std::atomic_ref<T>(const_cast<T&>(field)).load(std::memory_order_relaxed);
}

RingEntry* entries_of(RingHeader& h) {
  return reinterpret_cast<RingEntry*>(reinterpret_cast<char*>(&h) + sizeof(RingHeader));
}

// Versions (see RingEntry): 4 x position + phase, modulo 2^32.
constexpr uint32_t kAppending = 1, kAppended = 2, kFinishing = 3;
uint32_t version_of(uint64_t index, uint32_t phase) { return uint32_t(index) * 4 + phase; }
// The position (modulo 2^30) whose write `version` is or was: the inverse of version_of for the
// phases 1 to 4.
uint32_t position_of(uint32_t version) { return (version - 1) >> 2; }
constexpr uint32_t kPositionMask = (1u << 30) - 1;
// Whether version `a` comes after `b` in a slot's history (their distance is far under 2^31).
bool later(uint32_t a, uint32_t b) { return int32_t(a - b) > 0; }

// Takes slot `e` for the append of position `index`: true with the version odd and ours. False when a
// later operation wrote or writes the slot (ours is history already), or when an earlier write of it
// stays in progress past kRingAppendWaitNs.
bool take_for_append(RingEntry& e, uint64_t index) {
  const uint32_t mine = version_of(index, kAppending);
  uint32_t v = e.version.load(std::memory_order_relaxed);
  int64_t waiting_since = 0;
  for (int spins = 0;; ++spins) {
    if (!later(mine, v)) return false;
    if ((v & 1) == 0) {
      // Acquire: the fields written under the version we replace are not reordered after ours.
      if (e.version.compare_exchange_weak(v, mine, std::memory_order_acquire, std::memory_order_relaxed)) return true;
      continue;  // v holds the version seen instead
    }
    // An earlier operation's append or finish is in the middle of its stores: a few nanoseconds, unless
    // its thread was preempted there. Spin, then give the core away (it may be waiting for it).
    if (spins < 64) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    } else {
      int64_t now = monotonic_ns();
      if (waiting_since == 0) waiting_since = now;
      if (now - waiting_since > kRingAppendWaitNs) return false;
      sched_yield();
    }
    v = e.version.load(std::memory_order_relaxed);
  }
}

}  // namespace

uint64_t ring_append(RingHeader& h, const OpBegin& op) {
  uint64_t i = h.next.fetch_add(1, std::memory_order_relaxed);
  RingEntry& e = entries_of(h)[i % h.capacity];
  if (!take_for_append(e, i)) return i + 1;  // ring_finish will find the slot is not this operation's
  // The odd version is visible before any field changes (a reader that sees a new field sees it).
  std::atomic_thread_fence(std::memory_order_release);
  put(e.comm, op.comm);
  put(e.seq, op.seq);
  put(e.peer, op.peer);
  put(e.kind, op.kind);
  put(e.dtype, op.dtype);
  put(e.redop, op.redop);
  put(e.state, OpState::kRunning);
  put(e.count, op.count);
  put(e.bytes, op.bytes);
  put(e.t_queued, op.t_queued);
  put(e.t_start, op.t_start);
  put(e.t_end, int64_t(0));
  e.version.store(version_of(i, kAppended), std::memory_order_release);
  return i + 1;
}

OpRecord finished_record(const OpBegin& op, bool ok, int64_t t_end) {
  OpRecord r;
  r.seq = op.seq;
  r.comm = op.comm;
  r.peer = op.peer;
  r.kind = op.kind;
  r.dtype = op.dtype;
  r.redop = op.redop;
  r.state = ok ? OpState::kDone : OpState::kFailed;
  r.count = op.count;
  r.bytes = op.bytes;
  r.t_queued = op.t_queued;
  r.t_start = op.t_start;
  r.t_end = t_end;
  return r;
}

void ring_finish(RingHeader& h, uint64_t handle, const OpBegin& op, bool ok, int64_t t_end) {
  // The live counters take a plain load and store, not a locked add: they only feed live stats, and
  // two threads finishing operations at the same instant may lose one count, which costs less than
  // three locked instructions per operation for everyone.
  auto bump = [](std::atomic<uint64_t>& a, uint64_t d) { a.store(a.load(std::memory_order_relaxed) + d, std::memory_order_relaxed); };
  auto& c = h.counters;
  bump(c.ops, 1);
  bump(c.bytes, op.bytes);
  if (t_end > 0) bump(c.op_ns, uint64_t(t_end - op.t_start));
  uint64_t i = handle - 1;
  RingEntry& e = entries_of(h)[i % h.capacity];
  uint32_t v = version_of(i, kAppended);
  if (e.version.load(std::memory_order_acquire) != v) return;  // the ring went round during this operation
  // The version repeats every 2^30 operations: an operation that ran that long finds another one's
  // entry under it. Read under the version, the fields say whose it is (the CAS fails if they change).
  if (get(e.t_start) != op.t_start || get(e.seq) != op.seq || get(e.comm) != op.comm) return;
  if (!e.version.compare_exchange_strong(v, version_of(i, kFinishing), std::memory_order_acq_rel,
                                         std::memory_order_relaxed))
    return;  // a later operation took the slot meanwhile
  std::atomic_thread_fence(std::memory_order_release);
  put(e.state, ok ? OpState::kDone : OpState::kFailed);
  put(e.t_end, t_end);
  e.version.store(version_of(i, kFinishing + 1), std::memory_order_release);
}

Ring Ring::create(uint32_t capacity, int rank, int world, const std::string& host, bool timing) {
  if (capacity == 0) throw InvalidArgument("flight recorder ring of 0 entries");
  Ring ring;
  // Close-on-exec like every descriptor of the launcher: the worker's child clears it on this one.
  ring.fd_ = memfd_create(fmt::format("cohort-flight-recorder-rank{}", rank).c_str(), MFD_CLOEXEC);
  if (ring.fd_ < 0) throw Error(fmt::format("memfd_create for the flight recorder: {}", strerror(errno)));
  ring.bytes_ = ring_bytes(capacity);
  if (ftruncate(ring.fd_, off_t(ring.bytes_)) != 0)
    throw Error(fmt::format("sizing the flight recorder ({} bytes): {}", ring.bytes_, strerror(errno)));
  ring.base_ = mmap(nullptr, ring.bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, ring.fd_, 0);
  if (ring.base_ == MAP_FAILED) {
    ring.base_ = nullptr;
    throw Error(fmt::format("mapping the flight recorder: {}", strerror(errno)));
  }
  ring.header_ = static_cast<RingHeader*>(ring.base_);
  ring.entries_ = reinterpret_cast<RingEntry*>(static_cast<char*>(ring.base_) + sizeof(RingHeader));
  // The pages are zero (ftruncate): every counter and entry starts empty.
  auto& h = *ring.header_;
  std::memcpy(h.magic, kRingMagic, sizeof h.magic);
  h.capacity = capacity;
  h.timing = timing ? 1 : 0;
  h.rank = rank;
  h.world = world;
  std::snprintf(h.host, sizeof h.host, "%s", host.c_str());
  ring.identity_ = {capacity, rank, world, std::string(h.host, strnlen(h.host, sizeof h.host))};
  return ring;
}

Ring Ring::adopt(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || size_t(st.st_size) < sizeof(RingHeader))
    throw ConfigError(fmt::format("COHORT_FLIGHT_RECORDER_FD={}: not a flight recorder ring (set by cohort run; "
                                  "unset it to record in this process only)",
                                  fd));
  Ring ring;  // takes the descriptor only once it is known to be a ring (a failure must not close it)
  ring.bytes_ = size_t(st.st_size);
  ring.base_ = mmap(nullptr, ring.bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (ring.base_ == MAP_FAILED) {
    ring.base_ = nullptr;
    throw ConfigError(fmt::format("COHORT_FLIGHT_RECORDER_FD={}: cannot map it: {}", fd, strerror(errno)));
  }
  ring.header_ = static_cast<RingHeader*>(ring.base_);
  ring.entries_ = reinterpret_cast<RingEntry*>(static_cast<char*>(ring.base_) + sizeof(RingHeader));
  // (A throw unmaps the ring in its destructor; the descriptor stays the caller's.)
  const char* magic = ring.header_->magic;
  if (std::memcmp(magic, kRingMagic, sizeof kRingMagic - 1) != 0 || ring_bytes(ring.header_->capacity) != ring.bytes_)
    throw ConfigError(fmt::format("COHORT_FLIGHT_RECORDER_FD={}: not a flight recorder ring", fd));
  if (magic[7] != kRingLayout)
    throw RingLayoutError(fmt::format(
        "COHORT_FLIGHT_RECORDER_FD={}: the launcher's flight recorder ring has layout {}, this program's cohort "
        "library writes layout {}: `cohort run` and the library are different versions; this rank records its "
        "operations in its own memory only (the launcher's stall warnings and failure diagnosis cannot see them)",
        fd, std::isprint(static_cast<unsigned char>(magic[7])) ? std::string(1, magic[7]) : std::string("?"),
        kRingLayout));
  // The worker's side: the launcher that made the ring wrote these.
  const RingHeader& h = *ring.header_;
  ring.identity_ = {h.capacity, h.rank, h.world, std::string(h.host, strnlen(h.host, sizeof h.host))};
  ring.fd_ = fd;
  return ring;
}

Ring::Ring(Ring&& o) noexcept { *this = std::move(o); }

Ring& Ring::operator=(Ring&& o) noexcept {
  if (this != &o) {
    unmap();
    close_fd();
    fd_ = std::exchange(o.fd_, -1);
    base_ = std::exchange(o.base_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    header_ = std::exchange(o.header_, nullptr);
    entries_ = std::exchange(o.entries_, nullptr);
    identity_ = std::exchange(o.identity_, {});
  }
  return *this;
}

Ring::~Ring() {
  unmap();
  close_fd();
}

void Ring::close_fd() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void Ring::unmap() {
  if (base_) munmap(base_, bytes_);
  base_ = nullptr;
  header_ = nullptr;
  entries_ = nullptr;
}

RankSnapshot Ring::snapshot(size_t max) const { return snapshot_of(*header_, identity_, max); }

namespace {

// Whether a record copied from a ring can describe an operation of this host's: a known operation and
// state, and times of this host's monotonic clock up to the moment of the copy. (Anything else was
// written by a worker whose memory is corrupt; describing it could index past a table.)
bool plausible(const OpRecord& r, int64_t now) {
  if (r.kind > coll::kLastOpKind) return false;
  if (r.state != OpState::kQueued && r.state != OpState::kRunning && r.state != OpState::kDone &&
      r.state != OpState::kFailed)
    return false;
  for (int64_t t : {r.t_queued, r.t_start, r.t_end})
    if (t < 0 || (t > now && t > monotonic_ns())) return false;  // (written since `now` was read: fine)
  return true;
}

}  // namespace

RankSnapshot snapshot_of(const RingHeader& h, const RingIdentity& known, size_t max) {
  RankSnapshot s;
  const auto* entries = reinterpret_cast<const RingEntry*>(reinterpret_cast<const char*>(&h) + sizeof(RingHeader));
  s.rank = known.rank;
  s.world = known.world;
  s.host = known.host;
  s.pid = std::max(h.pid.load(std::memory_order_acquire), 0);
  s.started = s.pid != 0;
  if (known.capacity == 0) return s;
  s.taken_at = monotonic_ns();
  const auto& c = h.counters;
  s.counters = {c.ops.load(std::memory_order_relaxed),   c.bytes.load(std::memory_order_relaxed),
                c.op_ns.load(std::memory_order_relaxed), c.steps.load(std::memory_order_relaxed),
                c.step_ns.load(std::memory_order_relaxed), c.wait_ns.load(std::memory_order_relaxed)};
  uint64_t next = h.next.load(std::memory_order_acquire);
  s.total = next;
  uint64_t n = std::min<uint64_t>({next, known.capacity, max});
  for (uint64_t i = next - n; i < next; ++i) {
    const RingEntry& e = entries[i % known.capacity];
    uint32_t v1 = e.version.load(std::memory_order_acquire);
    if (v1 & 1) continue;  // being written: its older contents are gone, its newer are not there yet
    // Another operation's entry: an earlier one whose slot this one has not reached yet, or a later one
    // (the ring went round since `next` was read).
    if (position_of(v1) != (uint32_t(i) & kPositionMask)) continue;
    OpRecord r;
    r.index = i;
    r.seq = get(e.seq);
    r.comm = get(e.comm);
    r.peer = get(e.peer);
    r.kind = get(e.kind);
    r.dtype = get(e.dtype);
    r.redop = get(e.redop);
    r.state = get(e.state);
    r.count = get(e.count);
    r.bytes = get(e.bytes);
    r.t_queued = get(e.t_queued);
    r.t_start = get(e.t_start);
    r.t_end = get(e.t_end);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (e.version.load(std::memory_order_relaxed) != v1 || !plausible(r, s.taken_at)) continue;
    s.entries.push_back(r);
  }
  return s;
}

}  // namespace cohort::trace
