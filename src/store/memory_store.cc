#include "store/memory_store.h"

#include <fmt/core.h>

#include "cohort/error.h"
#include "common/deadline.h"
#include "common/strings.h"

namespace cohort {

std::string missing_keys_message(const std::vector<std::string>& missing, Millis waited) {
  constexpr size_t kShow = 16;
  std::vector<std::string> shown(missing.begin(), missing.begin() + std::min(missing.size(), kShow));
  std::string keys = str::join(shown, ", ");
  if (missing.size() > kShow) keys += fmt::format(", ... ({} keys in all)", missing.size());
  return fmt::format("store wait timed out after {}: missing key(s) {}",
                     format_duration(waited), keys);
}

void MemoryStore::set(const std::string& key, const std::string& value) {
  {
    std::lock_guard<std::mutex> g(mutex_);
    data_[key] = value;
  }
  changed_.notify_all();
}

std::string MemoryStore::get(const std::string& key) {
  std::unique_lock<std::mutex> lock(mutex_);
  wait_locked(lock, {key}, timeout());
  return data_.at(key);
}

int64_t MemoryStore::add(const std::string& key, int64_t delta) {
  int64_t v = 0;
  {
    std::lock_guard<std::mutex> g(mutex_);
    auto it = data_.find(key);
    if (it != data_.end() && !it->second.empty()) {
      try {
        v = std::stoll(it->second);
      } catch (const std::exception&) {
        throw InvalidArgument(fmt::format("store add on key '{}': value is not an integer", key));
      }
    }
    v += delta;
    data_[key] = std::to_string(v);
  }
  changed_.notify_all();
  return v;
}

std::string MemoryStore::compare_set(const std::string& key, const std::string& expected,
                                     const std::string& desired) {
  std::string result;
  {
    std::lock_guard<std::mutex> g(mutex_);
    auto it = data_.find(key);
    if (it == data_.end()) {
      if (expected.empty()) {
        data_[key] = desired;
        result = desired;
      } else {
        result = expected;  // torch's convention: a missing key returns `expected`
      }
    } else if (it->second == expected) {
      it->second = desired;
      result = desired;
    } else {
      result = it->second;
    }
  }
  changed_.notify_all();
  return result;
}

bool MemoryStore::remove(const std::string& key) {
  std::lock_guard<std::mutex> g(mutex_);
  return data_.erase(key) > 0;
}

int64_t MemoryStore::num_keys() {
  std::lock_guard<std::mutex> g(mutex_);
  return static_cast<int64_t>(data_.size());
}

bool MemoryStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> g(mutex_);
  for (const auto& k : keys) {
    if (!data_.count(k)) return false;
  }
  return true;
}

void MemoryStore::wait_locked(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                              Millis timeout) {
  auto deadline = Deadline::after(timeout);
  auto all_present = [&] {
    for (const auto& k : keys) {
      if (!data_.count(k)) return false;
    }
    return true;
  };
  if (!changed_.wait_until(lock, deadline.at(), all_present)) {
    std::vector<std::string> missing;
    for (const auto& k : keys) {
      if (!data_.count(k)) missing.push_back(k);
    }
    throw TimeoutError(missing_keys_message(missing, timeout));
  }
}

void MemoryStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  wait_locked(lock, keys, timeout);
}

std::vector<std::string> MemoryStore::multi_get(const std::vector<std::string>& keys) {
  std::unique_lock<std::mutex> lock(mutex_);
  wait_locked(lock, keys, timeout());
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(data_.at(k));
  return out;
}

void MemoryStore::multi_set(const std::vector<std::string>& keys, const std::vector<std::string>& values) {
  if (keys.size() != values.size()) {
    throw InvalidArgument(fmt::format("store multi_set: {} keys but {} values", keys.size(), values.size()));
  }
  {
    std::lock_guard<std::mutex> g(mutex_);
    for (size_t i = 0; i < keys.size(); ++i) data_[keys[i]] = values[i];
  }
  changed_.notify_all();
}

std::shared_ptr<Store> make_memory_store() { return std::make_shared<MemoryStore>(); }

}  // namespace cohort
