#pragma once
// The rendezvous key-value store every cohort job meets at.
//
// Values are byte strings (std::string is used as a byte container). Every call that can wait
// has a deadline: the store's default timeout() unless a call takes its own. A wait that passes
// its deadline throws TimeoutError naming the keys that never came; a lost server throws
// PeerLostError naming "store at host:port".
//
// Implementations (src/store): TcpStore (client of `cohort store serve` / the launcher's store,
// connect_tcp_store in store/tcp_store.h), MemoryStore (one process, many threads; make_memory_store in
// store/memory_store.h) and FileStore (one file shared by processes on one host; make_file_store).
// The interface itself, with the barrier and make_prefix_store, belongs to src/common (common/store.cc):
// the layers below the store's own meet through it too.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace cohort {

using Millis = std::chrono::milliseconds;

class Store {
 public:
  virtual ~Store() = default;

  virtual void set(const std::string& key, const std::string& value) = 0;
  // Waits until `key` exists (or the timeout passes) and returns its value.
  virtual std::string get(const std::string& key) = 0;
  // Atomically adds `delta` to the integer stored at `key` (missing = 0), returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Sets `key` to `desired` if its current value equals `expected` (a missing key matches an empty
  // `expected`). Returns the value after the call.
  virtual std::string compare_set(const std::string& key, const std::string& expected,
                                  const std::string& desired) = 0;
  // Returns whether the key existed.
  virtual bool remove(const std::string& key) = 0;
  virtual int64_t num_keys() = 0;
  // True when every key exists; does not wait.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Waits until all keys exist.
  virtual void wait(const std::vector<std::string>& keys, Millis timeout) = 0;
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }
  virtual std::vector<std::string> multi_get(const std::vector<std::string>& keys) = 0;
  virtual void multi_set(const std::vector<std::string>& keys,
                         const std::vector<std::string>& values) = 0;

  // Barrier of `world` participants named `name`, costing O(world) messages in total: each
  // participant adds 1 to a counter; the last one sets a release key the others wait for.
  // On timeout the error names how many (and, when ranks publish "<name>/rank/<r>", which) ranks
  // never arrived.
  virtual void barrier(const std::string& name, int rank, int world, Millis timeout);

  // The secret this store's connections prove (the job token; store/auth.h), or empty when they prove
  // none. A communicator built on the store makes its own TCP connections prove the same secret, so
  // that whoever may not read the store cannot join the data plane either.
  virtual std::string auth_token() const { return {}; }

  Millis timeout() const { return timeout_; }
  void set_timeout(Millis t) { timeout_ = t; }

 protected:
  Millis timeout_{std::chrono::minutes(5)};
};

// Prefixes every key with "<prefix>/" so that jobs, communicators or launch attempts sharing one
// store never see each other's keys.
std::shared_ptr<Store> make_prefix_store(std::shared_ptr<Store> base, std::string prefix);

}  // namespace cohort
