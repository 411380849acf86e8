#pragma once
// A Store that counts the requests passing through it to another, and apart the looks at an elastic
// rendezvous round: what `cohort bench rendezvous` measures and what the rendezvous' load test checks.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cohort/store.h"

namespace cohort::launch {

// Counts the calls that reach the store through it, and apart the waits for a round's "closed" key:
// one per look at the round (a prefixed get is a wait for its key and a get, so other waits are
// not looks).
class CountingStore : public Store {
 public:
  explicit CountingStore(std::shared_ptr<Store> base) : base_(std::move(base)) { set_timeout(base_->timeout()); }
  void set(const std::string& k, const std::string& v) override { ++calls; base_->set(k, v); }
  std::string get(const std::string& k) override { ++calls; return base_->get(k); }
  int64_t add(const std::string& k, int64_t d) override { ++calls; return base_->add(k, d); }
  std::string compare_set(const std::string& k, const std::string& e, const std::string& d) override {
    ++calls;
    return base_->compare_set(k, e, d);
  }
  bool remove(const std::string& k) override { ++calls; return base_->remove(k); }
  int64_t num_keys() override { ++calls; return base_->num_keys(); }
  bool check(const std::vector<std::string>& keys) override { ++calls; return base_->check(keys); }
  void wait(const std::vector<std::string>& keys, Millis timeout) override {
    ++calls;
    if (keys.size() == 1 && keys[0].ends_with("/closed")) ++looks;
    base_->wait(keys, timeout);
  }
  using Store::wait;
  std::vector<std::string> multi_get(const std::vector<std::string>& keys) override {
    ++calls;
    return base_->multi_get(keys);
  }
  void multi_set(const std::vector<std::string>& keys, const std::vector<std::string>& values) override {
    ++calls;
    base_->multi_set(keys, values);
  }
  std::string auth_token() const override { return base_->auth_token(); }
  std::atomic<uint64_t> calls{0};
  std::atomic<uint64_t> looks{0};

 private:
  std::shared_ptr<Store> base_;
};

}  // namespace cohort::launch
