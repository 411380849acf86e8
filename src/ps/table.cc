#include "ps/table.h"

#include <fmt/core.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#include <sys/mman.h>

#include "cohort/error.h"
#include "common/half.h"
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
constexpr uint32_t kEmpty = UINT32_MAX;
}  // namespace

size_t bytes_per_row(const TableConfig& c) {
  size_t row = align8(8 + state_floats(c) * 4 + size_t(c.dim) * storage_bytes(c.storage));
  // Sparse index: 12 bytes per bucket, at least 3/8 full (it doubles at 3/4).
  return c.dense ? row : row + 32;
}

TableShard::TableShard(std::string name, const TableConfig& config, uint64_t first_row, uint64_t num_rows)
    : name_(std::move(name)), config_(config), first_row_(first_row) {
  value_bytes_ = size_t(config_.dim) * storage_bytes(config_.storage);
  state_count_ = state_floats(config_);
  row_bytes_ = align8(8 + state_count_ * 4 + value_bytes_);
  rows_per_chunk_ = std::max<uint64_t>(1, kChunkBytes / row_bytes_);
  if (config_.dense) {
    for (uint64_t i = 0; i < num_rows; ++i) new_slot(first_row + i);
  } else {
    keys_.assign(1024, 0);
    slots_.assign(1024, kEmpty);
    mask_ = 1023;
  }
}

uint8_t* TableShard::slot_values(uint64_t s) const { return row_at(s) + 8 + state_count_ * 4; }
float* TableShard::slot_state(uint64_t s) const { return reinterpret_cast<float*>(row_at(s) + 8); }
uint64_t TableShard::slot_id(uint64_t s) const {
  uint64_t id;
  std::memcpy(&id, row_at(s), 8);
  return id;
}

void TableShard::to_float(const uint8_t* src, float* dst) const {
  const uint32_t d = config_.dim;
  switch (config_.storage) {
    case DataType::kFloat32: std::memcpy(dst, src, d * 4); break;
    case DataType::kFloat16:
      for (uint32_t j = 0; j < d; ++j) {
        uint16_t h;
        std::memcpy(&h, src + 2 * j, 2);
        dst[j] = half_to_float(h);
      }
      break;
    default:
      for (uint32_t j = 0; j < d; ++j) {
        uint16_t h;
        std::memcpy(&h, src + 2 * j, 2);
        dst[j] = bf16_to_float(h);
      }
  }
}

void TableShard::from_float(const float* src, uint8_t* dst) const {
  const uint32_t d = config_.dim;
  switch (config_.storage) {
    case DataType::kFloat32: std::memcpy(dst, src, d * 4); break;
    case DataType::kFloat16:
      for (uint32_t j = 0; j < d; ++j) {
        uint16_t h = float_to_half(src[j]);
        std::memcpy(dst + 2 * j, &h, 2);
      }
      break;
    default:
      for (uint32_t j = 0; j < d; ++j) {
        uint16_t h = float_to_bf16(src[j]);
        std::memcpy(dst + 2 * j, &h, 2);
      }
  }
}

void TableShard::init_row(uint64_t id, uint8_t* values) {
  std::vector<float> v(config_.dim, 0.0f);
  switch (config_.init) {
    case Initializer::kZeros: break;
    case Initializer::kConstant:
      for (auto& x : v) x = config_.init_a;
      break;
    case Initializer::kUniform:
      // A function of (seed, id, column) only: the same row whatever the server count or the order
      // of first touches, so a reloaded or resharded table agrees with a fresh one.
      for (uint32_t j = 0; j < config_.dim; ++j) {
        uint64_t h = mix64(mix64(config_.seed ^ 0x9e3779b97f4a7c15ull) ^ mix64(id) ^ (uint64_t(j) << 1));
        double u = double(h >> 11) * 0x1.0p-53;
        v[j] = float(config_.init_a + (config_.init_b - config_.init_a) * u);
      }
      break;
  }
  from_float(v.data(), values);
}

uint32_t TableShard::new_slot(uint64_t id) {
  uint64_t s = num_rows_used_;
  if (s >= UINT32_MAX - 1) throw InvalidArgument(fmt::format("table '{}': more than 2^32 rows on one server", name_));
  if (s / rows_per_chunk_ >= chunks_.size()) {
    const size_t bytes = (rows_per_chunk_ * row_bytes_ + kChunkBytes - 1) / kChunkBytes * kChunkBytes;
    auto* p = static_cast<uint8_t*>(std::aligned_alloc(kChunkBytes, bytes));
    if (!p) throw std::bad_alloc();
    (void)::madvise(p, bytes, MADV_HUGEPAGE);  // a hint: where huge pages are off, 4 KiB pages serve
    chunks_.emplace_back(p);
  }
  uint8_t* row = row_at(s);
  std::memcpy(row, &id, 8);
  std::memset(row + 8, 0, state_count_ * 4);
  float* st = reinterpret_cast<float*>(row + 8);
  if (config_.optimizer == Optimizer::kAdagrad)
    for (size_t j = 0; j < state_count_; ++j) st[j] = config_.initial_accumulator;
  init_row(id, row + 8 + state_count_ * 4);
  ++num_rows_used_;
  return uint32_t(s);
}

void TableShard::grow_index() {
  std::vector<uint64_t> keys(keys_.size() * 2, 0);
  std::vector<uint32_t> slots(slots_.size() * 2, kEmpty);
  uint64_t mask = keys.size() - 1;
  for (size_t i = 0; i < keys_.size(); ++i) {
    if (slots_[i] == kEmpty) continue;
    uint64_t b = index_hash(keys_[i]) & mask;
    while (slots[b] != kEmpty) b = (b + 1) & mask;
    keys[b] = keys_[i];
    slots[b] = slots_[i];
  }
  keys_.swap(keys);
  slots_.swap(slots);
  mask_ = mask;
}

uint32_t TableShard::slot_of(uint64_t id) {
  if (config_.dense) {
    if (id < first_row_ || id - first_row_ >= num_rows_used_)
      throw InvalidArgument(fmt::format("table '{}': row {} is not held by this server (rows {}..{})", name_, id,
                                        first_row_, first_row_ + num_rows_used_ - 1));
    return uint32_t(id - first_row_);
  }
  uint64_t b = index_hash(id) & mask_;
  while (slots_[b] != kEmpty) {
    if (keys_[b] == id) return slots_[b];
    b = (b + 1) & mask_;
  }
  if ((num_rows_used_ + 1) * 4 > keys_.size() * 3) {
    grow_index();
    b = index_hash(id) & mask_;
    while (slots_[b] != kEmpty) b = (b + 1) & mask_;
  }
  uint32_t s = new_slot(id);
  keys_[b] = id;
  slots_[b] = s;
  return s;
}

namespace {
// How far ahead the batch loops prefetch: enough misses in flight to hide memory latency, few
// enough that the prefetched lines are still in L1/L2 when their turn comes.
constexpr size_t kAhead = 16;
}  // namespace

void TableShard::slots_of(const uint64_t* ids, size_t n, std::vector<uint32_t>& out) {
  out.resize(n);
  if (config_.dense) {
    for (size_t i = 0; i < n; ++i) out[i] = slot_of(ids[i]);
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      const uint64_t b = index_hash(ids[i + kAhead]) & mask_;
      __builtin_prefetch(&keys_[b]);
      __builtin_prefetch(&slots_[b]);
    }
    out[i] = slot_of(ids[i]);  // may grow the index: the prefetches are hints only
  }
}

void TableShard::read(const uint64_t* ids, size_t n, float* out) {
  slots_of(ids, n, slot_buf_);
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      const uint8_t* v = slot_values(slot_buf_[i + kAhead]);
      for (size_t off = 0; off < value_bytes_; off += 64) __builtin_prefetch(v + off);
    }
    to_float(slot_values(slot_buf_[i]), out + i * config_.dim);
  }
}

void TableShard::apply(const uint64_t* ids, size_t n, const float* grads) {
  const uint32_t d = config_.dim;
  std::vector<float> w(d);
  slots_of(ids, n, slot_buf_);
  const size_t touched = row_bytes_ - 8;  // state and values
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      const uint8_t* r = row_at(slot_buf_[i + kAhead]) + 8;
      for (size_t off = 0; off < touched; off += 64) __builtin_prefetch(r + off, 1);
    }
    uint32_t s = slot_buf_[i];
    const float* g = grads + i * d;
    uint8_t* values = slot_values(s);
    to_float(values, w.data());
    float* st = slot_state(s);
    switch (config_.optimizer) {
      case Optimizer::kSgd:
        for (uint32_t j = 0; j < d; ++j) w[j] -= config_.lr * g[j];
        break;
      case Optimizer::kAdagrad:
        for (uint32_t j = 0; j < d; ++j) {
          st[j] += g[j] * g[j];
          w[j] -= config_.lr * g[j] / (std::sqrt(st[j]) + config_.eps);
        }
        break;
      case Optimizer::kAdam: {
        // Lazy Adam (as TensorFlow's for sparse rows): a row's moments and bias correction advance
        // only when the row gets a gradient; st[2d] counts its steps.
        float* m = st;
        float* v = st + d;
        float t = (st[2 * d] += 1.0f);
        const float c1 = 1.0f - std::pow(config_.beta1, t), c2 = 1.0f - std::pow(config_.beta2, t);
        for (uint32_t j = 0; j < d; ++j) {
          m[j] = config_.beta1 * m[j] + (1 - config_.beta1) * g[j];
          v[j] = config_.beta2 * v[j] + (1 - config_.beta2) * g[j] * g[j];
          w[j] -= config_.lr * (m[j] / c1) / (std::sqrt(v[j] / c2) + config_.eps);
        }
        break;
      }
    }
    from_float(w.data(), values);
  }
  applied_ += n;
}

void TableShard::put(uint64_t id, const float* values, const float* state) {
  uint32_t s = slot_of(id);
  from_float(values, slot_values(s));
  if (state_count_) std::memcpy(slot_state(s), state, state_count_ * 4);
}

uint64_t TableShard::bytes() const {
  const uint64_t chunk = (rows_per_chunk_ * row_bytes_ + kChunkBytes - 1) / kChunkBytes * kChunkBytes;
  return chunks_.size() * chunk + keys_.capacity() * 8 + slots_.capacity() * 4;
}

}  // namespace cohort::ps
