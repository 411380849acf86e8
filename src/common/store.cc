// Parts of the Store interface shared by every implementation: the O(n) barrier and key prefixing.
// The interface (include/cohort/store.h) lives in common, not in src/store, because layers below the
// store's own (transport/shm, collectives/shm) meet through it too; src/store holds its implementations.
#include <fmt/core.h>

#include "cohort/error.h"
#include "cohort/store.h"
#include "common/strings.h"

namespace cohort {

void Store::barrier(const std::string& name, int rank, int world, Millis timeout) {
  // Each participant: one add and one wait -> O(world) messages in all. The arrival keys let a
  // timed-out waiter name the ranks that never came (one multi-key check, only on the error path).
  set(name + "/rank/" + std::to_string(rank), "1");
  int64_t arrived = add(name + "/count", 1);
  if (arrived == world) set(name + "/done", "1");
  try {
    wait({name + "/done"}, timeout);
  } catch (const TimeoutError&) {
    std::vector<int> missing;
    for (int r = 0; r < world; ++r) {
      if (!check({name + "/rank/" + std::to_string(r)})) missing.push_back(r);
    }
    throw TimeoutError(fmt::format("barrier '{}' timed out after {} ms: {} of {} ranks arrived; missing rank(s) {}",
                                   name, timeout.count(), world - static_cast<int>(missing.size()), world,
                                   str::format_ranges(missing)));
  }
}

namespace {

class PrefixStore : public Store {
 public:
  PrefixStore(std::shared_ptr<Store> base, std::string prefix) : base_(std::move(base)), prefix_(std::move(prefix) + "/") {
    timeout_ = base_->timeout();
  }
  void set(const std::string& k, const std::string& v) override { base_->set(p(k), v); }
  // The base store's default timeout belongs to whoever owns it, so this store's own timeout is
  // applied with an explicit wait first.
  std::string get(const std::string& k) override {
    base_->wait({p(k)}, timeout_);
    return base_->get(p(k));
  }
  int64_t add(const std::string& k, int64_t d) override { return base_->add(p(k), d); }
  std::string compare_set(const std::string& k, const std::string& e, const std::string& d) override {
    return base_->compare_set(p(k), e, d);
  }
  bool remove(const std::string& k) override { return base_->remove(p(k)); }
  int64_t num_keys() override { return base_->num_keys(); }
  bool check(const std::vector<std::string>& keys) override { return base_->check(ps(keys)); }
  void wait(const std::vector<std::string>& keys, Millis t) override { base_->wait(ps(keys), t); }
  using Store::wait;
  std::vector<std::string> multi_get(const std::vector<std::string>& keys) override {
    base_->wait(ps(keys), timeout_);
    return base_->multi_get(ps(keys));
  }
  void multi_set(const std::vector<std::string>& keys, const std::vector<std::string>& values) override {
    base_->multi_set(ps(keys), values);
  }
  std::string auth_token() const override { return base_->auth_token(); }

 private:
  std::string p(const std::string& k) const { return prefix_ + k; }
  std::vector<std::string> ps(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const auto& k : keys) out.push_back(p(k));
    return out;
  }
  std::shared_ptr<Store> base_;
  std::string prefix_;
};

}  // namespace

std::shared_ptr<Store> make_prefix_store(std::shared_ptr<Store> base, std::string prefix) {
  return std::make_shared<PrefixStore>(std::move(base), std::move(prefix));
}

}  // namespace cohort
