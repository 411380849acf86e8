// cohort_torch_store.h: cohort::Store on top of torch's c10d::Store.

#include "cohort_torch_store.h"

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cohort/error.h"

namespace cohort_torch {

// As cohort_torch_common.h has it (this file compiles with torch's Store header only).
using Millis = std::chrono::milliseconds;

namespace {

class C10dStoreAdapter : public cohort::Store {
 public:
  explicit C10dStoreAdapter(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}

  void set(const std::string& key, const std::string& value) override {
    guarded("set", key, [&] { store_->set(key, to_bytes(value)); });
  }

  std::string get(const std::string& key) override {
    // Wait with cohort's own deadline first, so the timeout is the one cohort was given and the
    // error names the key; c10d's get would use the store's timeout.
    wait({key}, timeout());
    std::string out;
    guarded("get", key, [&] { out = to_string(store_->get(key)); });
    return out;
  }

  int64_t add(const std::string& key, int64_t delta) override {
    int64_t out = 0;
    guarded("add", key, [&] { out = store_->add(key, delta); });
    return out;
  }

  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override {
    if (!compare_set_unsupported_.load()) {
      try {
        return to_string(store_->compareSet(key, to_bytes(expected), to_bytes(desired)));
      } catch (const c10::Error& e) {
        // c10d::Store's default compareSet is "Not implemented" (HashStore in torch 1.x);
        // fall back to a lock built from add().
        if (std::string(e.what()).find("Not implemented") == std::string::npos) {
          rethrow_as_cohort("compare_set", key, e);
        }
        compare_set_unsupported_ = true;
      } catch (const std::exception& e) {
        rethrow_as_cohort("compare_set", key, e);
      }
    }
    return compare_set_with_lock(key, expected, desired);
  }

  bool remove(const std::string& key) override {
    bool out = false;
    guarded("remove", key, [&] { out = store_->deleteKey(key); });
    return out;
  }

  int64_t num_keys() override {
    int64_t out = 0;
    guarded("num_keys", "", [&] { out = store_->getNumKeys(); });
    return out;
  }

  bool check(const std::vector<std::string>& keys) override {
    bool out = false;
    guarded("check", join(keys), [&] { out = store_->check(keys); });
    return out;
  }

  void wait(const std::vector<std::string>& keys, Millis timeout) override {
    guarded("wait", join(keys), [&] { store_->wait(keys, timeout); });
  }

  std::vector<std::string> multi_get(const std::vector<std::string>& keys) override {
    // c10d::Store in torch 1.x has no multiGet: one wait for all keys, then one get each.
    wait(keys, timeout());
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const auto& key : keys) {
      guarded("get", key, [&] { out.push_back(to_string(store_->get(key))); });
    }
    return out;
  }

  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::string>& values) override {
    if (keys.size() != values.size()) {
      throw cohort::InvalidArgument(fmt::format("store multi_set: {} keys but {} values",
                                                keys.size(), values.size()));
    }
    for (size_t i = 0; i < keys.size(); ++i) set(keys[i], values[i]);
  }

 private:
  static std::vector<uint8_t> to_bytes(const std::string& s) {
    return std::vector<uint8_t>(s.begin(), s.end());
  }
  static std::string to_string(const std::vector<uint8_t>& v) {
    return std::string(v.begin(), v.end());
  }
  static std::string join(const std::vector<std::string>& keys) {
    std::string out;
    for (const auto& k : keys) {
      if (!out.empty()) out += ", ";
      out += k;
    }
    return out;
  }

  // torch throws c10::Error (or c10::DistStoreError) with "Timeout" in the message when a wait
  // expires, and a socket error when the store server is gone; map them to cohort's hierarchy.
  [[noreturn]] static void rethrow_as_cohort(const char* op, const std::string& key,
                                             const std::exception& e) {
    std::string what = e.what();
    // c10::Error::what() carries a C++ backtrace after the first line; keep the message only.
    if (auto nl = what.find('\n'); nl != std::string::npos) what.resize(nl);
    std::string msg = fmt::format("torch store {} '{}' failed: {}", op, key, what);
    if (what.find("imeout") != std::string::npos || what.find("timed out") != std::string::npos) {
      throw cohort::TimeoutError(msg);
    }
    throw cohort::PeerLostError(msg);
  }

  // Runs one c10d call, translating torch's exceptions into cohort's.
  template <typename Fn>
  static void guarded(const char* op, const std::string& key, Fn&& fn) {
    try {
      fn();
    } catch (const cohort::Error&) {
      throw;
    } catch (const std::exception& e) {
      rethrow_as_cohort(op, key, e);
    }
  }

  // compare_set for stores without compareSet: a spin lock on "<key>/cohort_cas_lock" built from
  // add() (the first to reach 1 owns it), bounded by the store timeout.
  std::string compare_set_with_lock(const std::string& key, const std::string& expected,
                                    const std::string& desired) {
    const std::string lock = key + "/cohort_cas_lock";
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    while (add(lock, 1) != 1) {
      add(lock, -1);
      if (std::chrono::steady_clock::now() > deadline) {
        throw cohort::TimeoutError(fmt::format(
            "torch store compare_set '{}': lock '{}' not acquired within {} ms", key, lock,
            timeout().count()));
      }
      std::this_thread::sleep_for(Millis(1));
    }
    std::string current;
    try {
      bool exists = check({key});
      if (exists) guarded("get", key, [&] { current = to_string(store_->get(key)); });
      if ((!exists && expected.empty()) || (exists && current == expected)) {
        set(key, desired);
        current = desired;
      }
    } catch (...) {
      add(lock, -1);
      throw;
    }
    add(lock, -1);
    return current;
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::atomic<bool> compare_set_unsupported_{false};
};

}  // namespace

std::shared_ptr<cohort::Store> make_store_adapter(c10::intrusive_ptr<c10d::Store> store) {
  return std::make_shared<C10dStoreAdapter>(std::move(store));
}

}  // namespace cohort_torch
