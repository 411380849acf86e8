#pragma once
// MemoryStore: the Store interface inside one process (ranks as threads in tests, single-process
// programs). Same semantics and error messages as the TCP store.

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>

#include "cohort/store.h"

namespace cohort {

class MemoryStore : public Store {
 public:
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override;
  bool remove(const std::string& key) override;
  int64_t num_keys() override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  using Store::wait;
  std::vector<std::string> multi_get(const std::vector<std::string>& keys) override;
  void multi_set(const std::vector<std::string>& keys, const std::vector<std::string>& values) override;

 private:
  void wait_locked(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys, Millis timeout);
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::string> data_;
};

std::shared_ptr<Store> make_memory_store();

// Message for a wait that timed out: names the missing keys (all of them up to a limit) and, for
// keys of the form ".../rank/<r>" or ending in a number, the ranks they belong to.
std::string missing_keys_message(const std::vector<std::string>& missing, Millis waited);

}  // namespace cohort
