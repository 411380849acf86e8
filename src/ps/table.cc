#include "ps/table.h"

#include <fmt/core.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <new>
#include <thread>

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cohort/error.h"
#include "common/half_arrays.h"
#include "common/handoff.h"
#include "common/log.h"
#include "common/proc_stat.h"
#include "common/vector_clones.h"
#include "ps/sharding.h"

namespace cohort::ps {

size_t storage_bytes(DataType storage) {
  switch (storage) {
    case DataType::kFloat32: return 4;
    case DataType::kFloat16:
    case DataType::kBFloat16: return 2;
    default: throw InvalidArgument("parameter-server tables store float32, float16 or bfloat16 rows");
  }
}

size_t state_floats(const TableConfig& c) {
  switch (c.optimizer) {
    case Optimizer::kSgd: return 0;
    case Optimizer::kAdagrad: return c.dim;
    case Optimizer::kAdam: return 2 * size_t(c.dim) + 1;  // m, v, and the row's step count
  }
  return 0;
}

namespace {
size_t align8(size_t n) { return (n + 7) & ~size_t(7); }
constexpr uint64_t kArenaStep = 2u << 20;  // the arena file grows by 2 MiB
constexpr uint64_t kPage = 4096;
constexpr uint32_t kInitialIndexLog2 = 10;  // 1024 buckets
constexpr uint32_t kMiss = UINT32_MAX;
constexpr uint64_t kMagic = 0x3144524148535350ull;  // "PSSHARD1"

// How far ahead the batch loops prefetch: enough misses in flight to hide memory latency, few
// enough that the prefetched lines are still in L1/L2 when their turn comes.
constexpr size_t kAhead = 16;

[[noreturn]] void throw_sys(const std::string& what) {
  throw Error(fmt::format("parameter-server table memory: {}: {}", what, std::strerror(errno)));
}

// An index bucket: the id and its slot + 1 (0: empty), written key first, slot last (release).
struct Bucket {
  uint64_t key;
  uint32_t slot1;
  uint32_t pad;
};
static_assert(sizeof(Bucket) == 16);

// The index descriptor: the array's byte offset in the index file (page-aligned) | log2(buckets).
uint64_t desc_offset(uint64_t d) { return d & ~(kPage - 1); }
uint64_t desc_buckets(uint64_t d) { return uint64_t(1) << (d & 0xff); }
uint64_t desc_end(uint64_t d) { return desc_offset(d) + desc_buckets(d) * sizeof(Bucket); }

// The version word of a row: [holder slot 16][count 47][lock 1]; the holder bits are 0 while unlocked.
constexpr uint64_t kLocked = 1;
constexpr int kHolderShift = 48;
constexpr uint64_t kCountMask = (uint64_t(1) << kHolderShift) - 1;
uint32_t holder_of(uint64_t word) { return uint32_t(word >> kHolderShift); }

// How often a waiter looks for a dead holder: a live one holds a lock for microseconds (longer only
// when preempted), and a look costs a few system calls.
constexpr std::chrono::milliseconds kCheckEvery{5};

std::atomic<int> g_lock_waits{0};  // lock_waits_in_process()

// Counts its thread in lock_waits_in_process() from begin() until it goes.
class CountedWait {
 public:
  CountedWait() = default;
  CountedWait(const CountedWait&) = delete;
  CountedWait& operator=(const CountedWait&) = delete;
  ~CountedWait() {
    if (counted_) g_lock_waits.fetch_sub(1, std::memory_order_release);
  }
  void begin() {
    if (counted_) return;
    counted_ = true;
    g_lock_waits.fetch_add(1, std::memory_order_release);
  }

 private:
  bool counted_ = false;
};

// Waits with a spin, then yielding the core (on a guest with fewer cores than processes the holder
// needs ours). Every kCheckEvery of waiting, stuck(expired) looks at what it waits for: it may find
// the holder dead and recover the lock (the next attempt then goes through); it throws once
// `expired` (the wait has passed `timeout`).
template <typename Try, typename Stuck>
void spin_until(Try&& attempt, std::chrono::milliseconds timeout, Stuck&& stuck) {
  using Clock = std::chrono::steady_clock;
  Clock::time_point start{}, next_check{};
  CountedWait counted;  // from the first attempt that fails: a wait has begun
  for (uint64_t spins = 0;; ++spins) {
    if (attempt()) return;
    counted.begin();
    if (spins < 64) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    } else {
      sched_yield();
      if ((spins & 255) == 255) {
        const auto now = Clock::now();
        if (start == Clock::time_point{}) start = next_check = now;
        if (now >= next_check) {
          stuck(now - start > timeout);
          next_check = now + kCheckEvery;
        }
      }
    }
  }
}

// A process's start time (clock ticks after boot, common/proc_stat.h; with the pid it names one
// process, even once the pid is reused), 0 when unknown.
uint64_t start_ticks(pid_t pid) {
  const auto st = read_proc_stat(pid);
  return st ? st->start_ticks : 0;
}

// An undo record (in the header file, one per holder): the row it copied and the version word the
// holder locked it with, then the row's bytes after its version and id (optimizer state, values).
struct UndoRecord {
  std::atomic<uint64_t> row1;  // slot + 1 (0: none yet)
  std::atomic<uint64_t> word;
};
constexpr size_t kUndoHead = sizeof(UndoRecord);
static_assert(kUndoHead == 16);
}  // namespace

// A process that may write the shard (table.h: holders). Written by the owner, pid last (release),
// before that process gets the memory; never changed after.
struct HolderSlot {
  std::atomic<int32_t> pid;     // 0: free
  std::atomic<int32_t> who;     // a worker's index, or -1 - the server's index
  std::atomic<uint64_t> start;  // the process's start time (start_ticks), 0 unknown
};

// The shared header (the first memfd). Plain fields are written once by the owner before anyone
// attaches; the rest are atomics (lock-free, so address-free across processes). The undo records
// follow it in the same file, one per holder slot, each undo_stride bytes.
struct ShardHeader {
  uint64_t magic;
  uint64_t row_bytes;
  alignas(64) std::atomic<uint32_t> insert_lock;  // 0 free, else the holder's slot + 1
  std::atomic<uint64_t> rows;                     // slots in use; each published after its row is written
  std::atomic<uint64_t> arena_bytes;              // the arena file's size
  std::atomic<uint64_t> index;                    // the current index (descriptor above)
  std::atomic<uint64_t> index_bytes;              // the index file's size
  alignas(64) std::atomic<uint64_t> applied;      // row updates applied, by every process
  std::atomic<uint64_t> direct_applied;           // of them, by attached processes
  std::atomic<uint64_t> index_doublings;          // times the index grew
  alignas(64) std::atomic<uint32_t> retired;      // 1: the owner replaced or dropped the table
  alignas(64) HolderSlot holders[TableShard::kMaxHolders];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free);

size_t header_insert_lock_offset() { return offsetof(ShardHeader, insert_lock); }
size_t header_rows_offset() { return offsetof(ShardHeader, rows); }

int lock_waits_in_process() { return g_lock_waits.load(std::memory_order_acquire); }

size_t bytes_per_row(const TableConfig& c) {
  size_t row = align8(16 + state_floats(c) * 4 + size_t(c.dim) * storage_bytes(c.storage));
  // Sparse index: 16 bytes per bucket, at least 3/8 full (it doubles at 3/4): 16 * 8 / 3 < 43.
  return c.dense ? row : row + 43;
}

namespace {
uint64_t page_align(uint64_t n) { return (n + kPage - 1) / kPage * kPage; }

// The bytes of physical memory of this host.
uint64_t physical_memory() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? uint64_t(pages) * uint64_t(page) : 0;
}

std::string gib(double bytes) { return fmt::format("{:.1f} GiB", bytes / double(1ull << 30)); }
}  // namespace

TableShard::TableShard(std::string name, const TableConfig& config, uint64_t first_row, uint64_t num_rows,
                       std::chrono::milliseconds timeout, uint64_t index_rows, int server)
    : name_(std::move(name)), config_(config), owner_(true), first_row_(first_row), held_rows_(num_rows),
      timeout_(timeout) {
  // Rows that could never fit are refused now, with the figures, rather than by the kernel's
  // out-of-memory killer once they come (expected_rows sizes the index for them from the start; a
  // dense range is created at once).
  const uint64_t planned = config_.dense ? num_rows : index_rows;
  const uint64_t memory = physical_memory();
  if (memory > 0 && planned > 0 && double(planned) * double(bytes_per_row(config_)) > double(memory))
    throw InvalidArgument(fmt::format(
        "table '{}': {} rows on this server ({}) at {} bytes a row make {}, more than this host's memory ({}){}", name_,
        planned, config_.dense ? "its share of the dense rows" : "its share of expected_rows",
        bytes_per_row(config_), gib(double(planned) * double(bytes_per_row(config_))), gib(double(memory)),
        config_.dense ? "" : "; lower expected_rows or add servers"));
  // Buckets for index_rows at 3/4 load at most: a power of two >= index_rows * 4/3.
  uint32_t index_log2 = kInitialIndexLog2;
  while (index_log2 < 40 && (uint64_t(1) << index_log2) * 3 < index_rows * 4 + 4) ++index_log2;
  value_bytes_ = size_t(config_.dim) * storage_bytes(config_.storage);
  state_count_ = state_floats(config_);
  row_bytes_ = align8(16 + state_count_ * 4 + value_bytes_);
  header_bytes_ = page_align(sizeof(ShardHeader));
  undo_stride_ = page_align(row_bytes_);  // the record's head takes the place of the row's version and id
  header_fd_ = UniqueFd(::memfd_create("cohort-ps-header", MFD_CLOEXEC));
  arena_fd_ = UniqueFd(::memfd_create("cohort-ps-rows", MFD_CLOEXEC));
  index_fd_ = UniqueFd(::memfd_create("cohort-ps-index", MFD_CLOEXEC));
  if (!header_fd_ || !arena_fd_ || !index_fd_) throw_sys("memfd_create");
  const uint64_t index_bytes = config_.dense ? 0 : (uint64_t(1) << index_log2) * sizeof(Bucket);
  // The undo records take memory only where a holder has written one (the file is sparse).
  if (::ftruncate(header_fd_.get(), off_t(header_bytes_ + kMaxHolders * undo_stride_)) != 0 ||
      ::ftruncate(index_fd_.get(), off_t(index_bytes)) != 0)
    throw_sys("ftruncate");
  void* h = ::mmap(nullptr, header_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, header_fd_.get(), 0);
  if (h == MAP_FAILED) throw_sys("mmap");
  header_ = new (h) ShardHeader{};
  header_->magic = kMagic;
  header_->row_bytes = row_bytes_;
  header_->index.store(config_.dense ? 0 : index_log2, std::memory_order_relaxed);
  header_->index_bytes.store(index_bytes, std::memory_order_relaxed);
  header_->arena_bytes.store(0, std::memory_order_release);
  HolderSlot& me = header_->holders[0];
  me.who.store(-1 - server, std::memory_order_relaxed);
  me.start.store(start_ticks(::getpid()), std::memory_order_relaxed);
  me.pid.store(::getpid(), std::memory_order_release);
  undo_ = undo_of(0);
  if (config_.dense) {
    lock_inserts();
    for (uint64_t i = 0; i < num_rows; ++i) new_slot_locked(first_row + i);
    unlock_inserts();
  }
}

TableShard::TableShard(std::string name, const TableConfig& config, uint64_t first_row, uint64_t num_rows,
                       std::vector<UniqueFd> fds, std::chrono::milliseconds timeout, uint32_t holder)
    : name_(std::move(name)), config_(config), owner_(false), first_row_(first_row), held_rows_(num_rows),
      timeout_(timeout), holder_(holder) {
  value_bytes_ = size_t(config_.dim) * storage_bytes(config_.storage);
  state_count_ = state_floats(config_);
  row_bytes_ = align8(16 + state_count_ * 4 + value_bytes_);
  header_bytes_ = page_align(sizeof(ShardHeader));
  undo_stride_ = page_align(row_bytes_);
  if (fds.size() != 3) throw Error(fmt::format("table '{}': attach got {} descriptors, not 3", name_, fds.size()));
  if (holder == 0 || holder >= kMaxHolders)
    throw Error(fmt::format("table '{}': attach got holder slot {}, not 1 to {}", name_, holder, kMaxHolders - 1));
  header_fd_ = std::move(fds[0]);
  arena_fd_ = std::move(fds[1]);
  index_fd_ = std::move(fds[2]);
  // The header and every holder's undo record are mapped from the first file: it must hold them all
  // (the rows' and the index's files are checked against the sizes the header gives, as they grow).
  if (std::string why = handoff::too_small(header_fd_.get(), header_bytes_ + kMaxHolders * undo_stride_,
                                           fmt::format("table '{}''s shared header", name_));
      !why.empty())
    throw Error(why);
  void* h = ::mmap(nullptr, header_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, header_fd_.get(), 0);
  if (h == MAP_FAILED) throw_sys("mmap");
  const auto* theirs = static_cast<const ShardHeader*>(h);
  if (theirs->magic != kMagic || theirs->row_bytes != row_bytes_) {
    const uint64_t their_row = theirs->row_bytes;
    ::munmap(h, header_bytes_);  // the destructor does not run for a constructor that throws
    throw Error(fmt::format("table '{}': the server's shared rows have another layout ({} bytes a row, here {})",
                            name_, their_row, row_bytes_));
  }
  header_ = static_cast<ShardHeader*>(h);
  try {
    undo_ = undo_of(holder_);
  } catch (...) {
    ::munmap(h, header_bytes_);
    throw;
  }
}

TableShard::~TableShard() {
  if (owner_ && header_) retire();
  if (arena_) ::munmap(arena_, arena_mapped_);
  if (index_) ::munmap(index_, index_mapped_);
  if (undo_) ::munmap(undo_, undo_stride_);
  if (header_) ::munmap(header_, header_bytes_);
}

uint8_t* TableShard::undo_of(uint32_t slot) const {
  void* p = ::mmap(nullptr, undo_stride_, PROT_READ | PROT_WRITE, MAP_SHARED, header_fd_.get(),
                   off_t(header_bytes_ + uint64_t(slot) * undo_stride_));
  if (p == MAP_FAILED) throw_sys("mmap of an undo record");
  return static_cast<uint8_t*>(p);
}

uint32_t TableShard::register_holder(int worker, int pid) {
  uint32_t free_slot = 0;
  for (uint32_t i = 1; i < kMaxHolders; ++i) {
    HolderSlot& h = header_->holders[i];
    const int32_t p = h.pid.load(std::memory_order_relaxed);
    if (p == pid && h.who.load(std::memory_order_relaxed) == worker) return i;
    if (p == 0 && free_slot == 0) free_slot = i;
  }
  if (free_slot == 0) return 0;
  HolderSlot& h = header_->holders[free_slot];
  h.who.store(worker, std::memory_order_relaxed);
  h.start.store(start_ticks(pid), std::memory_order_relaxed);
  h.pid.store(pid, std::memory_order_release);
  return free_slot;
}

std::vector<int> TableShard::fds() const { return {header_fd_.get(), arena_fd_.get(), index_fd_.get()}; }
bool TableShard::retired() const { return header_->retired.load(std::memory_order_acquire) != 0; }
void TableShard::retire() { header_->retired.store(1, std::memory_order_release); }
uint64_t TableShard::rows() const { return header_->rows.load(std::memory_order_acquire); }
uint64_t TableShard::applied() const { return header_->applied.load(std::memory_order_relaxed); }
uint64_t TableShard::direct_applied() const { return header_->direct_applied.load(std::memory_order_relaxed); }
uint64_t TableShard::index_doublings() const { return header_->index_doublings.load(std::memory_order_relaxed); }
uint64_t TableShard::bytes() const {
  const uint64_t index = config_.dense ? 0 : desc_buckets(header_->index.load(std::memory_order_acquire)) * sizeof(Bucket);
  return header_->arena_bytes.load(std::memory_order_acquire) + index;  // the arena grows in 2 MiB steps
}

// Mappings only grow, by mapping the file again (munmap + mmap rather than mremap, which the
// sanitizers do not follow). A new mapping is twice as long as asked for, beyond the file's end (which
// is allowed; only the part below the file's size is ever touched), so that the file can grow under
// it: remapping drops the page tables, and every page would fault in again. At least 1 GiB of
// address space (not memory) each, so that tables of a few hundred MB are mapped once.
namespace {
// Maps `fd` again, at least `bytes` long, once `file_size` (the file's size, from the header) allows.
// No MADV_HUGEPAGE for the rows: where shmem_enabled is "advise" it gave huge pages, and prefilled
// steps were 15 % faster, but two runs in three that created rows stalled getting them (half the
// rows/s; docs/parameter-server.md, "Huge pages").
void map_at_least(int fd, uint64_t bytes, uint64_t file_size, uint8_t*& base, uint64_t& mapped, const std::string& what) {
  if (bytes <= mapped) return;
  if (file_size < bytes) throw Error(fmt::format("{}: the file holds {} bytes, {} are needed", what, file_size, bytes));
  // The header says so; the file itself must agree, or the first touch past its end is a SIGBUS.
  if (std::string why = handoff::too_small(fd, bytes, what); !why.empty()) throw Error(why);
  if (base) ::munmap(base, mapped);
  base = nullptr;
  mapped = 0;
  const uint64_t length = std::max<uint64_t>(uint64_t(1) << 30, (file_size * 2 + kArenaStep - 1) / kArenaStep * kArenaStep);
  void* p = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw_sys("mmap of " + what);
  base = static_cast<uint8_t*>(p);
  mapped = length;
}
}  // namespace

void TableShard::ensure_arena(uint64_t bytes) {
  if (bytes > arena_mapped_)
    map_at_least(arena_fd_.get(), bytes, header_->arena_bytes.load(std::memory_order_acquire), arena_, arena_mapped_,
                 fmt::format("table '{}''s rows", name_));
}

void TableShard::ensure_index(uint64_t bytes) {
  if (bytes > index_mapped_)
    map_at_least(index_fd_.get(), bytes, header_->index_bytes.load(std::memory_order_acquire), index_, index_mapped_,
                 fmt::format("table '{}''s index", name_));
}

// ---- locks, their holders, and a holder that dies (table.h: holders) ----

std::string TableShard::holder_name(uint32_t slot) const {
  if (slot >= kMaxHolders) return fmt::format("holder slot {} (beyond the table)", slot);
  const HolderSlot& h = header_->holders[slot];
  const int pid = h.pid.load(std::memory_order_acquire);
  if (pid == 0) return fmt::format("an unregistered process (holder slot {})", slot);
  const int who = h.who.load(std::memory_order_relaxed);
  return who >= 0 ? fmt::format("worker {} (pid {})", who, pid)
                  : fmt::format("parameter server {} (pid {})", -1 - who, pid);
}

// Whether the process in holder slot `slot` has exited. False when unsure: the wait then ends at
// its timeout, as it would for a live holder; taking a live holder's lock would corrupt its row.
bool TableShard::holder_gone(uint32_t slot) const {
  if (slot >= kMaxHolders) return false;
  const HolderSlot& h = header_->holders[slot];
  const int pid = h.pid.load(std::memory_order_acquire);
  if (pid <= 0 || pid == ::getpid()) return false;  // unknown, or a thread of this process
  UniqueFd pidfd(int(::syscall(SYS_pidfd_open, pid, 0)));
  if (pidfd) {
    pollfd p{pidfd.get(), POLLIN, 0};
    if (::poll(&p, 1, 0) > 0) return true;  // exited (a zombie not yet reaped too)
  } else if (errno == ESRCH || (::kill(pid, 0) != 0 && errno == ESRCH)) {
    return true;
  }
  // Alive, or a zombie where there is no pidfd (a kernel before 5.3), or another process that got
  // the pid since: /proc tells them apart by state and start time.
  const ProcStat now = read_proc_stat(pid).value_or(ProcStat{});  // state 0 and start 0: unknown
  const uint64_t start = h.start.load(std::memory_order_relaxed);
  return now.state == 'Z' || now.state == 'X' || (start != 0 && now.start_ticks != 0 && now.start_ticks != start);
}

// The first try inline (a push takes thousands of row locks, nearly all free), the wait out of line.
inline uint64_t TableShard::lock_row(uint64_t s, uint8_t* row) const {
  std::atomic_ref<uint64_t> v(*reinterpret_cast<uint64_t*>(row));
  uint64_t x = v.load(std::memory_order_relaxed);
  const uint64_t locked = x | kLocked | (uint64_t(holder_) << kHolderShift);
  if (!(x & kLocked) && v.compare_exchange_strong(x, locked, std::memory_order_acquire, std::memory_order_relaxed)) {
    // The row's writes must not be seen before the lock bit: a reader that copied some of them
    // would then find the version unchanged. (x86 keeps stores in order; ARM and POWER do not.)
    std::atomic_thread_fence(std::memory_order_release);
    return locked;
  }
  return wait_row(s, row);
}

uint64_t TableShard::wait_row(uint64_t s, uint8_t* row) const {
  std::atomic_ref<uint64_t> v(*reinterpret_cast<uint64_t*>(row));
  const uint64_t mine = uint64_t(holder_) << kHolderShift;
  uint64_t locked = 0;
  spin_until(
      [&] {
        uint64_t x = v.load(std::memory_order_relaxed);
        if (x & kLocked) return false;
        locked = x | kLocked | mine;
        return v.compare_exchange_strong(x, locked, std::memory_order_acquire, std::memory_order_relaxed);
      },
      timeout_, [&](bool expired) { row_stuck(s, row, expired); });
  std::atomic_thread_fence(std::memory_order_release);  // as above
  return locked;
}

inline void TableShard::unlock_row(uint8_t* row, uint64_t locked) const {
  std::atomic_ref<uint64_t> v(*reinterpret_cast<uint64_t*>(row));
  v.store(((locked & kCountMask) + 1) & kCountMask, std::memory_order_release);  // even, no holder
}

inline void TableShard::save_undo(uint64_t s, const uint8_t* row, uint64_t locked) const {
  auto* rec = reinterpret_cast<UndoRecord*>(undo_);
  std::memcpy(undo_ + kUndoHead, row + 16, row_bytes_ - 16);
  // Marked after the copy, the row last: a record whose row and word match is whole.
  rec->word.store(locked, std::memory_order_relaxed);
  rec->row1.store(s + 1, std::memory_order_relaxed);
  // Nothing below may be compiled before the record. A process killed at any instruction has made
  // exactly its earlier stores, all visible once it is seen dead, so no hardware fence is needed.
  std::atomic_signal_fence(std::memory_order_seq_cst);
}

void TableShard::row_stuck(uint64_t s, uint8_t* row, bool expired) const {
  std::atomic_ref<uint64_t> v(*reinterpret_cast<uint64_t*>(row));
  const uint64_t word = v.load(std::memory_order_acquire);
  if ((word & kLocked) && holder_gone(holder_of(word))) return recover_row(s, row, word);
  if (!expired) return;
  uint64_t id = 0;
  std::memcpy(&id, row + 8, 8);
  const double seconds = std::chrono::duration<double>(timeout_).count();
  if (word & kLocked)
    throw TimeoutError(fmt::format("table '{}': the lock of row {} was held for more than {:.0f} s (COHORT_TIMEOUT) "
                                   "by {}, which is alive: stopped, or stuck?",
                                   name_, id, seconds, holder_name(holder_of(word))));
  throw TimeoutError(fmt::format("table '{}': row {} changed under every read for more than {:.0f} s (COHORT_TIMEOUT)",
                                 name_, id, seconds));
}

// Row s is locked (word `locked`) by a holder that has exited. Takes the lock over (one waiter wins;
// the others find it taken and wait on), puts the holder's copy of the row back if it had finished
// one (without it, the row was not yet written), and unlocks.
void TableShard::recover_row(uint64_t s, uint8_t* row, uint64_t locked) const {
  const uint32_t dead = holder_of(locked);
  const uint64_t mine = (locked & kCountMask) | (uint64_t(holder_) << kHolderShift);  // still locked
  uint8_t* theirs = undo_of(dead);
  auto* their_rec = reinterpret_cast<UndoRecord*>(theirs);
  const bool copied = their_rec->row1.load(std::memory_order_relaxed) == s + 1 &&
                      their_rec->word.load(std::memory_order_relaxed) == locked;
  // Into this holder's own record before the lock is taken over, marked with the word it will hold:
  // if this process dies while restoring, the next waiter restores from here.
  if (copied) {
    auto* rec = reinterpret_cast<UndoRecord*>(undo_);
    std::memcpy(undo_ + kUndoHead, theirs + kUndoHead, row_bytes_ - 16);
    rec->word.store(mine, std::memory_order_relaxed);
    rec->row1.store(s + 1, std::memory_order_relaxed);
    std::atomic_signal_fence(std::memory_order_seq_cst);
  }
  ::munmap(theirs, undo_stride_);
  std::atomic_ref<uint64_t> v(*reinterpret_cast<uint64_t*>(row));
  uint64_t expected = locked;
  if (!v.compare_exchange_strong(expected, mine, std::memory_order_acq_rel, std::memory_order_relaxed)) return;
  std::atomic_thread_fence(std::memory_order_release);  // as in lock_row
  if (copied) std::memcpy(row + 16, undo_ + kUndoHead, row_bytes_ - 16);
  unlock_row(row, mine);
  uint64_t id = 0;
  std::memcpy(&id, row + 8, 8);
  log::warn("table '{}': {} died holding the lock of row {}; {}", name_, holder_name(dead), id,
            copied ? "its unfinished update was discarded (the row is as it was before)"
                   : "it had not written the row yet");
}

void TableShard::lock_inserts() {
  auto& l = header_->insert_lock;
  const uint32_t mine = holder_ + 1;
  bool taken_over = false;
  spin_until(
      [&] {
        uint32_t free = 0;
        return taken_over ||
               (l.load(std::memory_order_relaxed) == 0 &&
                l.compare_exchange_strong(free, mine, std::memory_order_acquire, std::memory_order_relaxed));
      },
      timeout_, [&](bool expired) {
        uint32_t held = l.load(std::memory_order_acquire);
        if (held != 0 && holder_gone(held - 1)) {
          if (!l.compare_exchange_strong(held, mine, std::memory_order_acq_rel, std::memory_order_relaxed)) return;
          taken_over = true;
          try {
            recover_inserts_locked(held - 1);
          } catch (...) {
            unlock_inserts();
            throw;
          }
          return;
        }
        if (expired)
          throw TimeoutError(fmt::format("table '{}': the lock that creates rows was held for more than {:.0f} s "
                                         "(COHORT_TIMEOUT) by {}, which is alive: stopped, or stuck?",
                                         name_, std::chrono::duration<double>(timeout_).count(),
                                         held ? holder_name(held - 1) : std::string("nobody at the end")));
      });
}

void TableShard::unlock_inserts() { header_->insert_lock.store(0, std::memory_order_release); }

// The insert lock's holder `dead` died, and this process holds the lock now. Rows are created one at
// a time, each written, counted, then published: only the last counted row can lack its bucket.
// A doubling cut short left its new array unpublished: its memory is punched out.
void TableShard::recover_inserts_locked(uint32_t dead) {
  std::string repaired = "no row was left half-created";
  if (!config_.dense) {
    const uint64_t desc = header_->index.load(std::memory_order_acquire);
    ensure_index(desc_end(desc));
    const uint64_t file = header_->index_bytes.load(std::memory_order_acquire);
    const uint64_t used = page_align(desc_end(desc));
    if (file > used)
      (void)::fallocate(index_fd_.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off_t(used), off_t(file - used));
    if (const uint64_t n = header_->rows.load(std::memory_order_acquire); n > 0) {
      ensure_arena(n * row_bytes_);
      uint64_t id = 0;
      std::memcpy(&id, row_at(n - 1) + 8, 8);
      if (probe(desc, id) == 0) {
        publish_locked(desc, id, uint32_t(n - 1));
        repaired = fmt::format("the row it had created for id {} is now in the index", id);
      }
    }
  }
  log::warn("table '{}': {} died holding the lock that creates rows; {}", name_, holder_name(dead), repaired);
}

uint64_t TableShard::read_row(uint64_t s, float* values, float* state) const {
  uint8_t* row = row_at(s);
  std::atomic_ref<uint64_t> v(*reinterpret_cast<uint64_t*>(row));
  uint64_t id = 0;
  std::vector<uint8_t> raw(value_bytes_);
  spin_until(
      [&] {
        const uint64_t before = v.load(std::memory_order_acquire);
        if (before & kLocked) return false;
        std::memcpy(&id, row + 8, 8);
        if (state_count_) std::memcpy(state, row + 16, state_count_ * 4);
        std::memcpy(raw.data(), row + 16 + state_count_ * 4, value_bytes_);
        std::atomic_thread_fence(std::memory_order_acquire);
        return v.load(std::memory_order_relaxed) == before;
      },
      timeout_, [&](bool expired) { row_stuck(s, row, expired); });
  to_float(raw.data(), values);
  return id;
}

void TableShard::to_float(const uint8_t* src, float* dst) const {
  const uint32_t d = config_.dim;
  switch (config_.storage) {
    case DataType::kFloat32: std::memcpy(dst, src, size_t(d) * 4); break;
    case DataType::kFloat16: half_to_floats(reinterpret_cast<const uint16_t*>(src), dst, d); break;
    default: bf16_to_floats(reinterpret_cast<const uint16_t*>(src), dst, d);
  }
}

void TableShard::from_float(const float* src, uint8_t* dst) const {
  const uint32_t d = config_.dim;
  switch (config_.storage) {
    case DataType::kFloat32: std::memcpy(dst, src, size_t(d) * 4); break;
    case DataType::kFloat16: floats_to_half(src, reinterpret_cast<uint16_t*>(dst), d); break;
    default: floats_to_bf16(src, reinterpret_cast<uint16_t*>(dst), d);
  }
}

void TableShard::init_row(uint64_t id, uint8_t* values) {
  if (config_.init == Initializer::kZeros) {
    std::memset(values, 0, value_bytes_);  // +0.0 in every storage type
    return;
  }
  init_buf_.resize(config_.dim);
  float* v = init_buf_.data();
  for (uint32_t j = 0; j < config_.dim; ++j) {
    if (config_.init == Initializer::kConstant) {
      v[j] = config_.init_a;
    } else {
      // Uniform: a function of (seed, id, column) only, so the same row whatever the server count
      // or the order of first touches; a reloaded or resharded table agrees with a fresh one.
      uint64_t h = mix64(mix64(config_.seed ^ 0x9e3779b97f4a7c15ull) ^ mix64(id) ^ (uint64_t(j) << 1));
      double u = double(h >> 11) * 0x1.0p-53;
      v[j] = float(config_.init_a + (config_.init_b - config_.init_a) * u);
    }
  }
  from_float(v, values);
}

uint32_t TableShard::new_slot_locked(uint64_t id) {
  const uint64_t s = header_->rows.load(std::memory_order_relaxed);
  if (s >= kMiss - 1) throw InvalidArgument(fmt::format("table '{}': more than 2^32 rows on one server", name_));
  const uint64_t need = (s + 1) * row_bytes_;
  uint64_t size = header_->arena_bytes.load(std::memory_order_relaxed);
  if (need > size) {
    size = (need + kArenaStep - 1) / kArenaStep * kArenaStep;
    if (::ftruncate(arena_fd_.get(), off_t(size)) != 0) throw_sys("growing the rows");
    header_->arena_bytes.store(size, std::memory_order_release);
  }
  ensure_arena(need);
  // Not yet counted nor indexed: nobody else reads this row until the stores below publish it.
  uint8_t* row = row_at(s);
  std::memset(row, 0, 16 + state_count_ * 4);
  std::memcpy(row + 8, &id, 8);
  float* st = reinterpret_cast<float*>(row + 16);
  if (config_.optimizer == Optimizer::kAdagrad)
    for (size_t j = 0; j < state_count_; ++j) st[j] = config_.initial_accumulator;
  init_row(id, slot_values(s));
  header_->rows.store(s + 1, std::memory_order_release);
  return uint32_t(s);
}

uint32_t TableShard::probe(uint64_t desc, uint64_t id) const {
  auto* b = reinterpret_cast<Bucket*>(index_ + desc_offset(desc));
  const uint64_t mask = desc_buckets(desc) - 1;
  for (uint64_t i = index_hash(id) & mask;; i = (i + 1) & mask) {
    const uint32_t s1 = std::atomic_ref<uint32_t>(b[i].slot1).load(std::memory_order_acquire);
    if (s1 == 0) return 0;
    const uint64_t k = std::atomic_ref<uint64_t>(b[i].key).load(std::memory_order_acquire);
    // A punched (retired) array reads as zeros: a key read between two equal non-zero slots is real.
    if (std::atomic_ref<uint32_t>(b[i].slot1).load(std::memory_order_relaxed) != s1) return 0;
    if (k == id) return s1;
  }
}

void TableShard::grow_index_locked() {
  const uint64_t old = header_->index.load(std::memory_order_relaxed);
  const uint64_t old_buckets = desc_buckets(old);
  const uint64_t log2 = (old & 0xff) + 1;
  const uint64_t offset = (header_->index_bytes.load(std::memory_order_relaxed) + kPage - 1) / kPage * kPage;
  const uint64_t end = offset + (uint64_t(1) << log2) * sizeof(Bucket);
  if (::ftruncate(index_fd_.get(), off_t(end)) != 0) throw_sys("growing the index");
  header_->index_bytes.store(end, std::memory_order_release);
  ensure_index(end);
  auto* from = reinterpret_cast<Bucket*>(index_ + desc_offset(old));
  auto* to = reinterpret_cast<Bucket*>(index_ + offset);
  const uint64_t mask = (uint64_t(1) << log2) - 1;
  // Every other inserter waits meanwhile: the scattered writes are prefetched ahead.
  for (uint64_t i = 0; i < old_buckets; ++i) {
    if (i + kAhead < old_buckets) {
      const uint64_t ahead = std::atomic_ref<uint64_t>(from[i + kAhead].key).load(std::memory_order_relaxed);
      __builtin_prefetch(&to[index_hash(ahead) & mask], 1);
    }
    const uint32_t s1 = std::atomic_ref<uint32_t>(from[i].slot1).load(std::memory_order_relaxed);
    if (s1 == 0) continue;
    const uint64_t key = std::atomic_ref<uint64_t>(from[i].key).load(std::memory_order_relaxed);
    uint64_t j = index_hash(key) & mask;
    while (to[j].slot1 != 0) j = (j + 1) & mask;
    to[j].key = key;  // not yet published: plain stores
    to[j].slot1 = s1;
  }
  header_->index.store(offset | log2, std::memory_order_release);
  header_->index_doublings.fetch_add(1, std::memory_order_relaxed);
  // The old array's memory goes back to the system; late readers of it see empty buckets.
  (void)::fallocate(index_fd_.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off_t(desc_offset(old)),
                    off_t(old_buckets * sizeof(Bucket)));
}

uint32_t TableShard::insert_locked(uint64_t id) {
  uint64_t desc = header_->index.load(std::memory_order_relaxed);
  ensure_index(desc_end(desc));
  if (uint32_t s1 = probe(desc, id)) return s1 - 1;  // created by another process meanwhile
  if ((header_->rows.load(std::memory_order_relaxed) + 1) * 4 > desc_buckets(desc) * 3) {
    grow_index_locked();
    desc = header_->index.load(std::memory_order_relaxed);
  }
  const uint32_t s = new_slot_locked(id);
  publish_locked(desc, id, s);
  return s;
}

void TableShard::publish_locked(uint64_t desc, uint64_t id, uint32_t s) {
  auto* b = reinterpret_cast<Bucket*>(index_ + desc_offset(desc));
  const uint64_t mask = desc_buckets(desc) - 1;
  uint64_t i = index_hash(id) & mask;
  while (std::atomic_ref<uint32_t>(b[i].slot1).load(std::memory_order_relaxed) != 0) i = (i + 1) & mask;
  std::atomic_ref<uint64_t>(b[i].key).store(id, std::memory_order_relaxed);
  std::atomic_ref<uint32_t>(b[i].slot1).store(s + 1, std::memory_order_release);
}

void TableShard::slots_of(const uint64_t* ids, size_t n, std::vector<uint32_t>& out) {
  // A push usually names the ids that the pull before it named, in the same order (a training
  // step pulls a batch's rows and pushes their gradients): then the slots found for the pull serve
  // again (rows never move), and the index is not probed twice. Comparing the ids is a sequential
  // read; each probe is a cache miss.
  if (n == last_ids_.size() && n > 0 && std::memcmp(ids, last_ids_.data(), n * 8) == 0 && &out != &last_slots_) {
    out = last_slots_;
    return;
  }
  slots_uncached(ids, n, out);
  if (n > (size_t{1} << 16)) {  // not kept: a huge call's copies would stay allocated
    last_ids_ = {};
    last_slots_ = {};
    return;
  }
  last_ids_.assign(ids, ids + n);
  last_slots_ = out;
}

void TableShard::slots_uncached(const uint64_t* ids, size_t n, std::vector<uint32_t>& out) {
  out.resize(n);
  if (n == 0) return;
  uint64_t top = 0;
  if (config_.dense) {
    for (size_t i = 0; i < n; ++i) {
      if (ids[i] < first_row_ || ids[i] - first_row_ >= held_rows_)
        throw InvalidArgument(fmt::format("table '{}': row {} is not held by this server (rows {}..{})", name_, ids[i],
                                          first_row_, first_row_ + held_rows_ - 1));
      out[i] = uint32_t(ids[i] - first_row_);
      top = std::max<uint64_t>(top, out[i]);
    }
    ensure_arena((top + 1) * row_bytes_);
    return;
  }
  const uint64_t desc = header_->index.load(std::memory_order_acquire);
  ensure_index(desc_end(desc));
  const uint64_t mask = desc_buckets(desc) - 1;
  const auto* buckets = reinterpret_cast<const Bucket*>(index_ + desc_offset(desc));
  size_t misses = 0;
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) __builtin_prefetch(&buckets[index_hash(ids[i + kAhead]) & mask]);
    const uint32_t s1 = probe(desc, ids[i]);
    out[i] = s1 ? s1 - 1 : kMiss;
    misses += s1 == 0;
  }
  if (misses) {
    lock_inserts();
    try {
      for (size_t i = 0; i < n; ++i)
        if (out[i] == kMiss) out[i] = insert_locked(ids[i]);
    } catch (...) {
      unlock_inserts();
      throw;
    }
    unlock_inserts();
  }
  for (size_t i = 0; i < n; ++i) top = std::max<uint64_t>(top, out[i]);
  ensure_arena((top + 1) * row_bytes_);
}

namespace {
// One row's optimizer step. Vectorized (restrict pointers, and the vectorizer asked for: at -O2 GCC
// only vectorizes loops whose trip count is a multiple of the vector width); a scalar loop costs
// about as much per row as the row's cache misses. The baseline ISA only (no FMA contraction), so
// every machine computes the same bits.
COHORT_VECTORIZE void optimizer_step(const TableConfig& c, float* __restrict w, float* __restrict st,
                                     const float* __restrict g) {
  const uint32_t d = c.dim;
  const float lr = c.lr, eps = c.eps, beta1 = c.beta1, beta2 = c.beta2;
  switch (c.optimizer) {
    case Optimizer::kSgd:
      for (uint32_t j = 0; j < d; ++j) w[j] -= lr * g[j];
      break;
    case Optimizer::kAdagrad:
      for (uint32_t j = 0; j < d; ++j) {
        st[j] += g[j] * g[j];
        w[j] -= lr * g[j] / (std::sqrt(st[j]) + eps);
      }
      break;
    case Optimizer::kAdam: {
      // Lazy Adam (as TensorFlow's for sparse rows): a row's moments and bias correction advance
      // only when the row gets a gradient; st[2d] counts its steps.
      float* m = st;
      float* v = st + d;
      float t = (st[2 * d] += 1.0f);
      const float c1 = 1.0f - std::pow(beta1, t), c2 = 1.0f - std::pow(beta2, t);
      for (uint32_t j = 0; j < d; ++j) {
        m[j] = beta1 * m[j] + (1 - beta1) * g[j];
        v[j] = beta2 * v[j] + (1 - beta2) * g[j] * g[j];
        w[j] -= lr * (m[j] / c1) / (std::sqrt(v[j] / c2) + eps);
      }
      break;
    }
  }
}
}  // namespace

void TableShard::read(const uint64_t* ids, size_t n, float* out) {
  ptr_buf_.resize(n);
  for (size_t i = 0; i < n; ++i) ptr_buf_[i] = out + i * config_.dim;
  read(ids, n, ptr_buf_.data());
}

void TableShard::apply(const uint64_t* ids, size_t n, const float* grads) {
  ptr_buf_.resize(n);
  for (size_t i = 0; i < n; ++i) ptr_buf_[i] = const_cast<float*>(grads + i * config_.dim);
  apply(ids, n, ptr_buf_.data());
}

void TableShard::read(const uint64_t* ids, size_t n, float* const* out_rows) {
  slots_of(ids, n, slot_buf_);
  const uint32_t d = config_.dim;
  const bool plain = config_.storage == DataType::kFloat32;
  row_buf_.resize(d);
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      const uint8_t* r = row_at(slot_buf_[i + kAhead]);
      __builtin_prefetch(r);
      const uint8_t* v = slot_values(slot_buf_[i + kAhead]);
      for (size_t off = 0; off < value_bytes_; off += 64) __builtin_prefetch(v + off);
    }
    uint8_t* row = row_at(slot_buf_[i]);
    const uint8_t* values = slot_values(slot_buf_[i]);
    float* dst = out_rows[i];
    std::atomic_ref<uint64_t> v(*reinterpret_cast<uint64_t*>(row));
    // The seqlock read: float32 rows are copied straight into the caller's buffer.
    spin_until(
        [&] {
          const uint64_t before = v.load(std::memory_order_acquire);
          if (before & kLocked) return false;
          if (plain) std::memcpy(dst, values, value_bytes_);
          else std::memcpy(row_buf_.data(), values, value_bytes_);
          std::atomic_thread_fence(std::memory_order_acquire);
          return v.load(std::memory_order_relaxed) == before;
        },
        timeout_, [&](bool expired) { row_stuck(slot_buf_[i], row, expired); });
    if (!plain) to_float(reinterpret_cast<const uint8_t*>(row_buf_.data()), dst);
  }
}

void TableShard::apply(const uint64_t* ids, size_t n, const float* const* grad_rows) {
  const uint32_t d = config_.dim;
  slots_of(ids, n, slot_buf_);
  // In place for float32 rows; other storage through a float copy.
  const bool in_place = config_.storage == DataType::kFloat32;
  row_buf_.resize(d);
  state_buf_.resize(state_count_);
  const size_t touched = row_bytes_;
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      const uint8_t* r = row_at(slot_buf_[i + kAhead]);
      for (size_t off = 0; off < touched; off += 64) __builtin_prefetch(r + off, 1);
    }
    const uint32_t s = slot_buf_[i];
    uint8_t* row = row_at(s);
    const float* g = grad_rows[i];
    const uint64_t locked = lock_row(s, row);
    save_undo(s, row, locked);
    uint8_t* values = slot_values(s);
    auto* st_shared = reinterpret_cast<float*>(row + 16);
    float* w = in_place ? reinterpret_cast<float*>(values) : row_buf_.data();
    float* st = in_place ? st_shared : state_buf_.data();
    if (!in_place) {
      to_float(values, w);
      if (state_count_) std::memcpy(st, st_shared, state_count_ * 4);
    }
    optimizer_step(config_, w, st, g);
    if (!in_place) {
      from_float(w, values);
      if (state_count_) std::memcpy(st_shared, st, state_count_ * 4);
    }
    unlock_row(row, locked);
  }
  header_->applied.fetch_add(n, std::memory_order_relaxed);
  if (!owner_) header_->direct_applied.fetch_add(n, std::memory_order_relaxed);
}

void TableShard::put(uint64_t id, const float* values, const float* state) {
  slots_of(&id, 1, slot_buf_);
  const uint32_t s = slot_buf_[0];
  uint8_t* row = row_at(s);
  raw_buf_.resize(value_bytes_);
  from_float(values, raw_buf_.data());
  const uint64_t locked = lock_row(s, row);
  save_undo(s, row, locked);
  std::memcpy(slot_values(s), raw_buf_.data(), value_bytes_);
  if (state_count_) std::memcpy(row + 16, state, state_count_ * 4);
  unlock_row(row, locked);
}

}  // namespace cohort::ps
