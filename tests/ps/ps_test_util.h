#pragma once
// Helpers of the parameter-server tests that run servers and workers as threads of this process
// (real transports over loopback and shared memory, a memory store).

#include <nlohmann/json.hpp>

#include <sys/resource.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cohort/error.h"
#include "cohort/ps.h"
#include "store/memory_store.h"
#include "support/test_support.h"

namespace cohort::ps::test_util {

inline constexpr std::chrono::milliseconds kTimeout{30000};

// Runs `servers` servers and `workers` workers as threads; body(client) runs on each worker.
// `timeout`: how long a worker waits for a reply; `server_timeout` (0: the same) how long a server
// waits for a row lock.
inline void run_job(int servers, int workers, ConsistencyMode mode, std::chrono::milliseconds timeout,
                    const std::function<void(Client&)>& body,
                    std::chrono::milliseconds server_timeout = std::chrono::milliseconds(0)) {
  auto store = make_memory_store();
  Roles roles{servers, workers};
  test::run_ranks(servers + workers, [&](int r) {
    if (r < servers) return serve(store, r, roles, mode, server_timeout.count() ? server_timeout : timeout);
    auto client = Client::create(store, r - servers, roles, timeout);
    body(*client);
  });
}
inline void run_job(int servers, int workers, ConsistencyMode mode, const std::function<void(Client&)>& body) {
  run_job(servers, workers, mode, kTimeout, body);
}

// The message of the InvalidArgument that `f` throws ("" and a failure when it throws none, or
// another error).
template <typename F>
std::string refusal(F&& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not an InvalidArgument: " << e.what();
    return "";
  }
  ADD_FAILURE() << "no InvalidArgument";
  return "";
}

inline std::vector<float> pull_rows(Client& c, const std::string& t, const std::vector<uint64_t>& ids) {
  std::vector<float> rows(ids.size() * c.table(t).dim);
  c.pull(t, ids.data(), ids.size(), rows.data());
  return rows;
}

// COHORT_PS_DIRECT for one test: "0" sends every pull and push through the server; unset (the
// default) lets workers on the server's host use its shared memory. Read at client creation.
class DirectSetting {
 public:
  explicit DirectSetting(bool direct) {
    if (direct) ::unsetenv("COHORT_PS_DIRECT");
    else ::setenv("COHORT_PS_DIRECT", "0", 1);
  }
  ~DirectSetting() { ::unsetenv("COHORT_PS_DIRECT"); }
};

// Sets an environment variable for one scope, then puts back what was there (settings are read at
// client or server start).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) ::setenv(name_, old_.c_str(), 1);
    else ::unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

// The folder of a save in `dir` that holds its shard files: the one its manifest names.
inline std::string shards_dir(const std::string& dir) {
  auto j = nlohmann::json::parse(test::read_file(dir + "/manifest.json"));
  return dir + "/" + j.at("shards").get<std::string>();
}

// A full disk, for one scope: no file of this process (the servers and workers of run_job are its
// threads) grows past `bytes` (RLIMIT_FSIZE): a write there fails with EFBIG, as a full disk's with
// ENOSPC, and so does growing a memfd (a table's shared memory). SIGXFSZ, which would end the
// process, is ignored meanwhile.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &old_);
    old_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    rlimit lim = old_;
    lim.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &lim);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    std::signal(SIGXFSZ, old_handler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  rlimit old_{};
  void (*old_handler_)(int) = nullptr;
};

}  // namespace cohort::ps::test_util
