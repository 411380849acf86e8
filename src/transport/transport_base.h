#pragma once
// TransportBase: what a point-to-point transport does the same whatever moves its bytes (tcp/ over
// sockets, shm/ over shared-memory rings): rank and size, the request table and its matching
// (matching.h), the first error, the mismatch check, and the preambles of isend and irecv (peer
// check, a failed transport rethrowing its error, a message to oneself delivered at once, a receive
// whose message came first). Each transport derives from it and adds the moving of bytes.
//
// Everything here runs on the thread driving the transport (docs/thread_model.md); the preambles are
// inline because they are on every message's path.

#include <fmt/core.h>

#include <exception>
#include <string>
#include <vector>

#include "cohort/error.h"
#include "transport/matching.h"
#include "transport/transport.h"

namespace cohort::transport {

// A message (or a fragment of one) queued for sending on a connection or ring: the transport's own
// wire header, then `length` payload bytes; `written` counts both.
template <typename Header>
struct PendingSend {
  Header header;
  const char* payload;
  size_t length;
  size_t written;
  uint32_t request;
};

class TransportBase : public Transport {
 public:
  bool test(RequestId id) override { return m_.test(id, failed_); }
  bool peek(RequestId id) const override { return m_.peek(id); }
  bool arrived(int peer, const Envelope& env) const override {
    return m_.unexpected.count(MessageKey{peer, env.tag, env.sub}) != 0;
  }
  void discard(int peer, const Envelope& env) override {
    check_peer(peer);
    m_.discard(MessageKey{peer, env.tag, env.sub});
  }
  size_t buffered_bytes() const override { return m_.buffered_bytes(); }
  std::exception_ptr error() const override { return failed_; }
  PeerProgress last_seen(int peer) const override { return last_seen_.at(size_t(peer)); }
  void set_mismatch_formatter(MismatchFormatter f) override { mismatch_formatter_ = std::move(f); }

 protected:
  TransportBase(int rank, int size, const char* name, size_t unexpected_pool_bytes, size_t max_unexpected_bytes)
      : rank_(rank), size_(size), m_(name, unexpected_pool_bytes, max_unexpected_bytes),
        last_seen_(static_cast<size_t>(size)) {}

  // Host name of `peer`, for messages.
  virtual std::string peer_host(int peer) const = 0;

  void check_peer(int peer) const {
    if (peer < 0 || peer >= size_) throw InvalidArgument(fmt::format("peer rank {} out of range [0, {})", peer, size_));
  }

  // isend's preamble: the request's slot; `done` when it went to this rank (delivered at once).
  uint32_t start_send(int peer, const Envelope& env, const void* data, size_t bytes, bool& done) {
    check_peer(peer);
    if (failed_) std::rethrow_exception(failed_);
    uint32_t idx = m_.alloc(true, peer, const_cast<char*>(static_cast<const char*>(data)), bytes, env);
    done = peer == rank_;
    if (done) {
      Request& r = m_[idx];
      deliver_local(r);
      r.done = true;
    }
    return idx;
  }

  // irecv's preamble: the request's slot; `matched` when a message that arrived first was adopted.
  uint32_t start_recv(int peer, const Envelope& env, void* data, size_t bytes, bool& matched) {
    check_peer(peer);
    if (failed_) std::rethrow_exception(failed_);
    uint32_t idx = m_.alloc(false, peer, static_cast<char*>(data), bytes, env);
    Request& r = m_[idx];
    r.remaining = bytes;
    matched = false;
    if (Unexpected* u = m_.find_unexpected(r)) {
      check_match(peer, u->signature, u->total, r);
      m_.adopt(idx, *u);
      matched = true;
    } else if (!m_.dropped.empty()) {
      // Its message came first and was too large to keep: this receive fails, the transport serves on.
      if (std::string why = m_.take_dropped(r, peer_host(peer)); !why.empty()) {
        r.error = std::make_exception_ptr(InvalidArgument(why));
        r.done = true;
        matched = true;
      }
    }
    return idx;
  }

  // Fails the transport (and throws) when a message does not match its receive.
  void check_match(int peer, const Signature& theirs, size_t total, const Request& r) {
    std::string msg = Matching::mismatch(peer, peer_host(peer), theirs, total, r, mismatch_formatter_);
    if (msg.empty()) return;
    fail(std::make_exception_ptr(MismatchError(msg)));
    std::rethrow_exception(failed_);
  }

  void deliver_local(const Request& s) {
    m_.deliver_local(s, [&](const Request& r) { check_match(rank_, s.env.signature, s.bytes, r); });
  }

  // A message from `peer` began to arrive (what slow-rank warnings report as its last progress).
  void note_arrival(int peer, uint64_t tag, const Signature& signature, uint64_t total) {
    PeerProgress& p = last_seen_[size_t(peer)];
    p.seen = true;
    p.tag = tag;
    p.signature = signature;
    p.bytes = total;
  }

  // `peer` destroyed its communicator: fail the transport naming it, and throw.
  [[noreturn]] void fail_peer_left(int peer, const char* what) {
    fail(std::make_exception_ptr(PeerLostError(
        fmt::format("rank {} ({}) left (destroyed its communicator); cannot {} it", peer, peer_host(peer), what))));
    std::rethrow_exception(failed_);
  }

  int rank_;
  int size_;
  Matching m_;  // requests, posted receives, early messages
  std::exception_ptr failed_;
  MismatchFormatter mismatch_formatter_;
  std::vector<PeerProgress> last_seen_;  // per peer
};

}  // namespace cohort::transport
