#pragma once
// Host identity: what makes two processes "on the same host" for shared memory.
// Two ranks may share memory when boot id, network namespace and the /dev/shm device all match.

#include <string>

namespace cohort {

struct HostIdentity {
  std::string hostname;
  std::string boot_id;    // /proc/sys/kernel/random/boot_id
  std::string net_ns;     // inode of /proc/self/ns/net
  std::string shm_dev;    // st_dev of /dev/shm

  // One string that is equal exactly when shared memory can be used between the two.
  std::string shm_key() const { return boot_id + "/" + net_ns + "/" + shm_dev; }
  std::string serialize() const;
  static HostIdentity parse(const std::string& s);
};

// This process's identity. COHORT_HOST_ID, when set, is appended to the key (tests use it to
// simulate several hosts on one machine).
HostIdentity local_host_identity();

// For tests that run ranks as threads of one process: while alive, `id` replaces COHORT_HOST_ID for
// the calling thread only (so ranks-as-threads can simulate several hosts).
class ScopedHostIdOverride {
 public:
  explicit ScopedHostIdOverride(std::string id);
  ~ScopedHostIdOverride();
  ScopedHostIdOverride(const ScopedHostIdOverride&) = delete;
  ScopedHostIdOverride& operator=(const ScopedHostIdOverride&) = delete;

 private:
  std::string previous_;
  bool had_previous_;
};

}  // namespace cohort
