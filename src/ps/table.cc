// A parameter-server shard (table.h has the design): its life (the owner creates the shared memory, an
// attached process maps it, the owner retires it), its mappings, and the data path: read, apply (the
// optimizer's rule, optimizer.h, under each row's lock) and put. Finding rows is table_index.cc's, the
// locks' slow paths table_locks.cc's; table_memory.h is what they share.
#include "ps/table.h"

#include <fmt/core.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <new>
#include <thread>

#include <sys/mman.h>
#include <unistd.h>

#include "cohort/error.h"
#include "common/half_arrays.h"
#include "common/handoff.h"
#include "ps/optimizer.h"
#include "ps/table_memory.h"

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

size_t header_insert_lock_offset() { return offsetof(ShardHeader, insert_lock); }
size_t header_rows_offset() { return offsetof(ShardHeader, rows); }

size_t bytes_per_row(const TableConfig& c) {
  size_t row = align8(16 + state_floats(c) * 4 + size_t(c.dim) * storage_bytes(c.storage));
  // Sparse index: 16 bytes per bucket, at least 3/8 full (it doubles at 3/4): 16 * 8 / 3 < 43.
  return c.dense ? row : row + 43;
}

namespace {

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
