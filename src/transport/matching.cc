#include "transport/matching.h"

#include <algorithm>
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
    unexpected.erase(r.key);
  } else {
    u.attached = int(idx);
  }
}

void Matching::unexpected_arrived(const MessageKey& key, Unexpected& u) {
  if (u.attached < 0) return;  // its receive is not posted yet: irecv() will adopt it
  Request& r = reqs_[size_t(u.attached)];
  if (r.bytes) std::memcpy(r.data, u.buf.get(), r.bytes);
  r.done = true;
  r.remaining = 0;
  unexpected.erase(key);
}

Unexpected& Matching::add_unexpected(const MessageKey& key, const Signature& signature, size_t total) {
  Unexpected& u = unexpected[key];
  u.total = total;
  u.received = 0;
  u.signature = signature;
  u.attached = -1;
  u.buf.allocate(&pool_, total);
  return u;
}

void Matching::clear() {
  posted.clear();
  unexpected.clear();
}

}  // namespace cohort::transport
