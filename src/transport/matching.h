#pragma once
// Request bookkeeping and message matching, shared by the point-to-point transports (tcp/, shm/).
//
// Both transports move bytes differently (sockets vs. shared-memory rings) but agree on what a
// request is and how a message finds its receive: by (peer, tag, sub) exactly (transport.h). A
// receive posted first waits in `posted` until its message arrives; a message that arrives first
// is buffered whole in `unexpected` until its receive is posted. A message the receiver will never
// take (discard()), or one too large to buffer, is read and thrown away as it arrives (`dropped`).
// Request ids carry a generation so that a stale id (one already completed and reused) is caught
// instead of completing someone else's request.
//
// Not thread-safe: it belongs to its transport, which is driven by one thread at a time.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/transport.h"

namespace cohort::transport {

// The job scope handshakes compare, hashed (FNV-1a) to a fixed-size field.
uint64_t scope_hash(const std::string& job_scope);

struct MessageKey {
  int peer;
  uint64_t tag;
  uint64_t sub;
  bool operator==(const MessageKey&) const = default;
};
struct MessageKeyHash {
  size_t operator()(const MessageKey& k) const {
    uint64_t h = k.tag * 0x9e3779b97f4a7c15ull ^ (k.sub + 0x632be59bd9b4e019ull + (uint64_t(k.peer) << 40));
    return static_cast<size_t>(h ^ (h >> 29));
  }
};

struct Request {
  uint32_t gen = 0;  // bumped on every reuse of the slot; the upper half of its RequestId
  bool in_use = false;
  bool done = false;
  bool is_send = false;
  int peer = -1;
  char* data = nullptr;
  size_t bytes = 0;
  size_t remaining = 0;  // tcp: receive bytes still to arrive, or send fragments still to write
  MessageKey key{};
  Envelope env;
  std::exception_ptr error;
};

// Buffers for early ("unexpected") messages, reused by size class: a pipelined ring can have many
// chunks in flight ahead of the receiver's posted window, and a fresh multi-page allocation per
// chunk costs more in page faults than the copy itself. At most `limit` bytes are kept for reuse.
class BufferPool {
 public:
  explicit BufferPool(size_t limit) : limit_(limit) {}
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;
  ~BufferPool();
  char* take(size_t n, size_t& cap);
  void give(char* p, size_t cap);

 private:
  std::vector<char*> free_[64];
  size_t pooled_ = 0;
  size_t limit_;
};

class PooledBuffer {
 public:
  PooledBuffer() = default;
  PooledBuffer(const PooledBuffer&) = delete;
  PooledBuffer& operator=(const PooledBuffer&) = delete;
  ~PooledBuffer() { reset(); }
  void reset();
  void allocate(BufferPool* pool, size_t n);
  char* get() const { return p_; }

 private:
  BufferPool* pool_ = nullptr;
  char* p_ = nullptr;
  size_t cap_ = 0;
};

// A message that arrived before its receive was posted, buffered whole.
struct Unexpected {
  PooledBuffer buf;
  size_t total = 0;
  size_t received = 0;
  Signature signature;
  int attached = -1;  // the request waiting for the rest of it, once posted
  bool discarded = false;  // discard()ed while it arrived: dropped as soon as it is whole
};

// A message whose bytes are thrown away as they arrive instead of being buffered: the receiver
// discarded it before it came, or it came with no receive posted and is larger than the transport
// buffers (Matching's `max_unexpected`).
struct Dropped {
  size_t total = kUnknown;  // its size, once its first bytes arrived
  size_t received = 0;      // bytes thrown away so far
  // Dropped for its size, and nobody on this rank has asked for it yet: the record outlives the
  // message, so that a receive posted for it fails (instead of waiting for what is gone) and a
  // discard() of it finds it. Otherwise the record goes when the last byte is thrown away.
  bool over_limit = false;
  static constexpr size_t kUnknown = std::numeric_limits<size_t>::max();
};

// Bytes that every transport of this process holds in messages that arrived before their receive
// (the sum of Matching::buffered_bytes): what a peer's unanswered messages cost this process.
uint64_t buffered_bytes_in_process();

class Matching {
 public:
  // `transport` names the owner in logic errors; `pool_limit` bounds the reuse pool; a message
  // larger than `max_unexpected` that arrives before its receive is dropped, not buffered.
  Matching(const char* transport, size_t pool_limit, size_t max_unexpected = SIZE_MAX)
      : transport_(transport), pool_(pool_limit), max_unexpected_(max_unexpected) {}
  ~Matching() { clear(); }
  Matching(const Matching&) = delete;
  Matching& operator=(const Matching&) = delete;

  // A fresh request in a free slot (its generation bumped). The reference stays valid until the
  // next alloc().
  uint32_t alloc(bool is_send, int peer, char* data, size_t bytes, const Envelope& env);
  Request& operator[](size_t idx) { return reqs_[idx]; }
  RequestId id(uint32_t idx) const { return (uint64_t(reqs_[idx].gen) << 32) | idx; }

  // Transport::test: true once the request is done (its slot is then released), rethrowing its
  // error; rethrows `failed` (the transport's sticky error) for a request that cannot finish now.
  bool test(RequestId id, const std::exception_ptr& failed);
  // Transport::peek.
  bool peek(RequestId id) const;
  // Frees a slot; a receive still pending is withdrawn from `posted` and from its unexpected message.
  void release(uint32_t idx);

  // Registers a receive that found no early message. Throws InvalidArgument if another receive for
  // the same message is already posted.
  void post(uint32_t idx);
  // The mismatch between a message (`theirs`, `total` bytes) and the receive `r`, as one line, or ""
  // when they agree. `host` names the sender.
  static std::string mismatch(int peer, const std::string& host, const Signature& theirs, size_t total,
                              const Request& r, const MismatchFormatter& formatter);
  // A receive just allocated: the early message it matches, or nullptr.
  Unexpected* find_unexpected(const Request& r);
  // Hands an early message to receive `idx` (after the caller checked that they match): copied
  // into the user's buffer and dropped when it is whole, else the receive waits on it.
  void adopt(uint32_t idx, Unexpected& u);
  // The last byte of the unexpected message under `key` arrived: if a receive waits on it, copy it
  // there, complete the receive and drop the message.
  void unexpected_arrived(const MessageKey& key, Unexpected& u);
  // A message sent to oneself: completes the posted receive or becomes an unexpected message.
  // `check(receive)` verifies a posted receive matches and throws (having failed the transport) if not.
  template <class Check>
  void deliver_local(const Request& send, Check check) {
    auto it = posted.find(send.key);
    if (it != posted.end()) {
      Request& r = reqs_[it->second];
      check(r);
      if (send.bytes) std::memcpy(r.data, send.data, send.bytes);
      r.done = true;
      r.remaining = 0;
      posted.erase(it);
      return;
    }
    Unexpected& u = add_unexpected(send.key, send.env.signature, send.bytes);
    if (send.bytes) std::memcpy(u.buf.get(), send.data, send.bytes);
    u.received = send.bytes;
  }
  // A new (empty) unexpected message of `total` bytes under `key`.
  Unexpected& add_unexpected(const MessageKey& key, const Signature& signature, size_t total);
  // After a failure: nothing is posted or buffered any more.
  void clear();

  // Transport::discard: the message under `key` is not wanted. Buffered whole, it is freed now;
  // still arriving, once whole; not arrived yet (or dropped for its size), its bytes are thrown
  // away as they come. Throws std::logic_error when a receive is posted for it.
  void discard(const MessageKey& key);
  // Bytes of a message under `key` (of `total` bytes) arrive with no receive posted: the record to
  // throw them into, or nullptr to buffer them (add_unexpected, or the message already buffered).
  // A message not seen before that is larger than `max_unexpected` gets an over-limit record.
  Dropped* dropping(const MessageKey& key, size_t total);
  // `bytes` more of the message under `key` were thrown away (dropping() gave its record).
  void dropped_bytes(const MessageKey& key, size_t bytes);
  // A receive just allocated whose message was dropped for its size: why it cannot complete (and
  // the record is let go), or "" when none was. `host` names the sender.
  std::string take_dropped(const Request& r, const std::string& host);
  // Bytes held in unexpected messages (allocated in full when their first bytes arrive).
  size_t buffered_bytes() const { return buffered_bytes_; }

 private:
  void erase_unexpected(std::unordered_map<MessageKey, Unexpected, MessageKeyHash>::iterator it);

  const char* transport_;
  BufferPool pool_;  // before `unexpected`: its buffers go back to the pool when they are destroyed
  std::vector<Request> reqs_;
  std::vector<uint32_t> free_;
  size_t max_unexpected_;
  size_t buffered_bytes_ = 0;

 public:
  std::unordered_map<MessageKey, uint32_t, MessageKeyHash> posted;        // receives waiting for their message
  std::unordered_map<MessageKey, Unexpected, MessageKeyHash> unexpected;  // messages waiting for their receive
  std::unordered_map<MessageKey, Dropped, MessageKeyHash> dropped;        // messages thrown away as they arrive
};

}  // namespace cohort::transport
