#pragma once
// The TCP rendezvous store: an event-driven server (one epoll thread, no thread per connection)
// and its client. This header is the contract between the store layer and its users (launcher,
// communicator bootstrap, tools); docs/store.md describes the wire protocol.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cohort/error.h"
#include "cohort/store.h"

namespace cohort {

struct StoreServerOptions {
  std::string host;        // address to bind; "" = all interfaces
  uint16_t port = 0;       // 0 = chosen by the OS
  int backlog = 16384;     // listen backlog (the kernel caps it at net.core.somaxconn)
  std::string token;       // job token; when set, clients must pass HMAC-SHA256 challenge-response
  // A connection that has not completed the handshake by then is closed ("said nothing").
  Millis handshake_timeout{std::chrono::seconds(10)};
  // A frame that started arriving but is still incomplete after this long closes the connection
  // (a half-open or stalled peer); a connection idle between frames is fine.
  Millis frame_timeout{std::chrono::seconds(30)};
  uint32_t max_frame = 64u << 20;  // larger length fields close the connection
  // Values served to anyone who asks before authenticating (proto::Op::kNotice), so they must be
  // nothing a stranger could use: a Slurm per-node job's munge credentials, which only the job's
  // user can decode (docs/security.md, "How each mode gets its token").
  std::map<std::string, std::string> notices;
};

class StoreServer {
 public:
  // Binds, listens and starts serving on a background thread. A port in use throws ConfigError
  // naming the port.
  static std::unique_ptr<StoreServer> start(StoreServerOptions options);
  virtual ~StoreServer() = default;
  virtual uint16_t port() const = 0;
  // "host:port" as clients should dial it.
  virtual std::string address() const = 0;
  // Requests executed since the start (handshakes not counted): what a client's calls cost the
  // server, for benchmarks and tests (the rendezvous' load, docs/performance.md).
  virtual uint64_t requests() const = 0;
  // Stops serving and closes every connection (clients then fail with "store ... unreachable").
  virtual void stop() = 0;
};

struct StoreClientOptions {
  std::string host;
  uint16_t port = 0;
  std::string token;                       // empty = no authentication
  Millis timeout{std::chrono::minutes(5)};  // default deadline of every call, and of connecting
  // A waiting call's server-side deadline is its timeout; the client allows this much more for the
  // answer to travel back before it gives up on the server (a cut link is seen this long after).
  Millis reply_grace{2000};
  // When set, the connection is fenced right after the handshake (proto::Op::kFence, docs/store.md
  // "Epochs"): its writes are refused with StaleEpochError once the integer at fence_key exceeds
  // fence_epoch, and connecting throws StaleEpochError when it does already. The key is a full key
  // (no prefix applies).
  std::string fence_key;
  int64_t fence_epoch = 0;
};

// A fenced connection's write that the store refused because its epoch is newer (docs/store.md,
// "Epochs"); the message names both epochs.
class StaleEpochError : public Error {
 public:
  using Error::Error;
};

// Connects (retrying with exponential back-off and jitter until the deadline: a server that is not
// up yet is normal) and authenticates. Throws AuthError when refused, TimeoutError/PeerLostError
// naming "store at host:port unreachable".
std::shared_ptr<Store> connect_tcp_store(const StoreClientOptions& options);

// A store connection whose end the store announces (docs/store.md, "Leases"). Its holder names
// wills: keys the server sets, unless they exist by then, when the connection ends (closed, reset,
// or silent for longer than the lease). A thread sends a small request every lease / 4, so only a
// dead or frozen process, a dead host or a cut link lets the lease run out; `on_lost` is called once
// (on that thread) when this side sees the connection fail. The launcher's elastic agents hold one
// each, so that the others learn within the lease that an agent is gone.
class StoreLease {
 public:
  // Connects with `options` (address, token, connect deadline). Throws like connect_tcp_store.
  static std::unique_ptr<StoreLease> open(const StoreClientOptions& options, Millis lease,
                                          std::function<void(const std::string&)> on_lost = {});
  // An orderly release: the wills are dropped first, so they do not fire.
  virtual ~StoreLease() = default;
  // Ends the lease without a release: the renewals stop and the connection is closed, so a store
  // that still runs sets the wills (at once if the close reaches it, else when the lease runs out).
  // The elastic agents do this when they give up a store they cannot reach. Destroying it then
  // does nothing more.
  virtual void drop() = 0;
  // Replaces the wills (full keys: no prefix applies). Throws when the store cannot be reached.
  virtual void set_wills(const std::vector<std::pair<std::string, std::string>>& wills) = 0;
  // "" while the lease holds; otherwise why it was lost.
  virtual std::string lost() const = 0;
};

// Asks the store at options.host:port for its notice `name` (StoreServerOptions::notices) without
// authenticating, retrying the connection like connect_tcp_store until options.timeout. Returns
// nullopt when the store has no such notice; throws TimeoutError/PeerLostError when it is unreachable.
std::optional<std::string> fetch_store_notice(const StoreClientOptions& options, const std::string& name);

// Connects to "host:port" with the job token from COHORT_JOB_TOKEN (if set) and `timeout`.
std::shared_ptr<Store> connect_tcp_store(const std::string& address, Millis timeout);

// A store shared by the processes of one host through one file (flock-protected); `path` is
// created when missing. Waits poll the file (a few ms apart), so use it for small jobs and tests.
std::shared_ptr<Store> make_file_store(const std::string& path);

}  // namespace cohort
