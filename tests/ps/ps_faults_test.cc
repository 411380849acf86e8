// Faults that must cost only the request that met them: a deferred pull whose answer fails, and a
// save or load that meets a full disk, a rename that fails or a row lock held past the timeout. The
// worker that asked gets the error; every server serves on; the last good checkpoint still loads.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cohort/error.h"
#include "common/fd.h"
#include "ps_test_util.h"

namespace cohort::ps {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using test_util::pull_rows;
using test_util::refusal;
using test_util::run_job;
using test_util::shards_dir;

// What a save directory holds, sorted.
std::vector<std::string> listing(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// A writable mapping of this process's memfd named `name` with at least `bytes` (the server, a
// thread here, holds it): the test writes the shard's memory as an attached worker would.
class SharedRows {
 public:
  SharedRows(const std::string& name, size_t bytes) : size_(bytes) {
    const std::string want = "/memfd:" + name + " (deleted)";
    for (const auto& e : fs::directory_iterator("/proc/self/fd")) {
      std::error_code ec;
      if (fs::read_symlink(e.path(), ec).string() != want) continue;
      UniqueFd fd(::open(e.path().c_str(), O_RDWR | O_CLOEXEC));
      struct stat st {};
      if (!fd || ::fstat(fd.get(), &st) != 0 || size_t(st.st_size) < bytes) continue;
      void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
      if (p == MAP_FAILED) continue;
      base_ = static_cast<uint8_t*>(p);
      return;
    }
    throw std::runtime_error("no memfd '" + name + "' of " + std::to_string(bytes) + " bytes");
  }
  ~SharedRows() { ::munmap(base_, size_); }
  uint64_t* word(size_t offset) const { return reinterpret_cast<uint64_t*>(base_ + offset); }

 private:
  uint8_t* base_ = nullptr;
  size_t size_;
};

// A bsp pull waits on the server until every worker has ended the step; it is answered inside the
// request of the worker whose step() ends the wait. Here the answer fails (another worker loaded a
// checkpoint meanwhile, where the dense table has 4 rows, not 1000): the error goes to the worker
// that pulled, under its own request, within moments, not as a second reply to the worker that
// stepped (which left the puller waiting its whole timeout).
TEST(PsFaults, ADeferredPullThatFailsIsAnsweredToItsOwnWorker) {
  test::TempDir tmp;
  const std::string small = tmp.file("small");
  TableConfig cfg;
  cfg.dim = 2;
  cfg.dense = true;
  cfg.rows = 4;
  test_util::run_job(1, 1, {}, [&](Client& c) {
    c.create_table("emb", cfg);
    c.save(small);
  });
  cfg.rows = 1000;
  const auto timeout = std::chrono::seconds(10);
  std::barrier sync(2);
  double waited = -1;
  std::string m;
  run_job(1, 2, ConsistencyMode::parse("bsp"), timeout, [&](Client& c) {
    c.create_table("emb", cfg);
    if (c.worker_index() == 0) {
      c.step();  // clock 1: its pull waits for worker 1's step
      const std::vector<uint64_t> ids = {500};
      std::vector<float> rows(2);
      auto pull = c.pull_async("emb", ids.data(), ids.size(), rows.data());
      // The server takes a worker's requests in order: once this is answered, the pull is deferred.
      c.stats("emb");
      sync.arrive_and_wait();
      const auto t0 = Clock::now();
      m = refusal([&] { pull->wait(); });
      waited = std::chrono::duration<double>(Clock::now() - t0).count();
    } else {
      sync.arrive_and_wait();
      c.load(small);
      c.step();  // ends the wait: the deferred pull is answered from the loaded table
      EXPECT_EQ(c.stats("emb").rows, 4u) << "worker 1 is served on";
    }
  });
  EXPECT_NE(m.find("parameter server 0: table 'emb': row 500 is not held by this server (rows 0..3)"),
            std::string::npos)
      << m;
  EXPECT_LT(waited, 5.0) << "the pull's error did not reach its worker";
}

// A save fails at each of its steps in turn: a server's disk is full, the worker cannot write the
// manifest, the manifest's rename fails. Each time the worker gets one error naming the file, the
// directory holds what it held before (no new folder, no temporary file), the last good checkpoint
// loads, and the servers serve on.
TEST(PsFaults, ASaveThatFailsAtAnyStepLeavesTheLastGoodCheckpoint) {
  test::TempDir tmp;
  const std::string dir = tmp.file("ckpt");
  TableConfig cfg;
  cfg.dim = 4;
  cfg.lr = 1.0f;
  std::vector<uint64_t> ids(2000);
  for (uint64_t i = 0; i < ids.size(); ++i) ids[i] = i * 7919 + 3;
  std::vector<float> g(ids.size() * 4, 1.0f);
  run_job(2, 1, {}, std::chrono::seconds(20), [&](Client& c) {
    c.create_table("t", cfg);
    c.push("t", ids.data(), ids.size(), g.data());
    c.save(dir);  // the good checkpoint: rows at -1
    const auto good = listing(dir);
    ASSERT_EQ(good.size(), 2u);  // manifest.json and its folder
    c.push("t", ids.data(), ids.size(), g.data());  // -2: what no failed save may leave in dir
    auto after_failure = [&](const std::string& what, const std::string& m, const std::string& expect) {
      EXPECT_NE(m.find(expect), std::string::npos) << what << ": " << m;
      EXPECT_EQ(m.find('\n'), std::string::npos) << what << ": " << m;
      EXPECT_EQ(listing(dir), good) << what << ": the failed save left files behind";
      EXPECT_EQ(pull_rows(c, "t", ids), std::vector<float>(ids.size() * 4, -2.0f)) << what << ": not served on";
    };
    {
      // Both servers' shards (about 1000 rows of 40 bytes each) meet a disk that is full at 16 KiB.
      std::string m;
      {
        test_util::FileSizeLimit full(16384);
        m = refusal([&] { c.save(dir); });
      }
      after_failure("a full disk", m, ": cannot write it: File too large");
      EXPECT_EQ(m.rfind("parameter server ", 0), 0u) << m;
    }
    {
      fs::create_directories(dir + "/manifest.json.tmp/in-the-way");  // open(O_CREAT) fails: EISDIR
      const std::string m = refusal([&] { c.save(dir); });
      fs::remove_all(dir + "/manifest.json.tmp");
      after_failure("the manifest cannot be written", m, "save: " + dir + "/manifest.json.tmp: cannot create it");
    }
    c.load(dir);
    EXPECT_EQ(pull_rows(c, "t", ids), std::vector<float>(ids.size() * 4, -1.0f)) << "the last good checkpoint";
    c.push("t", ids.data(), ids.size(), g.data());  // -2 again
    {
      // The rename that publishes the save fails: a directory that is not empty holds its name
      // (the good manifest is put back after).
      const std::string manifest = test::read_file(dir + "/manifest.json");
      fs::remove(dir + "/manifest.json");
      fs::create_directories(dir + "/manifest.json/in-the-way");
      const std::string m = refusal([&] { c.save(dir); });
      EXPECT_NE(m.find("save: " + dir + "/manifest.json.tmp: cannot rename it to " + dir + "/manifest.json: "),
                std::string::npos)
          << m;
      EXPECT_EQ(listing(dir), good) << "the failed save left files behind";
      EXPECT_EQ(pull_rows(c, "t", ids), std::vector<float>(ids.size() * 4, -2.0f));
      fs::remove_all(dir + "/manifest.json");
      test::write_file(dir + "/manifest.json", manifest);
    }
    // A save after the failures publishes itself and removes the folder of the one before.
    c.save(dir);
    const auto now = listing(dir);
    ASSERT_EQ(now.size(), 2u);
    EXPECT_NE(now, good) << "the new save did not replace the old folder";
    c.push("t", ids.data(), ids.size(), g.data());
    c.load(dir);
    EXPECT_EQ(pull_rows(c, "t", ids), std::vector<float>(ids.size() * 4, -2.0f));
  });
}

// A row lock held longer than the server's timeout while it saves (an attached worker stuck in an
// update; here the test holds it in the shard's memory): the save fails for the worker that asked,
// naming the row, and the server serves on: the next save, the lock free again, succeeds and loads.
TEST(PsFaults, ASaveThatMeetsARowLockHeldPastTheTimeoutFailsForItsWorkerOnly) {
  test::TempDir tmp;
  const std::string dir = tmp.file("ckpt");
  TableConfig cfg;
  cfg.dim = 2;
  cfg.lr = 1.0f;
  const std::vector<uint64_t> ids = {7, 8, 9};
  std::vector<float> g(ids.size() * 2, 1.0f);
  std::string m;
  double took = -1;
  // Servers wait 1 s for a lock; the worker waits 20 s for its reply.
  run_job(1, 1, {}, std::chrono::seconds(20), [&](Client& c) {
    c.create_table("t", cfg);
    c.push("t", ids.data(), ids.size(), g.data());
    c.save(dir);  // the good checkpoint: rows at -1
    c.push("t", ids.data(), ids.size(), g.data());  // -2
    {
      // Row slot 0 (the first row made) starts the arena with its version word: an odd version is
      // a locked row (table.h), here of holder 0, the server itself, which is alive.
      SharedRows rows("cohort-ps-rows", 4096);
      uint64_t* version = rows.word(0);
      const uint64_t unlocked = __atomic_load_n(version, __ATOMIC_ACQUIRE);
      ASSERT_EQ(unlocked & 1, 0u);
      __atomic_store_n(version, unlocked | 1, __ATOMIC_RELEASE);
      const auto t0 = Clock::now();
      m = refusal([&] { c.save(dir); });
      took = std::chrono::duration<double>(Clock::now() - t0).count();
      __atomic_store_n(version, unlocked, __ATOMIC_RELEASE);
    }
    EXPECT_EQ(listing(dir).size(), 2u) << "the failed save left files behind";
    EXPECT_EQ(pull_rows(c, "t", ids), std::vector<float>(ids.size() * 2, -2.0f)) << "not served on";
    c.load(dir);
    EXPECT_EQ(pull_rows(c, "t", ids), std::vector<float>(ids.size() * 2, -1.0f)) << "the last good checkpoint";
    c.save(dir);
  }, std::chrono::seconds(1));
  EXPECT_EQ(m.rfind("parameter server 0: save: " + dir + "/shards-", 0), 0u) << m;
  EXPECT_NE(m.find("/t.shard-0-of-1: table 't': the lock of row 7 was held for more than 1 s (COHORT_TIMEOUT)"),
            std::string::npos)
      << m;
  EXPECT_LT(took, 10.0) << m;
}

// A load whose tables cannot get their memory (a memfd that may not grow, as when memory runs
// out) fails for the worker that asked; every table stays as it was and the servers serve on.
TEST(PsFaults, ALoadThatCannotGetMemoryFailsForItsWorkerOnly) {
  test::TempDir tmp;
  const std::string dir = tmp.file("ckpt");
  TableConfig cfg;
  cfg.dim = 64;
  cfg.lr = 1.0f;
  std::vector<uint64_t> ids(5000);
  for (uint64_t i = 0; i < ids.size(); ++i) ids[i] = i;
  std::vector<float> g(ids.size() * 64, 1.0f);
  run_job(1, 1, {}, std::chrono::seconds(20), [&](Client& c) {
    c.create_table("t", cfg);
    c.push("t", ids.data(), ids.size(), g.data());
    c.save(dir);  // rows at -1
    c.push("t", ids.data(), ids.size(), g.data());  // -2
    std::string m;
    {
      // 5000 rows of 64 floats need more than 1 MiB of arena; the shard file is read, not grown.
      test_util::FileSizeLimit full(1 << 20);
      m = refusal([&] { c.load(dir); });
    }
    EXPECT_EQ(m.rfind("parameter server 0: load: " + dir + ": table 't': ", 0), 0u) << m;
    EXPECT_NE(m.find("File too large"), std::string::npos) << m;
    EXPECT_EQ(pull_rows(c, "t", ids), std::vector<float>(ids.size() * 64, -2.0f)) << "not served on";
    c.load(dir);
    EXPECT_EQ(pull_rows(c, "t", ids), std::vector<float>(ids.size() * 64, -1.0f));
  });
}

}  // namespace
}  // namespace cohort::ps
