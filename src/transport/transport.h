#pragma once
// The point-to-point interface every transport implements (TCP today; shared memory, RDMA later).
//
// A message is a byte range sent to one peer under an Envelope: a 64-bit `tag` (the communicator
// scopes it: communicator id + collective sequence number, or the user's point-to-point tag) and a
// 64-bit `sub` (stream slot + index of the message in that stream). Send and receive match on
// (peer, tag, sub) exactly, so messages of different collectives or communicators never mix and
// arrival order across connections does not matter. The receiver names the exact size; the
// envelope's `signature` (what collective the sender thinks it is in) is compared on arrival, and a
// difference completes the receive with a MismatchError.
//
// Threading: a transport is driven by one thread at a time (the communicator's drive lock, see
// docs/thread_model.md). Nothing here blocks except poll(), and poll() is bounded by its timeout.
//
// Errors: the first fatal error (peer lost, mismatch) sticks: every pending and later request
// fails with it. test() rethrows a request's error.

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/deadline.h"

namespace cohort::transport {

// What collective a message belongs to, as its sender sees it (compared by the receiver).
struct Signature {
  uint8_t op = 0;      // comm's op kind (allreduce, broadcast, ..., p2p)
  uint8_t dtype = 0;
  uint8_t redop = 0;
  uint8_t flags = 0;
  uint32_t root = 0;
  uint64_t count = 0;  // element count the op was called with (0 where ranks may differ)
  bool operator==(const Signature&) const = default;
};

struct Envelope {
  uint64_t tag = 0;
  uint64_t sub = 0;
  Signature signature;
};

using RequestId = uint64_t;

// Formats a mismatch found on arrival: (peer, peer's signature, ours, envelope) -> one line.
using MismatchFormatter =
    std::function<std::string(int peer, const Signature& theirs, const Signature& ours, const Envelope& env)>;

// Who the peers are (for error messages) and how to reach them.
struct PeerInfo {
  std::string host;        // host name, for messages
  std::string descriptor;  // what the peer's transport published
  int pid = 0;             // its process, as it published it (0: unknown); same-host handoffs check it
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // What this rank publishes so that peers can reach it (endpoints; shm: host identity).
  virtual std::string descriptor() const = 0;
  // Whether this transport can reach a peer that published `peer_descriptor`.
  virtual bool can_reach(const std::string& peer_descriptor) const = 0;
  // Opens channels to the listed peers (collective among them). peers[r] for every rank;
  // `use[r]` says whether this transport serves rank r. Throws TimeoutError/PeerLostError naming
  // the peers that could not be reached by the deadline.
  virtual void connect(const std::vector<PeerInfo>& peers, const std::vector<bool>& use, Deadline deadline) = 0;

  // Posts a send/receive. The buffer must stay valid (and, for sends, unchanged) until test()
  // returns true. Sending to oneself is allowed.
  virtual RequestId isend(int peer, const Envelope& env, const void* data, size_t bytes) = 0;
  virtual RequestId irecv(int peer, const Envelope& env, void* data, size_t bytes) = 0;
  // True when the request completed (the id is then released); rethrows its error. Never blocks.
  virtual bool test(RequestId id) = 0;
  // Whether a request has completed, without releasing it (for "waiting for rank N" messages).
  virtual bool peek(RequestId id) const = 0;
  // Whether a message under `env` from `peer` has begun to arrive with no receive posted for it yet
  // (it waits, buffered, for its irecv). A receive from any source asks this of every peer's next
  // message before it posts the one receive that takes it.
  virtual bool arrived(int peer, const Envelope& env) const = 0;
  // The message under `env` from `peer` will never be received here: what of it arrived is freed,
  // and what is still to come is read and thrown away, never buffered. No receive may be posted for
  // it. (The parameter server refuses an over-limit request without reading its payload.)
  virtual void discard(int peer, const Envelope& env) = 0;
  // Bytes this transport holds in messages that arrived before their receive was posted.
  virtual size_t buffered_bytes() const = 0;

  // Drives I/O: handles whatever is ready, waiting up to timeout_ms (0 = do not wait) for
  // something to happen. Returns true when any progress was made.
  virtual bool poll(int timeout_ms) = 0;

  // Fails every pending and future request with `error` (first error sticks).
  virtual void fail(std::exception_ptr error) = 0;
  // Best effort: tells every connected peer why this rank failed, so that they fail at once with
  // that cause ("rank 1 (host) failed: ...") instead of a bare "connection closed". Peers that sent
  // this rank their own notice are skipped (the cause came from them); everyone else hears it, also
  // when the cause came in a notice, so that no peer is left to see only this rank's connections
  // close. The peers rethrow it as the same class (see ErrorClass).
  enum class ErrorClass : uint8_t { kOther = 0, kTimeout = 1, kPeerLost = 2, kMismatch = 3 };
  virtual void notify_peers(ErrorClass cls, const std::string& message) = 0;
  virtual std::exception_ptr error() const = 0;
  virtual void set_mismatch_formatter(MismatchFormatter f) = 0;

  // Latest (tag, signature) each peer has been seen sending, for "rank N last seen in op #M".
  struct PeerProgress {
    bool seen = false;
    uint64_t tag = 0;
    Signature signature;
    uint64_t bytes = 0;
  };
  virtual PeerProgress last_seen(int peer) const = 0;
};

// Factories by name ("tcp", "shm"), tried by priority (highest first) for each peer: the first
// transport whose can_reach() accepts the peer's descriptor serves it. A transport registers itself
// from its own .cc file (static Registration), so new transports plug in without touching comm.
struct TransportOptions {
  int rank = 0;
  int size = 1;
  std::string job_scope;    // unique per communicator (handshakes check it)
  Deadline deadline = Deadline::never();
  // connect() says who it still waits for after this long, then again at a doubling interval
  // (COHORT_SLOW_WARNING, as the communicator's other waits).
  std::chrono::nanoseconds slow_warning = std::chrono::seconds(5);
  // A message larger than this that arrives before its receive is read and thrown away instead of
  // being buffered (a buffer is allocated in full when a message's first bytes arrive); a receive
  // posted for it later fails, naming the sender and the size. For a communicator whose peers may
  // not be trusted to send only what is asked for (the parameter server's).
  size_t max_unexpected_bytes = SIZE_MAX;
  // The job token: TCP connections prove it to each other (HMAC challenge-response, tcp/hello.h).
  // Empty: the hello still runs, keyed with the empty string, and proves only the scope.
  std::string token;
};
using Factory = std::function<std::unique_ptr<Transport>(const TransportOptions&)>;
struct FactoryInfo {
  std::string name;
  int priority = 0;
  Factory make;
};
void register_factory(FactoryInfo info);
std::vector<FactoryInfo> factories();  // sorted by priority, highest first

}  // namespace cohort::transport
