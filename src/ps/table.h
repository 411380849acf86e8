#pragma once
// One server's shard of one table: rows in an arena, found through an open-addressing index
// (sparse tables) or by position (dense tables), updated by the table's optimizer.
//
// Shared memory. The shard lives in three memfds (a header, the arena of rows, the index), so that
// workers on the server's host can map it (attach) and pull and push rows themselves, without a
// message to the server or a copy through it (docs/parameter-server.md, "Workers on the server's
// host"). The owner (the server) and every attached worker run this same code on their own mappings:
//   - Rows never move. Row s sits at s * row_bytes in the arena file, which grows in 2 MiB steps;
//     a process whose mapping is shorter than a slot it meets maps the file again, longer.
//   - Row layout: [version u64][id u64][optimizer state f32 x state][values x dim]. The version is a
//     seqlock with a writer bit: a writer (an optimizer step, a load's put) sets the low bit with a
//     compare-and-swap (acquire, then a release fence, so that no write to the row is seen before
//     the bit on any architecture), writes, and stores the next even count (release); a reader
//     copies the row between two equal, even reads of the version and retries otherwise. So two
//     processes' pushes to one row never lose an update, and a pull never sees half of one.
//   - Holders. Every process that writes the shard has a holder slot in the header: slot 0 is the
//     owner (the server), slots 1.. are the workers attached, registered by the server at attach
//     with the pid it read from the worker's socket (SO_PEERCRED) and that process's start time. A
//     locked version word carries its holder's slot in its top 16 bits: [holder 16][count 47][lock 1]
//     (the count and lock bit alone while unlocked); the insert lock holds its holder's slot + 1.
//   - A holder that dies. Before writing a row in place, the writer copies the row (state and
//     values) into its slot's undo record in the header file, marked with the row and the locked
//     word. A process that waits for a lock looks up the holder's process after a few hundred
//     spins, then every 5 ms (a pidfd, and the start time against a reused pid): if it has exited, the waiter takes the
//     lock over with a compare-and-swap (one waiter wins), puts the undo copy back when the record
//     matches (a copy that does not match was not finished, so the row was not yet written), makes
//     the version even, and warns once naming the holder. A dead holder of the insert lock may have
//     counted a row without publishing it; the waiter that takes the lock over publishes it. So no
//     process waits COHORT_TIMEOUT for a dead one, and no half-applied update stays.
//   - Creating rows (first touch) takes the header's insert lock; any process may create rows. The
//     new row is written, then counted (header.rows), then published in the index (its bucket's slot
//     stored last, with release), so a reader that finds a slot finds its row whole.
//   - The index is an array of 16-byte buckets {key, slot + 1} (slot 0 = empty) in the index file,
//     read without locks. At 3/4 load the inserter builds a twice larger array further on in the
//     file, publishes it (header.index: offset and size), and punches the old one out of the file
//     (its memory is freed; it reads as zeros, i.e. empty). A reader still probing the old array
//     then finds nothing, which sends it to the locked path, which looks again in the current array.
//     A probe reads a bucket's slot, key, slot again: a key read between two equal non-zero slots
//     was not punched in between.
//   - The owner retires the shard (header.retired) when a load replaces the table or the server
//     stops; attached workers then drop their mapping and ask the server again.
//
// Why an own index instead of std::unordered_map: a node per entry costs ~40 bytes and an
// allocation per new row; and the index must live in shared memory. At 3/4 load at most, 16 bytes
// per bucket cost 16 / (3/8) < 43 bytes per row at worst (bytes_per_row() in include/cohort/ps.h).
//
// Speed: a pull or push of a few thousand random ids is bound by memory latency (an index bucket
// and a row per id, each a cache and TLB miss in a table of hundreds of MB), not by copying. So
// read() and apply() work in batches: hash every id, then probe the index while prefetching the
// buckets a few ids ahead, then touch the rows while prefetching rows ahead, keeping many misses in
// flight.
//
// One TableShard object is used by one thread at a time (the server's loop, or the client's lock);
// several objects (processes, or threads in tests) share one shard's memory, each through its own
// mapping. A seqlock reader's copy may race with a writer's stores; the version check discards such
// a copy, as in every seqlock.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cohort/ps.h"
#include "common/fd.h"

namespace cohort::ps {

// Storage bytes per value, optimizer-state floats per row (+ Adam's step counter).
size_t storage_bytes(DataType storage);
size_t state_floats(const TableConfig& config);

struct ShardHeader;  // table_memory.h: the shared header's layout

// Where the header file keeps the insert lock (u32: 0 free, else the holder's slot + 1) and the
// count of rows (u64), for tests that watch a shard's memory as another process would.
size_t header_insert_lock_offset();
size_t header_rows_offset();

// Threads of this process in a wait on a shard's row (its lock, or a pull's consistent copy) or on
// its insert lock: counted from the first attempt that fails until the wait ends (the lock taken,
// or an error). For tests that must know a wait has begun before they end it (killing the holder).
int lock_waits_in_process();

class TableShard {
 public:
  // Processes that may write one shard: its server and up to this many attached workers.
  static constexpr uint32_t kMaxHolders = 1024;

  // The owner: creates the shard's shared memory. `first_row`/`num_rows`: a dense table's range
  // held here (ignored for sparse tables). `timeout` bounds the waits for a row or insert lock.
  // `index_rows`: a sparse shard's index starts large enough for that many rows (it doubles at 3/4 load).
  // Refused (InvalidArgument) when those rows, or a dense range, could not fit in this host's memory.
  // `server`: the owner's index, to name it as a lock's holder.
  TableShard(std::string name, const TableConfig& config, uint64_t first_row = 0, uint64_t num_rows = 0,
             std::chrono::milliseconds timeout = std::chrono::seconds(300), uint64_t index_rows = 0,
             int server = 0);
  // An attached process: maps the owner's memory from the descriptors of fds() (header, arena,
  // index), handed over on the same host, as holder `holder` (register_holder's answer).
  TableShard(std::string name, const TableConfig& config, uint64_t first_row, uint64_t num_rows,
             std::vector<UniqueFd> fds, std::chrono::milliseconds timeout, uint32_t holder);
  ~TableShard();  // the owner retires the shard
  TableShard(const TableShard&) = delete;
  TableShard& operator=(const TableShard&) = delete;

  const std::string& name() const { return name_; }
  const TableConfig& config() const { return config_; }
  uint32_t dim() const { return config_.dim; }
  uint64_t first_row() const { return first_row_; }
  uint64_t held_rows() const { return held_rows_; }  // dense: rows of this shard

  // Copies the rows of `ids` (created from the initializer if new) as float32: row i to out + i * dim,
  // or to out_rows[i].
  void read(const uint64_t* ids, size_t n, float* out);
  void read(const uint64_t* ids, size_t n, float* const* out_rows);
  // Applies one gradient per id with the table's optimizer (ids unique within the call): row i of
  // grads, or grad_rows[i].
  void apply(const uint64_t* ids, size_t n, const float* grads);
  void apply(const uint64_t* ids, size_t n, const float* const* grad_rows);

  uint64_t rows() const;     // rows created, by every process
  uint64_t bytes() const;    // arena + current index as allocated
  uint64_t applied() const;  // row updates applied, by every process
  uint64_t direct_applied() const;  // of them, by attached processes
  uint64_t index_doublings() const;  // times the index grew

  // The shared memory's descriptors, to hand to a process on this host (attach).
  std::vector<int> fds() const;
  // The owner: the holder slot of worker `worker`'s process `pid` (its slot again when that process
  // attaches again), or 0 when every slot is taken.
  uint32_t register_holder(int worker, int pid);
  // The owner replaced or dropped the table: an attached process must ask the server again.
  bool retired() const;
  void retire();

  // Visits every row: (id, values as float32, optimizer state), each copied consistently.
  template <typename F>
  void for_each(F&& f) {
    std::vector<float> v(config_.dim), st(state_count_);
    const uint64_t n = rows();
    ensure_arena(n * row_bytes_);  // other processes may have grown it
    for (uint64_t s = 0; s < n; ++s) {
      const uint64_t id = read_row(s, v.data(), st.data());
      f(id, v.data(), st.data());
    }
  }
  // Sets a row (loading): values as float32 and its optimizer state (state_floats() floats).
  void put(uint64_t id, const float* values, const float* state);

 private:
  void map_all();
  void ensure_arena(uint64_t bytes);  // maps at least `bytes` of the arena (file size must allow)
  void ensure_index(uint64_t bytes);
  // Slots of ids[0..n) (created where new), with the index probes prefetched ahead.
  void slots_of(const uint64_t* ids, size_t n, std::vector<uint32_t>& out);
  void slots_uncached(const uint64_t* ids, size_t n, std::vector<uint32_t>& out);
  uint32_t probe(uint64_t desc, uint64_t id) const;  // slot + 1, or 0
  uint32_t insert_locked(uint64_t id);               // slot, created if new
  void grow_index_locked();
  uint32_t new_slot_locked(uint64_t id);
  void publish_locked(uint64_t desc, uint64_t id, uint32_t s);
  void lock_inserts();
  void unlock_inserts();
  // The row lock: returns the locked version word, which unlock_row and the undo record take.
  uint64_t lock_row(uint64_t s, uint8_t* row) const;
  uint64_t wait_row(uint64_t s, uint8_t* row) const;  // lock_row when the row is locked
  void unlock_row(uint8_t* row, uint64_t locked) const;
  // Copies row s into this holder's undo record before it is written in place.
  void save_undo(uint64_t s, const uint8_t* row, uint64_t locked) const;
  // A wait for row s has lasted: recovers the row if its holder died; throws when `expired`.
  void row_stuck(uint64_t s, uint8_t* row, bool expired) const;
  void recover_row(uint64_t s, uint8_t* row, uint64_t locked) const;
  void recover_inserts_locked(uint32_t dead);
  bool holder_gone(uint32_t slot) const;
  std::string holder_name(uint32_t slot) const;
  uint8_t* undo_of(uint32_t slot) const;  // maps another holder's undo record (munmap undo_stride_)
  // Copies slot s consistently: values as float32 and state; returns the row's id.
  uint64_t read_row(uint64_t s, float* values, float* state) const;
  void init_row(uint64_t id, uint8_t* values);
  uint8_t* row_at(uint64_t s) const { return arena_ + s * row_bytes_; }
  uint8_t* slot_values(uint64_t s) const { return row_at(s) + 16 + state_count_ * 4; }
  void to_float(const uint8_t* src, float* dst) const;
  void from_float(const float* src, uint8_t* dst) const;

  std::string name_;
  TableConfig config_;
  bool owner_ = false;
  uint64_t first_row_ = 0;
  uint64_t held_rows_ = 0;
  std::chrono::milliseconds timeout_;
  uint32_t holder_ = 0;      // this process's holder slot (0: the owner)
  size_t value_bytes_ = 0;   // per row
  size_t state_count_ = 0;   // floats per row
  size_t row_bytes_ = 0;     // version + id + state + values, 8-byte aligned
  UniqueFd header_fd_, arena_fd_, index_fd_;
  ShardHeader* header_ = nullptr;
  uint64_t header_bytes_ = 0;  // the header and holder slots; the undo records follow in that file
  uint64_t undo_stride_ = 0;   // bytes per undo record (page-aligned)
  uint8_t* undo_ = nullptr;    // this holder's undo record, mapped
  uint8_t* arena_ = nullptr;
  uint64_t arena_mapped_ = 0;
  uint8_t* index_ = nullptr;
  uint64_t index_mapped_ = 0;
  std::vector<uint32_t> slot_buf_;
  std::vector<uint64_t> last_ids_;    // slots_of's last ids and their slots
  std::vector<uint32_t> last_slots_;
  std::vector<float*> ptr_buf_;
  std::vector<float> row_buf_, state_buf_, init_buf_;
  std::vector<uint8_t> raw_buf_;
};

}  // namespace cohort::ps
