// FileStore: the Store interface over one file shared by the processes of one host.
//
// The data lives in `path` (u32 count, then key/value strings in the wire protocol's encoding);
// `path`.lock is the flock(2) lock. A writer takes the lock exclusively, reads the file, changes it,
// writes a temporary file and renames it over `path` (so a crash never leaves a torn file); readers
// take it shared. Threads of one process are serialised by a mutex as well, because flock locks
// belong to the open file, which all threads share. Waits poll the file with a short back-off.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include <fmt/core.h>

#include "cohort/error.h"
#include "common/deadline.h"
#include "common/fd.h"
#include "common/socket.h"
#include "store/memory_store.h"
#include "store/protocol.h"
#include "store/tcp_store.h"

namespace cohort {
namespace {

using Map = std::map<std::string, std::string>;

class FileStore : public Store {
 public:
  explicit FileStore(std::string path) : path_(std::move(path)) {
    lock_fd_.reset(::open((path_ + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    if (!lock_fd_) throw ConfigError(net::errno_string(fmt::format("file store: cannot open {}.lock", path_), errno));
  }

  void set(const std::string& key, const std::string& value) override {
    update([&](Map& m) { m[key] = value; });
  }

  std::string get(const std::string& key) override {
    std::string value;
    wait_for({key}, timeout(), [&](const Map& m) { value = m.at(key); });
    return value;
  }

  int64_t add(const std::string& key, int64_t delta) override {
    int64_t v = 0;
    update([&](Map& m) {
      auto it = m.find(key);
      if (it != m.end() && !it->second.empty()) {
        size_t used = 0;
        try {
          v = std::stoll(it->second, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used != it->second.size()) {
          throw InvalidArgument(fmt::format("store add on key '{}': value is not an integer", key));
        }
      }
      v += delta;
      m[key] = std::to_string(v);
    });
    return v;
  }

  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override {
    std::string result;
    update([&](Map& m) {
      auto it = m.find(key);
      if (it == m.end()) {
        if (expected.empty()) {
          m[key] = desired;
          result = desired;
        } else {
          result = expected;
        }
      } else if (it->second == expected) {
        it->second = desired;
        result = desired;
      } else {
        result = it->second;
      }
    });
    return result;
  }

  bool remove(const std::string& key) override {
    bool existed = false;
    update([&](Map& m) { existed = m.erase(key) > 0; });
    return existed;
  }

  int64_t num_keys() override {
    int64_t n = 0;
    read([&](const Map& m) { n = static_cast<int64_t>(m.size()); });
    return n;
  }

  bool check(const std::vector<std::string>& keys) override {
    bool all = true;
    read([&](const Map& m) {
      for (const auto& k : keys) all = all && m.count(k);
    });
    return all;
  }

  void wait(const std::vector<std::string>& keys, Millis timeout) override {
    wait_for(keys, timeout, [](const Map&) {});
  }
  using Store::wait;

  std::vector<std::string> multi_get(const std::vector<std::string>& keys) override {
    std::vector<std::string> values;
    wait_for(keys, timeout(), [&](const Map& m) {
      for (const auto& k : keys) values.push_back(m.at(k));
    });
    return values;
  }

  void multi_set(const std::vector<std::string>& keys, const std::vector<std::string>& values) override {
    if (keys.size() != values.size()) {
      throw InvalidArgument(fmt::format("store multi_set: {} keys but {} values", keys.size(), values.size()));
    }
    update([&](Map& m) {
      for (size_t i = 0; i < keys.size(); ++i) m[keys[i]] = values[i];
    });
  }

 private:
  // Holds the file lock (shared or exclusive) for the duration of one operation. The lock is taken
  // with LOCK_NB in a loop so that even a stuck lock holder cannot make a call outlive its deadline.
  class Locked {
   public:
    Locked(FileStore& s, bool exclusive) : s_(s), guard_(s.mutex_) {
      Deadline deadline = Deadline::after(s.timeout());
      Millis pause{1};
      while (::flock(s.lock_fd_.get(), (exclusive ? LOCK_EX : LOCK_SH) | LOCK_NB) != 0) {
        if (errno != EWOULDBLOCK && errno != EINTR) {
          throw Error(net::errno_string(fmt::format("file store: flock {}.lock", s.path_), errno));
        }
        if (deadline.expired()) {
          throw TimeoutError(fmt::format("file store {}: could not lock {}.lock within {}", s.path_, s.path_,
                                         format_duration(s.timeout())));
        }
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, Millis(20));
      }
    }
    ~Locked() { ::flock(s_.lock_fd_.get(), LOCK_UN); }

   private:
    FileStore& s_;
    std::lock_guard<std::mutex> guard_;
  };

  Map load() const {
    Map m;
    std::ifstream f(path_, std::ios::binary);
    if (!f) return m;  // no file yet: an empty store
    std::stringstream ss;
    ss << f.rdbuf();
    std::string data = ss.str();
    if (data.empty()) return m;
    proto::Reader r(data);
    uint32_t n = r.count(8);
    for (uint32_t i = 0; i < n && r.ok(); ++i) {
      auto k = r.bytes();
      auto v = r.bytes();
      m.emplace(std::string(k), std::string(v));
    }
    if (!r.at_end()) throw Error(fmt::format("file store {}: the file is corrupt (not written by cohort?)", path_));
    return m;
  }

  void save(const Map& m) const {
    std::string data;
    proto::Writer w(data);
    w.u32(static_cast<uint32_t>(m.size()));
    for (const auto& [k, v] : m) w.bytes(k).bytes(v);
    std::string tmp = fmt::format("{}.tmp.{}", path_, ::getpid());
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      f.write(data.data(), static_cast<std::streamsize>(data.size()));
      if (!f) throw Error(fmt::format("file store {}: cannot write {}", path_, tmp));
    }
    if (::rename(tmp.c_str(), path_.c_str()) != 0) {
      throw Error(net::errno_string(fmt::format("file store: rename {} -> {}", tmp, path_), errno));
    }
  }

  template <typename F>
  void update(F&& change) {
    Locked lock(*this, true);
    Map m = load();
    change(m);
    save(m);
  }

  template <typename F>
  void read(F&& look) {
    Locked lock(*this, false);
    look(load());
  }

  // Polls until every key exists, then calls `found` with the map (under the lock).
  template <typename F>
  void wait_for(const std::vector<std::string>& keys, Millis timeout, F&& found) {
    Deadline deadline = Deadline::after(timeout);
    Millis pause{1};
    for (;;) {
      std::vector<std::string> missing;
      {
        Locked lock(*this, false);
        Map m = load();
        for (const auto& k : keys) {
          if (!m.count(k)) missing.push_back(k);
        }
        if (missing.empty()) {
          found(m);
          return;
        }
      }
      if (deadline.expired()) throw TimeoutError(missing_keys_message(missing, timeout));
      std::this_thread::sleep_for(std::min(pause, deadline.remaining()));
      pause = std::min(pause * 2, Millis(20));
    }
  }

  std::string path_;
  UniqueFd lock_fd_;
  std::mutex mutex_;
};

}  // namespace

std::shared_ptr<Store> make_file_store(const std::string& path) { return std::make_shared<FileStore>(path); }

}  // namespace cohort
