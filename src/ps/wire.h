#pragma once
// The parameter server's messages, and the endpoint that moves them.
//
// Every request is a fixed-size RequestHeader message, then (when header.payload > 0) one payload
// message; every request gets a ReplyHeader and (when reply.payload > 0) one payload message. They
// travel over the transports of a communicator made for the PS world (tcp across hosts, shm on one
// host), matched by (peer, tag, sub): the tag says which of the four messages it is, `sub` is the
// request's number in the worker -> server stream. Numbers are per (worker, server) pair and
// consecutive, so the server reads each worker's requests in the order they were sent and
// answers them under the same number; a reply is found by its number, whatever arrives first.
//
// Payloads (all little-endian, ids u64, values f32):
//   hello     -> reply: JSON {"mode", "max_request"}
//   create    name, JSON config          -> -
//   describe  name                       -> reply: JSON config
//   pull      n ids                      -> reply: n rows
//   push      n ids, n rows of gradients -> -
//   push_pull n ids, n gradient rows, m ids (pull) -> reply: m rows
//   clock     (header.clock = the worker's new clock) -> -
//   save      directory path             -> reply: JSON {table: config} of what was written (staged)
//   load      directory path             -> - (staged)
//   commit / discard                     -> - (the worker's staged save or load: done, or undone)
//   stats     name                       -> reply: u64 rows, bytes, applied pushes, of them direct
//   bye       (the worker closes; the server stops when every worker has) -> -
//   attach    name, JSON {"socket": the worker's abstract Unix socket, "pid": the worker's pid} -> reply:
//             JSON {"attached", "why" | "pid", "holder", "first_row", "rows", "config"}; when attached, the
//             server has checked the socket's owner (SO_PEERCRED: that pid, its uid) and sent the shard's three
//             memfds to that socket (SCM_RIGHTS) before replying (table.h: workers on the server's host)
// Every request and reply is checked before use (decode.h): counts, lengths, names, JSON.

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cohort/store.h"
#include "transport/transport.h"

namespace cohort::comm {
class PeerLinks;
}

namespace cohort::ps {

enum class Op : uint8_t {
  kHello, kCreate, kDescribe, kPull, kPush, kPushPull, kClock, kSave, kLoad, kStats, kBye, kAttach, kCommit, kDiscard
};
// op_name, set_table_name and table_name are defined in decode.cc, with the checks the fuzzer runs
// (it builds them without the transports).
const char* op_name(Op op);

inline constexpr uint32_t kRequestMagic = 0x31515350;  // "PSQ1"
inline constexpr uint32_t kReplyMagic = 0x31525350;    // "PSR1"
inline constexpr size_t kMaxTableName = 63;

struct RequestHeader {
  uint32_t magic = kRequestMagic;
  Op op = Op::kHello;
  uint8_t pad[3] = {};
  uint32_t dim = 0;      // the row width the worker built the request for (checked by the server)
  uint32_t pad2 = 0;
  uint64_t clock = 0;    // the worker's clock (steps it has ended) when it sent this
  uint64_t n = 0;        // ids pulled (pull) or pushed (push, push_pull)
  uint64_t m = 0;        // ids pulled after the push (push_pull)
  uint64_t payload = 0;  // bytes of the payload message (0: none follows)
  char table[kMaxTableName + 1] = {};
};
static_assert(sizeof(RequestHeader) == 112);

enum class Status : uint8_t { kOk = 0, kInvalid = 1 };

struct ReplyHeader {
  uint32_t magic = kReplyMagic;
  Status status = Status::kOk;
  uint8_t pad[3] = {};
  uint64_t payload = 0;
  char message[496] = {};  // kInvalid: why, one line
};
static_assert(sizeof(ReplyHeader) == 512);

void set_table_name(RequestHeader& h, const std::string& name);  // throws InvalidArgument (check_table_name)
std::string table_name(const RequestHeader& h);

// A message buffer. Unlike std::vector it never zero-fills: every byte is written by a copy or a
// receive. Buffers of a megabyte come and go with every pull and push; recycling them through a
// BufferPool spares the page faults and clearing of fresh memory, which cost more than the copies.
class Buffer {
 public:
  Buffer() = default;
  uint8_t* data() { return p_.get(); }
  const uint8_t* data() const { return p_.get(); }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  size_t capacity() const { return cap_; }
  uint8_t* begin() { return p_.get(); }
  uint8_t* end() { return p_.get() + size_; }
  const uint8_t* begin() const { return p_.get(); }
  const uint8_t* end() const { return p_.get() + size_; }
  // The contents are not kept when it grows.
  void resize(size_t n) {
    if (n > cap_) {
      p_.reset(new uint8_t[n]);
      cap_ = n;
    }
    size_ = n;
  }

 private:
  std::unique_ptr<uint8_t[]> p_;
  size_t size_ = 0, cap_ = 0;
};

// Not transport/matching.h's BufferPool, which bins raw memory by power-of-two size class under a
// byte limit for any number of early messages: a PS endpoint has a few buffers in flight, kept whole
// (with their size) and handed back best-fit, so the two policies stay apart.
class BufferPool {
 public:
  // A buffer of n bytes: the smallest kept one that is large enough, else a new one.
  Buffer take(size_t n);
  void give(Buffer b);

 private:
  static constexpr size_t kKeep = 16;
  std::vector<Buffer> kept_;
};
Buffer buffer_of(const std::string& text);

// Message kinds within the PS tag space.
enum class Msg : uint64_t { kRequest = 1, kRequestPayload = 2, kReply = 3, kReplyPayload = 4 };

// One posted send or receive.
struct Posted {
  transport::Transport* t = nullptr;
  transport::RequestId id = 0;
  bool done = false;
  explicit operator bool() const { return t != nullptr; }
};

// The PS world's connections: one communicator's transports, driven directly by the one thread that
// holds the owner's lock (server loop or client mutex).
class Endpoint {
 public:
  // Collective over the PS world: publishes under `prefix` of `store`, waits for every rank (bounded
  // by `timeout`), connects.
  // Only `peers` (true for each rank to connect to) are connected: workers to servers. A message
  // over `max_unexpected_bytes` that arrives before its receive is thrown away, not buffered
  // (TransportOptions::max_unexpected_bytes): a server passes its request limit.
  Endpoint(std::shared_ptr<Store> store, const std::string& prefix, int rank, const std::vector<bool>& peers,
           std::chrono::milliseconds timeout, size_t max_unexpected_bytes = SIZE_MAX);
  ~Endpoint();

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::string host_of(int rank) const;
  // Whether `rank` is reached through shared memory, i.e. runs on this host.
  bool same_host(int rank) const;

  Posted isend(int peer, Msg kind, uint64_t sub, const void* data, size_t bytes);
  Posted irecv(int peer, Msg kind, uint64_t sub, void* data, size_t bytes);
  // The message will not be received (Transport::discard): what came of it is freed, the rest is
  // thrown away as it comes.
  void discard(int peer, Msg kind, uint64_t sub);
  // Bytes held in messages that arrived before their receive, over every transport.
  size_t buffered_bytes() const;
  // True once complete (then stays true); rethrows the transport's error.
  bool test(Posted& p);
  // Drives every transport; waits up to timeout_ms when nothing is ready. True on progress.
  bool poll(int timeout_ms);

 private:
  std::unique_ptr<comm::PeerLinks> links_;  // comm/peer_links.h
  std::vector<transport::Transport*> active_;  // the transports that serve at least one peer
  transport::Transport* sleeper_ = nullptr;     // the one that serves most peers: poll sleeps in it
  int rank_ = 0;
  int size_ = 0;
};

// The transports name peers "rank N (host)" in PS-world ranks; this names their roles instead:
// "parameter server N (host)" / "worker N (host)".
std::string name_roles(const std::string& text, int num_servers);

}  // namespace cohort::ps
