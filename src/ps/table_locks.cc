// A parameter-server shard's locks, their slow paths: a wait for a row or for the insert lock, the
// processes that may hold them (holder slots), and the recovery from a holder that died holding one
// (table.h: holders). The fast path of the row lock is inline in table_memory.h.

#include <fmt/core.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cohort/error.h"
#include "common/fd.h"
#include "common/log.h"
#include "common/proc_stat.h"
#include "ps/table.h"
#include "ps/table_memory.h"

namespace cohort::ps {

std::atomic<int> g_lock_waits{0};

int lock_waits_in_process() { return g_lock_waits.load(std::memory_order_acquire); }

uint64_t start_ticks(pid_t pid) {
  const auto st = read_proc_stat(pid);
  return st ? st->start_ticks : 0;
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

// A row lock's wait (lock_row, table_memory.h, found the row locked).
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

}  // namespace cohort::ps
