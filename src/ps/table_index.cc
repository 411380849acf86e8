// Finding a parameter-server shard's rows: the open-addressing index of a sparse table (probe,
// insert, doubling at 3/4 load; table.h: the index), a dense table's rows by position, and the creation
// of a row on its first touch (under the insert lock, initialized from the table's initializer).

#include <fmt/core.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "cohort/error.h"
#include "ps/sharding.h"
#include "ps/table.h"
#include "ps/table_memory.h"

namespace cohort::ps {

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

}  // namespace cohort::ps
