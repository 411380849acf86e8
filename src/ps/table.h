#pragma once
// One server's shard of one table: rows in an arena, found through an open-addressing index
// (sparse tables) or by position (dense tables), updated by the table's optimizer.
//
// Why an own index instead of std::unordered_map: a node per entry costs ~40 bytes and an
// allocation per new row; ids are 8 bytes and rows are a few hundred. The index is two flat
// arrays (keys, row slots: 12 bytes per bucket) with linear probing, grown by doubling at 3/4 load,
// so a sparse row costs at most 12 / (3/8) = 32 bytes of index on top of its values and state
// (bytes_per_row() in include/cohort/ps.h). Rows never move (the arena grows in 2 MiB chunks), so a
// row's slot is stable for the life of the table.
//
// Speed: a pull or push of a few thousand random ids is bound by memory latency (an index bucket
// and a row per id, each a cache and TLB miss in a table of hundreds of MB), not by copying. So
// read() and apply() work in batches: hash every id, then probe the index while prefetching the
// buckets a few ids ahead, then touch the rows while prefetching rows ahead, keeping many misses in
// flight; and the arena's chunks are 2 MiB-aligned and asked for as transparent huge pages, so a
// row costs no page walk.
//
// Not thread-safe: a server's loop thread owns its tables.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "cohort/ps.h"

namespace cohort::ps {

// Storage bytes per value, optimizer-state floats per row (+ Adam's step counter).
size_t storage_bytes(DataType storage);
size_t state_floats(const TableConfig& config);

class TableShard {
 public:
  // `first_row`/`num_rows`: a dense table's range held here (ignored for sparse tables).
  TableShard(std::string name, const TableConfig& config, uint64_t first_row = 0, uint64_t num_rows = 0);

  const std::string& name() const { return name_; }
  const TableConfig& config() const { return config_; }
  uint32_t dim() const { return config_.dim; }

  // Copies the rows of `ids` (created from the initializer if new) as float32.
  void read(const uint64_t* ids, size_t n, float* out);
  // Applies one gradient per id with the table's optimizer (ids unique within the call).
  void apply(const uint64_t* ids, size_t n, const float* grads);

  uint64_t rows() const { return num_rows_used_; }
  uint64_t bytes() const;  // arena + index as allocated
  uint64_t applied() const { return applied_; }

  // Visits every row: (id, values as float32, optimizer state).
  template <typename F>
  void for_each(F&& f) const {
    std::vector<float> v(config_.dim);
    for (uint64_t s = 0; s < num_rows_used_; ++s) {
      to_float(slot_values(s), v.data());
      f(slot_id(s), v.data(), slot_state(s));
    }
  }
  // Sets a row (loading): values as float32 and its optimizer state (state_floats() floats).
  void put(uint64_t id, const float* values, const float* state);

 private:
  uint32_t slot_of(uint64_t id);  // finds or creates
  uint32_t new_slot(uint64_t id);
  void grow_index();
  void init_row(uint64_t id, uint8_t* values);
  uint8_t* slot_values(uint64_t s) const;
  float* slot_state(uint64_t s) const;
  uint64_t slot_id(uint64_t s) const;
  void to_float(const uint8_t* src, float* dst) const;
  void from_float(const float* src, uint8_t* dst) const;

  std::string name_;
  TableConfig config_;
  uint64_t first_row_ = 0;
  size_t value_bytes_ = 0;   // per row
  size_t state_count_ = 0;   // floats per row
  size_t row_bytes_ = 0;     // id + values + state, 8-byte aligned
  // Arena: 2 MiB chunks of rows_per_chunk_ rows, each row = [id u64][state floats][values].
  static constexpr size_t kChunkBytes = 2u << 20;
  struct FreeChunk {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::vector<std::unique_ptr<uint8_t, FreeChunk>> chunks_;
  uint64_t rows_per_chunk_ = 1;
  uint8_t* row_at(uint64_t s) const {
    return chunks_[s / rows_per_chunk_].get() + (s % rows_per_chunk_) * row_bytes_;
  }
  // Slots of ids[0..n) (created where new), with the index probes prefetched ahead.
  void slots_of(const uint64_t* ids, size_t n, std::vector<uint32_t>& out);
  std::vector<uint32_t> slot_buf_;
  uint64_t num_rows_used_ = 0;
  // Sparse index: capacity a power of two; slot UINT32_MAX = empty.
  std::vector<uint64_t> keys_;
  std::vector<uint32_t> slots_;
  uint64_t mask_ = 0;
  uint64_t applied_ = 0;
};

}  // namespace cohort::ps
