#include "transport/matching.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>

#include <fmt/core.h>

#include "cohort/error.h"

namespace cohort::transport {

uint64_t scope_hash(const std::string& job_scope) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : job_scope) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

namespace {
std::atomic<uint64_t> g_buffered_bytes{0};  // every Matching's buffered_bytes_, summed
}  // namespace

uint64_t buffered_bytes_in_process() { return g_buffered_bytes.load(std::memory_order_relaxed); }

// ---- BufferPool ----

BufferPool::~BufferPool() {
  for (auto& v : free_)
    for (char* p : v) delete[] p;
}

char* BufferPool::take(size_t n, size_t& cap) {
  if (n < 4096) {  // small: not worth pooling
    cap = std::max<size_t>(n, 1);
    return new char[cap];
  }
  int cls = 64 - __builtin_clzll(uint64_t(n - 1));
  cap = size_t(1) << cls;
  if (!free_[cls].empty()) {
    char* p = free_[cls].back();
    free_[cls].pop_back();
    pooled_ -= cap;
    return p;
  }
  return new char[cap];
}

void BufferPool::give(char* p, size_t cap) {
  if (cap >= 4096 && pooled_ + cap <= limit_) {
    free_[63 - __builtin_clzll(uint64_t(cap))].push_back(p);
    pooled_ += cap;
  } else {
    delete[] p;
  }
}

void PooledBuffer::reset() {
  if (p_) pool_->give(p_, cap_);
  p_ = nullptr;
}

void PooledBuffer::allocate(BufferPool* pool, size_t n) {
  reset();
  pool_ = pool;
  p_ = pool->take(n, cap_);
}

// ---- Matching ----

uint32_t Matching::alloc(bool is_send, int peer, char* data, size_t bytes, const Envelope& env) {
  uint32_t idx;
  if (!free_.empty()) {
    idx = free_.back();
    free_.pop_back();
  } else {
    idx = uint32_t(reqs_.size());
    reqs_.emplace_back();
  }
  Request& r = reqs_[idx];
  uint32_t gen = r.gen + 1;
  r = Request{};
  r.gen = gen;
  r.in_use = true;
  r.is_send = is_send;
  r.peer = peer;
  r.data = data;
  r.bytes = bytes;
  r.key = MessageKey{peer, env.tag, env.sub};
  r.env = env;
  return idx;
}

bool Matching::test(RequestId id, const std::exception_ptr& failed) {
  uint32_t idx = uint32_t(id);
  if (idx >= reqs_.size()) throw std::logic_error(fmt::format("{} transport: unknown request id", transport_));
  Request& r = reqs_[idx];
  if (!r.in_use || r.gen != uint32_t(id >> 32))
    throw std::logic_error(fmt::format("{} transport: stale request id", transport_));
  if (r.done) {
    std::exception_ptr e = r.error;
    release(idx);
    if (e) std::rethrow_exception(e);
    return true;
  }
  if (failed) {
    release(idx);
    std::rethrow_exception(failed);
  }
  return false;
}

bool Matching::peek(RequestId id) const {
  uint32_t idx = uint32_t(id);
  if (idx >= reqs_.size()) return false;
  const Request& r = reqs_[idx];
  return r.in_use && r.gen == uint32_t(id >> 32) && r.done;
}

void Matching::release(uint32_t idx) {
  Request& r = reqs_[idx];
  if (!r.done && !r.is_send) {
    auto it = posted.find(r.key);
    if (it != posted.end() && it->second == idx) posted.erase(it);
    auto u = unexpected.find(r.key);
    if (u != unexpected.end() && u->second.attached == int(idx)) u->second.attached = -1;
  }
  r.in_use = false;
  free_.push_back(idx);
}

void Matching::post(uint32_t idx) {
  const Request& r = reqs_[idx];
  auto [pos, inserted] = posted.emplace(r.key, idx);
  if (!inserted) {
    throw InvalidArgument(fmt::format("two receives posted for the same message from rank {} (tag {:#x}, sub {:#x})",
                                      r.peer, r.env.tag, r.env.sub));
  }
}

std::string Matching::mismatch(int peer, const std::string& host, const Signature& theirs, size_t total,
                               const Request& r, const MismatchFormatter& formatter) {
  if (!(theirs == r.env.signature)) {
    return formatter ? formatter(peer, theirs, r.env.signature, r.env)
                     : fmt::format("rank {} sent a message of a different operation", peer);
  }
  if (total != r.bytes) {
    std::string msg = fmt::format("rank {} ({}) sent {} bytes where this rank expected {} (tag {:#x}, sub {:#x})", peer,
                                  host, total, r.bytes, r.env.tag, r.env.sub);
    return formatter ? formatter(peer, theirs, r.env.signature, r.env) + ": " + msg : msg;
  }
  return "";
}

Unexpected* Matching::find_unexpected(const Request& r) {
  auto it = unexpected.find(r.key);
  return it == unexpected.end() ? nullptr : &it->second;
}

void Matching::adopt(uint32_t idx, Unexpected& u) {
  Request& r = reqs_[idx];
  if (u.received == u.total) {
    if (r.bytes) std::memcpy(r.data, u.buf.get(), r.bytes);
    r.done = true;
    r.remaining = 0;
    erase_unexpected(unexpected.find(r.key));
  } else {
    u.attached = int(idx);
  }
}

void Matching::unexpected_arrived(const MessageKey& key, Unexpected& u) {
  if (u.discarded) return erase_unexpected(unexpected.find(key));
  if (u.attached < 0) return;  // its receive is not posted yet: irecv() will adopt it
  Request& r = reqs_[size_t(u.attached)];
  if (r.bytes) std::memcpy(r.data, u.buf.get(), r.bytes);
  r.done = true;
  r.remaining = 0;
  erase_unexpected(unexpected.find(key));
}

Unexpected& Matching::add_unexpected(const MessageKey& key, const Signature& signature, size_t total) {
  auto [it, fresh] = unexpected.try_emplace(key);
  Unexpected& u = it->second;
  if (!fresh) buffered_bytes_ -= u.total, g_buffered_bytes -= u.total;
  u.total = total;
  u.received = 0;
  u.signature = signature;
  u.attached = -1;
  u.discarded = false;
  u.buf.allocate(&pool_, total);
  buffered_bytes_ += total;
  g_buffered_bytes += total;
  return u;
}

void Matching::erase_unexpected(std::unordered_map<MessageKey, Unexpected, MessageKeyHash>::iterator it) {
  buffered_bytes_ -= it->second.total;
  g_buffered_bytes -= it->second.total;
  unexpected.erase(it);
}

void Matching::clear() {
  posted.clear();
  g_buffered_bytes -= buffered_bytes_;
  buffered_bytes_ = 0;
  unexpected.clear();
  dropped.clear();
}

void Matching::discard(const MessageKey& key) {
  if (posted.count(key))
    throw std::logic_error(fmt::format("{} transport: discard of a message whose receive is posted", transport_));
  if (auto u = unexpected.find(key); u != unexpected.end()) {
    // A receive may still be attached to it only if it was posted, which is excluded above.
    if (u->second.received == u->second.total) return erase_unexpected(u);
    u->second.discarded = true;  // its remaining bytes land in the buffer they were promised
    return;
  }
  auto [it, fresh] = dropped.try_emplace(key);
  if (fresh) return;  // not arrived yet: thrown away as it comes
  Dropped& d = it->second;
  d.over_limit = false;  // it is claimed: the record goes with its last byte
  if (d.received == d.total) dropped.erase(it);
}

Dropped* Matching::dropping(const MessageKey& key, size_t total) {
  if (dropped.empty() && total <= max_unexpected_) return nullptr;  // the common case, without a lookup
  if (auto it = dropped.find(key); it != dropped.end()) {
    if (it->second.total == Dropped::kUnknown) it->second.total = total;
    return &it->second;
  }
  if (total <= max_unexpected_ || unexpected.count(key)) return nullptr;
  Dropped& d = dropped[key];
  d.total = total;
  d.over_limit = true;
  return &d;
}

void Matching::dropped_bytes(const MessageKey& key, size_t bytes) {
  auto it = dropped.find(key);
  if (it == dropped.end()) return;
  it->second.received += bytes;
  if (it->second.received == it->second.total && !it->second.over_limit) dropped.erase(it);
}

std::string Matching::take_dropped(const Request& r, const std::string& host) {
  if (dropped.empty()) return "";
  auto it = dropped.find(r.key);
  if (it == dropped.end()) return "";
  if (!it->second.over_limit)
    throw std::logic_error(fmt::format("{} transport: a receive posted for a message this rank discarded", transport_));
  std::string why = fmt::format(
      "rank {} ({}) sent a message of {} bytes before its receive was posted, more than the {} bytes this rank "
      "buffers for a receive not posted yet: it was dropped (tag {:#x}, sub {:#x})",
      r.peer, host, it->second.total, max_unexpected_, r.env.tag, r.env.sub);
  it->second.over_limit = false;
  if (it->second.received == it->second.total) dropped.erase(it);
  return why;
}

}  // namespace cohort::transport
