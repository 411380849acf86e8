#pragma once
// One parameter-server shard's shared memory, as every file of the table (table*.cc) sees it: the
// header's and the index's layout, a row's version word and undo record, and the waits on its locks.
// table.h describes the design; this header is internal to the table's files.
//
//   table.cc        the shard's life (create, attach, retire), its mappings, and the data path: read,
//                   apply (the optimizer step, optimizer.h), put
//   table_index.cc  finding rows: the open-addressing index and the creation of rows
//   table_locks.cc  the locks' slow paths: waits, holders, and recovery from a holder that died
//
// The row lock's fast path (lock_row, unlock_row, save_undo) is defined here, inline: read and
// apply take thousands of row locks per call, nearly all free.

#include <fmt/core.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include <sched.h>
#include <sys/types.h>

#include "cohort/error.h"
#include "ps/table.h"

namespace cohort::ps {

inline size_t align8(size_t n) { return (n + 7) & ~size_t(7); }
constexpr uint64_t kArenaStep = 2u << 20;  // the arena file grows by 2 MiB
constexpr uint64_t kPage = 4096;
constexpr uint32_t kInitialIndexLog2 = 10;  // 1024 buckets
constexpr uint32_t kMiss = UINT32_MAX;
constexpr uint64_t kMagic = 0x3144524148535350ull;  // "PSSHARD1"

// How far ahead the batch loops prefetch: enough misses in flight to hide memory latency, few
// enough that the prefetched lines are still in L1/L2 when their turn comes.
constexpr size_t kAhead = 16;

[[noreturn]] inline void throw_sys(const std::string& what) {
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
inline uint64_t desc_offset(uint64_t d) { return d & ~(kPage - 1); }
inline uint64_t desc_buckets(uint64_t d) { return uint64_t(1) << (d & 0xff); }
inline uint64_t desc_end(uint64_t d) { return desc_offset(d) + desc_buckets(d) * sizeof(Bucket); }

// The version word of a row: [holder slot 16][count 47][lock 1]; the holder bits are 0 while unlocked.
constexpr uint64_t kLocked = 1;
constexpr int kHolderShift = 48;
constexpr uint64_t kCountMask = (uint64_t(1) << kHolderShift) - 1;
inline uint32_t holder_of(uint64_t word) { return uint32_t(word >> kHolderShift); }

// How often a waiter looks for a dead holder: a live one holds a lock for microseconds (longer only
// when preempted), and a look costs a few system calls.
constexpr std::chrono::milliseconds kCheckEvery{5};

// Threads of this process in a wait on a row or the insert lock (lock_waits_in_process()).
extern std::atomic<int> g_lock_waits;

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
uint64_t start_ticks(pid_t pid);

// An undo record (in the header file, one per holder): the row it copied and the version word the
// holder locked it with, then the row's bytes after its version and id (optimizer state, values).
struct UndoRecord {
  std::atomic<uint64_t> row1;  // slot + 1 (0: none yet)
  std::atomic<uint64_t> word;
};
constexpr size_t kUndoHead = sizeof(UndoRecord);
static_assert(kUndoHead == 16);

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

inline uint64_t page_align(uint64_t n) { return (n + kPage - 1) / kPage * kPage; }

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

}  // namespace cohort::ps
