// The parameter server with servers and workers as threads of one process (real transports over
// loopback and shared memory, a memory store): sharding, initializers, optimizers, the three
// consistency modes, save/load across server counts, memory per row, and refused requests. Where a
// test needs a process to die or to belong to another user, that one is a real process (ps_worker,
// or a forked child), meeting the threads through a file store.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/core.h>
#include <nlohmann/json.hpp>
#include <poll.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <unordered_map>

#include "cohort/error.h"
#include "cohort/ps.h"
#include "common/fd.h"
#include "common/handoff.h"
#include "common/socket.h"
#include "ps/config_json.h"
#include "ps/table.h"
#include "ps/wire.h"
#include "ps_test_util.h"
#include "store/memory_store.h"
#include "store/tcp_store.h"
#include "support/test_support.h"

extern char** environ;

namespace cohort::ps {
namespace {

constexpr std::chrono::milliseconds kTimeout{30000};

// Runs `servers` servers and `workers` workers as threads; body(client) runs on each worker.
void run_job(int servers, int workers, ConsistencyMode mode, const std::function<void(Client&)>& body,
             std::shared_ptr<Store> store = nullptr) {
  if (!store) store = make_memory_store();
  Roles roles{servers, workers};
  test::run_ranks(servers + workers, [&](int r) {
    if (r < servers) return serve(store, r, roles, mode, kTimeout);
    auto client = Client::create(store, r - servers, roles, kTimeout);
    body(*client);
  });
}

std::vector<float> pull_rows(Client& c, const std::string& t, const std::vector<uint64_t>& ids) {
  std::vector<float> rows(ids.size() * c.table(t).dim);
  c.pull(t, ids.data(), ids.size(), rows.data());
  return rows;
}

TEST(PsSharding, EveryIdAndRowHasExactlyOneServer) {
  for (int servers : {1, 2, 3, 7}) {
    std::vector<int> count(size_t(servers), 0);
    for (uint64_t id = 0; id < 70000; ++id) {
      int s = shard_of_id(id * 0x10001 + 17, servers);
      ASSERT_GE(s, 0);
      ASSERT_LT(s, servers);
      ++count[size_t(s)];
    }
    for (int c : count) EXPECT_NEAR(c, 70000 / servers, 70000 / servers / 10) << servers << " servers";
    for (uint64_t rows : {1ull, 5ull, 100ull, 1001ull}) {
      int last = 0;
      std::vector<int> held(size_t(servers), 0);
      for (uint64_t r = 0; r < rows; ++r) {
        int s = shard_of_row(r, rows, servers);
        ASSERT_GE(s, last);  // contiguous ranges in order
        ASSERT_LT(s, servers);
        last = s;
        ++held[size_t(s)];
      }
      int total = 0;
      for (int h : held) total += h;
      EXPECT_EQ(total, int(rows));
    }
  }
}

TEST(PsTable, PullOfUntouchedIdReturnsTheInitializersRowWhateverTheServerCount) {
  TableConfig cfg;
  cfg.dim = 8;
  cfg.init = Initializer::kUniform;
  cfg.init_a = -0.5f;
  cfg.init_b = 0.5f;
  cfg.seed = 42;
  std::vector<uint64_t> ids = {0, 1, 12345678901234ull, 7, 1ull << 40};
  std::vector<float> by_servers[2];
  for (int servers : {1, 3}) {
    std::vector<float> got;
    run_job(servers, 1, {}, [&](Client& c) {
      c.create_table("emb", cfg);
      got = pull_rows(c, "emb", ids);
    });
    for (float v : got) {
      EXPECT_GE(v, -0.5f);
      EXPECT_LT(v, 0.5f);
    }
    by_servers[servers == 1 ? 0 : 1] = got;
  }
  EXPECT_EQ(by_servers[0], by_servers[1]);
  EXPECT_NE(by_servers[0][0], by_servers[0][8]);  // rows differ
  cfg.init = Initializer::kConstant;
  cfg.init_a = 0.25f;
  run_job(2, 1, {}, [&](Client& c) {
    c.create_table("c", cfg);
    for (float v : pull_rows(c, "c", ids)) EXPECT_EQ(v, 0.25f);
  });
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

// async: every push is applied exactly once, whatever the interleaving of workers and servers; on
// the shared rows (direct) and through the servers' messages alike.
class PsAsync : public ::testing::TestWithParam<bool> {};
INSTANTIATE_TEST_SUITE_P(Paths, PsAsync, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "Direct" : "Messages"; });

TEST_P(PsAsync, NoUpdateIsLostSgdWithLrOneSumsEveryPush) {
  const bool direct = GetParam();
  DirectSetting setting(direct);
  constexpr int kWorkers = 3, kServers = 2, kSteps = 40;
  constexpr uint32_t kDim = 4;
  TableConfig cfg;
  cfg.dim = kDim;
  cfg.lr = 1.0f;
  // Each worker pushes small integers (exact in float) and keeps its own sum per id.
  std::vector<std::map<uint64_t, std::vector<double>>> sums(kWorkers);
  std::vector<float> final_rows;
  std::vector<uint64_t> all_ids;
  for (uint64_t i = 0; i < 300; ++i) all_ids.push_back(i * 7919);
  std::atomic<int> done{0};
  run_job(kServers, kWorkers, {}, [&](Client& c) {
    c.create_table("w", cfg);
    std::mt19937_64 rng(uint64_t(c.worker_index()) + 1);
    auto& mine = sums[size_t(c.worker_index())];
    for (int s = 0; s < kSteps; ++s) {
      std::vector<uint64_t> ids(64);
      for (auto& id : ids) id = all_ids[rng() % all_ids.size()];  // duplicates on purpose
      std::vector<float> g(ids.size() * kDim);
      for (auto& x : g) x = float(int(rng() % 9) - 4);
      if (s % 2) {
        c.push("w", ids.data(), ids.size(), g.data());
      } else {
        auto h = c.push_async("w", ids.data(), ids.size(), g.data());
        h->wait();
      }
      for (size_t i = 0; i < ids.size(); ++i) {
        auto& acc = mine[ids[i]];
        acc.resize(kDim);
        for (uint32_t j = 0; j < kDim; ++j) acc[j] += g[i * kDim + j];
      }
      c.step();
    }
    ++done;  // worker 0 reads the table once every worker's pushes are acknowledged
    while (done.load() < kWorkers) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (c.worker_index() == 0) {
      final_rows = pull_rows(c, "w", all_ids);
      TableStats st = c.stats("w");
      // The path taken is the one asked for: every push direct, or none.
      EXPECT_EQ(st.applied_rows, direct ? st.direct_applied_rows : st.applied_rows);
      EXPECT_EQ(st.direct_applied_rows, direct ? st.applied_rows : 0u);
      EXPECT_GT(st.applied_rows, 0u);
    }
  });
  for (size_t i = 0; i < all_ids.size(); ++i) {
    for (uint32_t j = 0; j < kDim; ++j) {
      double expected = 0;
      for (auto& m : sums)
        if (auto it = m.find(all_ids[i]); it != m.end()) expected -= it->second[j];
      ASSERT_EQ(final_rows[i * kDim + j], float(expected)) << "id " << all_ids[i] << " column " << j;
    }
  }
}

// Several workers push to the same hot rows through shared memory while they also create rows
// (the index doubles several times meanwhile, its old arrays punched out under readers): no update
// is lost, and every id got exactly one row.
TEST(PsShared, HotRowsAndAGrowingIndexUnderConcurrentPushesLoseNothing) {
  constexpr int kWorkers = 3, kSteps = 60, kHot = 32, kFresh = 256;
  constexpr uint32_t kDim = 8;
  TableConfig cfg;
  cfg.dim = kDim;
  cfg.lr = 1.0f;
  std::vector<std::map<uint64_t, std::vector<double>>> sums(kWorkers);
  std::atomic<int> done{0};
  std::vector<uint64_t> all;
  std::vector<float> final_rows;
  TableStats st;
  run_job(1, kWorkers, {}, [&](Client& c) {
    c.create_table("w", cfg);
    const int me = c.worker_index();
    std::mt19937_64 rng(uint64_t(me) + 7);
    auto& mine = sums[size_t(me)];
    for (int s = 0; s < kSteps; ++s) {
      std::vector<uint64_t> ids;
      for (int h = 0; h < kHot; ++h) ids.push_back(uint64_t(h) * 1000003);
      // Fresh ids, a third of them shared with the next worker: two workers create some rows at once.
      for (int f = 0; f < kFresh; ++f)
        ids.push_back(1000000000ull + uint64_t(s) * 100000 + uint64_t(f % 3 == 0 ? (me + 1) % kWorkers : me) * 1000 +
                      uint64_t(f));
      std::shuffle(ids.begin(), ids.end(), rng);
      std::vector<float> g(ids.size() * kDim);
      for (auto& x : g) x = float(int(rng() % 7) - 3);
      c.push("w", ids.data(), ids.size(), g.data());
      for (size_t i = 0; i < ids.size(); ++i) {
        auto& acc = mine[ids[i]];
        acc.resize(kDim);
        for (uint32_t j = 0; j < kDim; ++j) acc[j] += g[i * kDim + j];
      }
    }
    ++done;
    while (done.load() < kWorkers) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (me == 0) {
      std::set<uint64_t> ids;
      for (auto& m : sums)
        for (auto& [id, v] : m) ids.insert(id);
      all.assign(ids.begin(), ids.end());
      final_rows = pull_rows(c, "w", all);
      st = c.stats("w");
    }
  });
  ASSERT_GT(all.size(), 30000u);  // from 1024 buckets to 65536: six doublings under the pushes
  EXPECT_EQ(st.rows, all.size());
  EXPECT_EQ(st.direct_applied_rows, st.applied_rows);
  for (size_t i = 0; i < all.size(); ++i) {
    for (uint32_t j = 0; j < kDim; ++j) {
      double expected = 0;
      for (auto& m : sums)
        if (auto it = m.find(all[i]); it != m.end()) expected -= it->second[j];
      ASSERT_EQ(final_rows[i * kDim + j], float(expected)) << "id " << all[i] << " column " << j;
    }
  }
}

// Two workers pushing to the same few rows as fast as they can, in parallel: each row's lock makes
// every read-modify-write whole, so the rows end at exactly the number of pushes.
TEST(PsShared, TwoWorkersPushingTheSameRowsLoseNoUpdate) {
  constexpr uint32_t kDim = 64;
  TableConfig cfg;
  cfg.dim = kDim;
  cfg.lr = 1.0f;
  const std::vector<uint64_t> hot = {3, 4};
  std::atomic<int> ready{0};
  std::atomic<uint64_t> pushes{0};
  std::vector<float> final_rows;
  run_job(1, 2, {}, [&](Client& c) {
    c.create_table("t", cfg);
    pull_rows(c, "t", hot);
    ++ready;
    while (ready.load() < 2) std::this_thread::yield();
    std::vector<float> g(hot.size() * kDim, -1.0f);
    uint64_t mine = 0;
    for (auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
         std::chrono::steady_clock::now() < until && mine < 2000000; ++mine)  // float stays exact
      c.push("t", hot.data(), hot.size(), g.data());
    pushes += mine;
    ++ready;
    while (ready.load() < 4) std::this_thread::yield();
    if (c.worker_index() == 0) final_rows = pull_rows(c, "t", hot);
  });
  ASSERT_GT(pushes.load(), 1000u);
  for (float v : final_rows) ASSERT_EQ(v, float(pushes.load())) << "of " << pushes.load() << " pushes";
}

// A pull that copies a row while another worker's push rewrites it never returns half of each: the
// pushes move every column of a row by the same amount, so a torn copy would hold unequal columns.
// (A row of 64 floats spans five cache lines.)
TEST(PsShared, APullNeverReturnsHalfAPush) {
  constexpr uint32_t kDim = 64;
  constexpr int kHot = 8;
  TableConfig cfg;
  cfg.dim = kDim;
  cfg.lr = 1.0f;
  std::atomic<bool> stop{false};
  std::atomic<int> ready{0};
  std::atomic<uint64_t> torn{0}, pulls{0};
  std::vector<uint64_t> hot;
  for (int h = 0; h < kHot; ++h) hot.push_back(uint64_t(h) * 7 + 1);
  run_job(1, 3, {}, [&](Client& c) {
    c.create_table("t", cfg);
    pull_rows(c, "t", hot);  // every worker attached, every row created
    ++ready;
    while (ready.load() < 3) std::this_thread::yield();
    if (c.worker_index() == 0) {
      std::vector<float> g(hot.size() * kDim, -1.0f);  // every column +1
      auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(400);
      while (std::chrono::steady_clock::now() < until) c.push("t", hot.data(), hot.size(), g.data());
      stop = true;
    } else {
      std::vector<float> rows(hot.size() * kDim);
      while (!stop.load()) {
        c.pull("t", hot.data(), hot.size(), rows.data());
        ++pulls;
        for (size_t r = 0; r < hot.size(); ++r)
          for (uint32_t j = 1; j < kDim; ++j)
            if (rows[r * kDim + j] != rows[r * kDim]) {
              ++torn;
              break;
            }
      }
    }
  });
  EXPECT_GT(pulls.load(), 100u);
  EXPECT_EQ(torn.load(), 0u) << "of " << pulls.load() << " pulls";
}

// ---- a worker that dies holding a lock, and who may attach (table.h: holders) ----

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0, Clock::time_point t) {
  return std::chrono::duration<double>(t - t0).count();
}

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// A ps_worker process (tests/ps/ps_worker.cc) with its output in `log`; SIGKILLed and reaped when
// the object goes, unless kill() did it.
class Child {
 public:
  Child(const std::vector<std::string>& args, std::string log) : log_(std::move(log)) {
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    const int rc = posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) throw std::runtime_error("posix_spawn " + args[0] + ": " + std::strerror(rc));
  }
  ~Child() { kill(); }
  int pid() const { return pid_; }
  void kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  std::string output() const { return test::read_file(log_); }
  // Waits (at most 60 s) until its output holds `what`.
  void wait_for(const std::string& what) const {
    for (auto until = Clock::now() + std::chrono::seconds(60); Clock::now() < until;) {
      if (output().find(what) != std::string::npos) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    throw std::runtime_error("the child never printed '" + what + "': " + output());
  }

 private:
  std::string log_;
  pid_t pid_ = -1;
};

// This process's own mapping of a shard's memfd named `name` ("cohort-ps-rows", "cohort-ps-header"),
// found among its descriptors (the server, a thread here, holds it) once the file has `bytes`:
// the test reads the shared memory as another process of the job would.
class Peek {
 public:
  Peek(const std::string& name, size_t bytes) : size_(bytes) {
    const std::string want = "/memfd:" + name + " (deleted)";
    for (auto until = Clock::now() + std::chrono::seconds(60); Clock::now() < until;
         std::this_thread::sleep_for(std::chrono::milliseconds(5))) {
      for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
        std::error_code ec;
        if (std::filesystem::read_symlink(e.path(), ec).string() != want) continue;
        UniqueFd fd(::open(e.path().c_str(), O_RDONLY | O_CLOEXEC));
        struct stat st {};
        if (!fd || ::fstat(fd.get(), &st) != 0 || size_t(st.st_size) < bytes) continue;
        void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd.get(), 0);
        if (p == MAP_FAILED) continue;
        base_ = static_cast<const uint8_t*>(p);
        return;
      }
    }
    throw std::runtime_error("no memfd '" + name + "' of " + std::to_string(bytes) + " bytes appeared");
  }
  ~Peek() { ::munmap(const_cast<uint8_t*>(base_), size_); }
  const uint8_t* at(size_t offset) const { return base_ + offset; }
  uint64_t word(size_t offset) const {
    return __atomic_load_n(reinterpret_cast<const uint64_t*>(base_ + offset), __ATOMIC_ACQUIRE);
  }
  uint32_t word32(size_t offset) const {
    return __atomic_load_n(reinterpret_cast<const uint32_t*>(base_ + offset), __ATOMIC_ACQUIRE);
  }

 private:
  const uint8_t* base_ = nullptr;
  size_t size_;
};

// Stops process `pid` (SIGSTOP) once `held()` and `part_written()` hold while it is stopped: it
// holds a lock and is in the middle of its writes. Tries again (SIGCONT) for up to 60 s.
void stop_while(int pid, const std::function<bool()>& held, const std::function<bool()>& part_written) {
  for (auto until = Clock::now() + std::chrono::seconds(60); Clock::now() < until;) {
    while (!held() && Clock::now() < until) std::this_thread::yield();
    ::kill(pid, SIGSTOP);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, WUNTRACED), pid);
    ASSERT_TRUE(WIFSTOPPED(status)) << "status " << status;
    if (held() && part_written()) return;
    ::kill(pid, SIGCONT);
  }
  FAIL() << "never stopped process " << pid << " while it held the lock";
}

// Waits (at most 20 s) until `n` threads of this process wait for a shard's lock (table.h), so that
// a test ends the holder only once its waiters are caught in the wait it is about. On failure the
// test goes on, so that the holder is still killed and nothing waits for it.
void wait_for_lock_waits(int n) {
  for (auto until = Clock::now() + std::chrono::seconds(20); lock_waits_in_process() < n;) {
    ASSERT_LT(Clock::now(), until) << lock_waits_in_process() << " of " << n << " threads wait for the lock";
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// ps_worker hold: worker 1 of 1 server and `workers` workers pushes to row 7 of "big" (one row of
// 2^20 float32 values, SGD, lr 1), which lives at the start of the server's rows file.
constexpr uint32_t kBigDim = 1u << 20;
constexpr size_t kBigRow = 16 + size_t(kBigDim) * 4;  // version, id, values (table.h: row layout)

float value_at(const Peek& rows, uint32_t j) {
  float v;
  std::memcpy(&v, rows.at(16 + size_t(j) * 4), 4);
  return v;
}

// A worker process stopped while it writes a row in place, then SIGKILLed: the server and the other
// workers waiting for that row (a push on the shared row, a save that reads every row) go on within
// a moment of the death, not after COHORT_TIMEOUT; the row comes back unlocked and whole, as before
// the dead worker's update, plus the push that waited; one warning names the worker; the server
// fails at once naming the worker it lost (the launcher would end the job on it).
TEST(PsShared, AWorkerKilledHoldingARowsLockStallsNobodyAndItsHalfUpdateIsUndone) {
  test::TempDir dir;
  const std::string store_path = dir.file("store");
  auto store = make_file_store(store_path);
  const Roles roles{1, 3};
  constexpr std::chrono::milliseconds kLong{20000};  // COHORT_TIMEOUT here: no wait may come near it
  std::string server_error;
  Clock::time_point server_end;
  std::jthread server([&] {
    try {
      serve(store, 0, roles, {}, kLong);
    } catch (const std::exception& e) {
      server_error = e.what();
    }
    server_end = Clock::now();
  });
  // Declared after the server: on an early return it is killed before the server is joined.
  Child holder({COHORT_PS_WORKER, "hold", store_path, "1", "1", "3"}, dir.file("holder.log"));
  std::unique_ptr<Client> w0, w2;
  std::jthread join2([&] { w2 = Client::create(store, 2, roles, kLong); });
  w0 = Client::create(store, 0, roles, kLong);
  join2.join();
  holder.wait_for("holding row 7");
  Peek rows("cohort-ps-rows", kBigRow);
  // Worker 0 maps the shard now, through another row (a pull of row 7 would rarely find it unlocked
  // for the whole copy while worker 1 pushes to it without a pause).
  pull_rows(*w0, "big", {8});
  stop_while(
      holder.pid(), [&] { return (rows.word(0) & 1) != 0; },
      [&] { return value_at(rows, 0) != value_at(rows, kBigDim - 1); });
  if (HasFatalFailure()) return;
  const float before = value_at(rows, kBigDim - 1), after = value_at(rows, 0);
  ASSERT_EQ(after, before - 1.0f);

  testing::internal::CaptureStderr();
  const uint64_t id = 7;
  std::vector<float> ones(kBigDim, 1.0f);
  std::string push_error, save_error;
  Clock::time_point pushed, saved;
  std::jthread pusher([&] {  // on the shared row: waits for its lock
    try {
      w0->push("big", &id, 1, ones.data());
    } catch (const std::exception& e) {
      push_error = e.what();
    }
    pushed = Clock::now();
  });
  std::jthread saver([&] {  // the server reads every row: it waits for that lock too
    try {
      w2->save(dir.file("saved"));
    } catch (const std::exception& e) {
      save_error = e.what();
    }
    saved = Clock::now();
  });
  wait_for_lock_waits(2);  // the push and the save's read of row 7
  const Clock::time_point killed = Clock::now();
  const int dead = holder.pid();
  holder.kill();
  pusher.join();
  saver.join();
  server.join();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_LT(seconds_since(killed, pushed), 3.0) << push_error;
  EXPECT_EQ(push_error, "");
  EXPECT_LT(seconds_since(killed, saved), 5.0) << save_error;  // answered, or failed on the lost server
  EXPECT_LT(seconds_since(killed, server_end), 5.0) << server_error;
  EXPECT_NE(server_error.find("lost worker 1"), std::string::npos) << server_error;
  // Unlocked, and whole: the dead worker's half-written update is gone, worker 0's push is in.
  EXPECT_EQ(rows.word(0) & 1, 0u);
  for (uint32_t j = 0; j < kBigDim; ++j) ASSERT_EQ(value_at(rows, j), before - 1.0f) << "column " << j;
  EXPECT_EQ(count_of(err, "died holding the lock of row 7"), 1u) << err;
  EXPECT_NE(err.find("table 'big': worker 1 (pid " + std::to_string(dead) +
                     ") died holding the lock of row 7; its unfinished update was discarded"),
            std::string::npos)
      << err;
}

// A lock held past COHORT_TIMEOUT by a live process (stopped here): the waiter's error names the
// row's holder, whether it writes the row (push) or reads it (pull). Once the holder is dead, the
// same push goes through.
TEST(PsShared, ALockWaitThatTimesOutNamesTheRowsHolder) {
  test::TempDir dir;
  const std::string store_path = dir.file("store");
  auto store = make_file_store(store_path);
  const Roles roles{1, 2};
  std::jthread server([&] {
    try {
      serve(store, 0, roles, {}, std::chrono::seconds(20));
    } catch (const std::exception& e) {  // worker 1 is killed below
      EXPECT_NE(std::string(e.what()).find("lost worker 1"), std::string::npos) << e.what();
    }
  });
  Child holder({COHORT_PS_WORKER, "hold", store_path, "1", "1", "2"}, dir.file("holder.log"));
  holder.wait_for("worker 1 starting");
  auto w0 = Client::create(store, 0, roles, std::chrono::seconds(2));  // its lock waits end after 2 s
  holder.wait_for("holding row 7");
  Peek rows("cohort-ps-rows", kBigRow);
  stop_while(
      holder.pid(), [&] { return (rows.word(0) & 1) != 0; }, [] { return true; });
  if (HasFatalFailure()) return;
  const std::string holder_named = "by worker 1 (pid " + std::to_string(holder.pid()) + "), which is alive";
  const uint64_t id = 7;
  std::vector<float> row(kBigDim, 1.0f);
  for (bool push : {true, false}) {
    const auto t0 = Clock::now();
    try {
      if (push) w0->push("big", &id, 1, row.data());
      else w0->pull("big", &id, 1, row.data());
      ADD_FAILURE() << "a " << (push ? "push" : "pull") << " went through a row locked by a stopped process";
    } catch (const TimeoutError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("table 'big': the lock of row 7 was held for more than 2 s (COHORT_TIMEOUT)"),
                std::string::npos) << what;
      EXPECT_NE(what.find(holder_named), std::string::npos) << what;
    }
    EXPECT_LT(seconds_since(t0, Clock::now()), 10.0);
  }
  // Waiting when the holder dies (after the death, the server fails on its lost worker and retires
  // the table, so a call that starts then is refused): it goes through within its 2 s.
  std::fill(row.begin(), row.end(), 1.0f);
  std::string push_error;
  std::jthread pusher([&] {
    try {
      w0->push("big", &id, 1, row.data());
    } catch (const std::exception& e) {
      push_error = e.what();
    }
  });
  wait_for_lock_waits(1);
  holder.kill();
  pusher.join();
  EXPECT_EQ(push_error, "");
  EXPECT_EQ(rows.word(0) & 1, 0u);
  // The server fails on its lost worker 1 by itself; joined first, so that it and worker 0's
  // closing do not format their errors at once (libstdc++'s regex has a benign race TSan reports).
  server.join();
  w0.reset();
}

// A worker process stopped while it holds the lock that creates rows, then SIGKILLed: a worker that
// creates rows goes on within a moment, one warning names the dead worker, and no id got two rows
// (the row count is that of the distinct ids created).
TEST(PsShared, AWorkerKilledHoldingTheLockThatCreatesRowsStallsNobody) {
  test::TempDir dir;
  const std::string store_path = dir.file("store");
  auto store = make_file_store(store_path);
  const Roles roles{1, 2};
  constexpr std::chrono::milliseconds kLong{20000};
  std::jthread server([&] {
    try {
      serve(store, 0, roles, {}, kLong);
    } catch (const std::exception& e) {  // worker 1 is killed below
      EXPECT_NE(std::string(e.what()).find("lost worker 1"), std::string::npos) << e.what();
    }
  });
  Child creator({COHORT_PS_WORKER, "create-rows", store_path, "1", "1", "2"}, dir.file("creator.log"));
  auto w0 = Client::create(store, 0, roles, kLong);
  creator.wait_for("creating rows");
  pull_rows(*w0, "fresh", {0});  // worker 0 maps the shard now (attaching takes a message to the server)
  Peek header("cohort-ps-header", header_rows_offset() + 8);
  // Only worker 1 creates rows meanwhile: the insert lock is its while it is not 0.
  stop_while(
      creator.pid(), [&] { return header.word32(header_insert_lock_offset()) != 0; }, [] { return true; });
  if (HasFatalFailure()) return;
  const uint64_t created = header.word(header_rows_offset());
  ASSERT_GT(created, 1u);

  // Worker 0 pushes to every id worker 1 has created (2^40, 2^40 + 1, ... in order, one row each,
  // id 0 aside), and to 100 new ones. Worker 1's last counted row may lack its index entry: then the
  // waiter that takes the lock over enters it, and no id gets a second row.
  testing::internal::CaptureStderr();
  std::vector<uint64_t> ids;
  for (uint64_t i = 0; i < created - 1; ++i) ids.push_back((uint64_t(1) << 40) + i);
  for (uint64_t i = 1; i <= 100; ++i) ids.push_back(i);
  std::vector<float> g(ids.size() * 4, 1.0f);
  std::string push_error;
  Clock::time_point pushed;
  std::jthread pusher([&] {
    try {
      w0->push("fresh", ids.data(), ids.size(), g.data());
    } catch (const std::exception& e) {
      push_error = e.what();
    }
    pushed = Clock::now();
  });
  wait_for_lock_waits(1);  // for the insert lock
  const Clock::time_point killed = Clock::now();
  const int dead = creator.pid();
  creator.kill();
  pusher.join();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_LT(seconds_since(killed, pushed), 3.0) << push_error;
  EXPECT_EQ(push_error, "");
  EXPECT_EQ(header.word(header_rows_offset()), created + 100) << "an id got a second row, or a row was lost";
  EXPECT_EQ(header.word32(header_insert_lock_offset()), 0u);
  EXPECT_EQ(count_of(err, "died holding the lock that creates rows"), 1u) << err;
  EXPECT_NE(err.find("table 'fresh': worker 1 (pid " + std::to_string(dead) +
                     ") died holding the lock that creates rows"),
            std::string::npos)
      << err;
  server.join();  // it fails on its lost worker 1 by itself; before worker 0 closes, as above
}

// A process that is not the worker asking to attach (another user's, or another process of this
// user's), listening on the socket named in the request: the server checks the socket's owner
// (SO_PEERCRED) before it sends the table's memory, refuses with one line, and serves on. The
// asking worker speaks the wire protocol itself here, as a worker that names a socket it does not own.
TEST(PsShared, AnAttachToASocketOfAnotherUserOrProcessIsRefusedAndTheServerServesOn) {
  const bool root = ::geteuid() == 0;
  // The owners: forked before any thread starts. Each listens, takes one connection, and exits 0 when
  // it got no descriptors, 1 when it got some, 2 when nobody connected within 30 s.
  struct Owner {
    std::string socket;
    int pid = -1;
    bool other_user = false;
  };
  std::vector<Owner> owners;
  for (bool other_user : {true, false}) {
    if (other_user && !root) continue;  // starting a process of another user takes root
    Owner o;
    o.other_user = other_user;
    o.socket = "cohort-ps-test-owner-" + std::to_string(::getpid()) + (other_user ? "-nobody" : "-same-user");
    socklen_t len = 0;
    const sockaddr_un addr = net::abstract_address(o.socket, &len);
    int ready[2];
    ASSERT_EQ(::pipe(ready), 0);
    o.pid = ::fork();
    ASSERT_GE(o.pid, 0);
    if (o.pid == 0) {
      if (other_user && ::syscall(SYS_setuid, 65534) != 0) ::_exit(3);  // nobody
      const int l = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
      if (l < 0 || ::bind(l, reinterpret_cast<const sockaddr*>(&addr), len) != 0 || ::listen(l, 4) != 0) ::_exit(4);
      (void)!::write(ready[1], "r", 1);
      pollfd p{l, POLLIN, 0};
      if (::poll(&p, 1, 30000) != 1) ::_exit(2);
      const int c = ::accept(l, nullptr, nullptr);
      char tag;
      alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))];
      iovec iov{&tag, 1};
      msghdr m{};
      m.msg_iov = &iov;
      m.msg_iovlen = 1;
      m.msg_control = control;
      m.msg_controllen = sizeof control;
      pollfd q{c, POLLIN, 0};
      if (::poll(&q, 1, 2000) == 1 && ::recvmsg(c, &m, 0) > 0 && m.msg_controllen > 0) ::_exit(1);
      ::_exit(0);
    }
    ::close(ready[1]);
    char r;
    ASSERT_EQ(::read(ready[0], &r, 1), 1) << "the socket owner did not start";
    ::close(ready[0]);
    owners.push_back(o);
  }

  auto store = make_memory_store();
  const Roles roles{1, 2};
  TableConfig cfg;
  cfg.dim = 4;
  cfg.lr = 1.0f;
  std::barrier created(2);
  testing::internal::CaptureStderr();
  std::vector<std::string> whys;
  test::run_ranks(3, [&](int r) {
    if (r == 0) return serve(store, 0, roles, {}, kTimeout);
    if (r == 1) {  // worker 0: a client as any
      auto c = Client::create(store, 0, roles, kTimeout);
      c->create_table("t", cfg);
      created.arrive_and_wait();
      created.arrive_and_wait();  // worker 1's attaches were refused
      const std::vector<uint64_t> ids = {1, 2, 3};
      std::vector<float> g(12, 1.0f);
      c->push("t", ids.data(), ids.size(), g.data());
      EXPECT_EQ(pull_rows(*c, "t", ids), std::vector<float>(12, -1.0f));
      EXPECT_EQ(c->stats("t").direct_applied_rows, 3u);  // worker 0 itself attached
      return;
    }
    // Worker 1, by hand: the requests of include/cohort/ps.h's client, one at a time.
    Endpoint ep(store, "ps", roles.worker_rank(1), {true, false, false}, kTimeout);
    uint64_t seq = 0;
    auto call = [&](Op op, const std::string& table, const std::string& payload) {
      RequestHeader h;
      h.op = op;
      if (!table.empty()) set_table_name(h, table);
      h.payload = payload.size();
      ReplyHeader reply;
      std::string body;
      Posted sends[2] = {ep.isend(0, Msg::kRequest, seq, &h, sizeof h),
                         payload.empty() ? Posted{}
                                         : ep.isend(0, Msg::kRequestPayload, seq, payload.data(), payload.size())};
      Posted got = ep.irecv(0, Msg::kReply, seq, &reply, sizeof reply);
      while (!ep.test(got)) ep.poll(10);
      if (reply.payload > 0) {
        body.resize(reply.payload);
        Posted rest = ep.irecv(0, Msg::kReplyPayload, seq, body.data(), body.size());
        while (!ep.test(rest)) ep.poll(10);
      }
      for (auto& p : sends)
        while (p && !ep.test(p)) ep.poll(10);
      ++seq;
      EXPECT_EQ(reply.status, Status::kOk) << reply.message;
      return body;
    };
    call(Op::kHello, "", "");
    created.arrive_and_wait();
    for (const Owner& o : owners) {
      const std::string request = nlohmann::json{{"socket", o.socket}, {"pid", ::getpid()}}.dump();
      const auto j = nlohmann::json::parse(call(Op::kAttach, "t", request));
      EXPECT_FALSE(j.at("attached").get<bool>()) << j.dump();
      whys.push_back(j.value("why", ""));
    }
    created.arrive_and_wait();
    call(Op::kBye, "", "");
  });
  const std::string err = testing::internal::GetCapturedStderr();
  size_t k = 0;
  for (const Owner& o : owners) {
    int status = 0;
    ASSERT_EQ(::waitpid(o.pid, &status, 0), o.pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << (o.other_user ? "another user's" : "another process's") << " socket got the table's memory, or no "
        << "connection (status " << status << ")";
    const std::string expected =
        o.other_user
            ? fmt::format("its socket '{}' is held by another process: pid {} runs as uid 65534, not as this job's "
                          "uid 0", o.socket, o.pid)
            : fmt::format("its socket '{}' is held by another process: pid {} is not worker 1 (pid {})", o.socket,
                          o.pid, ::getpid());
    EXPECT_NE(whys[k].find(expected), std::string::npos) << whys[k];
    EXPECT_EQ(count_of(err, "parameter server 0: refused worker 1's attach of table 't': will not connect to worker 1: " +
                                expected),
              1u)
        << err;
    ++k;
  }
  EXPECT_EQ(count_of(err, "refused worker 1's attach"), owners.size()) << err;
  if (!root) GTEST_SKIP() << "the other user's half needs root; another process's half ran";
}

// Another process connects to a worker's attach socket before the server does (the socket's name is
// no secret) and offers memory of its own: the worker ignores it with one warning (SO_PEERCRED: not
// the server's pid) and maps the server's table. The server here is the test speaking the wire
// protocol, so that the other process's connection comes first for certain.
TEST(PsShared, AWorkerTakesOnlyTheServersConnectionToItsAttachSocket) {
  auto store = make_memory_store();
  const Roles roles{1, 1};
  TableConfig cfg;
  cfg.dim = 4;
  TableShard shard("t", cfg, 0, 0, kTimeout);
  const std::vector<float> values = {1, 2, 3, 4}, state;
  shard.put(5, values.data(), state.data());
  int intruder = -1;
  testing::internal::CaptureStderr();
  test::run_ranks(2, [&](int r) {
    if (r == 1) {  // worker 0
      auto c = Client::create(store, 0, roles, kTimeout);
      EXPECT_EQ(pull_rows(*c, "t", {5}), values);
      EXPECT_EQ(c->stats("t").rows, 1u);
      return;
    }
    Endpoint ep(store, "ps", 0, {false, true}, kTimeout);
    for (uint64_t seq = 0;; ++seq) {
      RequestHeader h;
      Posted got = ep.irecv(1, Msg::kRequest, seq, &h, sizeof h);
      while (!ep.test(got)) ep.poll(10);
      std::string payload(h.payload, '\0');
      if (h.payload > 0) {
        Posted rest = ep.irecv(1, Msg::kRequestPayload, seq, payload.data(), payload.size());
        while (!ep.test(rest)) ep.poll(10);
      }
      std::string body;
      if (h.op == Op::kHello) {
        body = nlohmann::json{{"mode", "async"}, {"max_request", 1 << 20}}.dump();
      } else if (h.op == Op::kDescribe) {
        body = config_to_json(cfg).dump();
      } else if (h.op == Op::kStats) {
        const uint64_t st[4] = {shard.rows(), shard.bytes(), shard.applied(), shard.direct_applied()};
        body.assign(reinterpret_cast<const char*>(st), sizeof st);
      } else if (h.op == Op::kAttach) {
        const auto req = nlohmann::json::parse(payload);
        socklen_t len = 0;
        const sockaddr_un addr = net::abstract_address(req.at("socket").get<std::string>(), &len);
        int done[2];
        ASSERT_EQ(::pipe(done), 0);
        intruder = ::fork();  // offers three memfds of its own, before the server's connection
        ASSERT_GE(intruder, 0);
        if (intruder == 0) {
          const int fds[3] = {int(::memfd_create("intruder", 0)), int(::memfd_create("intruder", 0)),
                              int(::memfd_create("intruder", 0))};
          for (int fd : fds)
            if (fd < 0 || ::ftruncate(fd, 1 << 20) != 0) ::_exit(2);
          const int sock = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
          if (sock < 0 || ::connect(sock, reinterpret_cast<const sockaddr*>(&addr), len) != 0) ::_exit(3);
          char tag = 'T';
          iovec iov{&tag, 1};
          alignas(cmsghdr) char control[CMSG_SPACE(sizeof fds)] = {};
          msghdr m{};
          m.msg_iov = &iov;
          m.msg_iovlen = 1;
          m.msg_control = control;
          m.msg_controllen = sizeof control;
          cmsghdr* cm = CMSG_FIRSTHDR(&m);
          cm->cmsg_level = SOL_SOCKET;
          cm->cmsg_type = SCM_RIGHTS;
          cm->cmsg_len = CMSG_LEN(sizeof fds);
          std::memcpy(CMSG_DATA(cm), fds, sizeof fds);
          if (::sendmsg(sock, &m, 0) != 1) ::_exit(4);
          (void)!::write(done[1], "s", 1);
          ::_exit(0);
        }
        ::close(done[1]);
        char sent;
        EXPECT_EQ(::read(done[0], &sent, 1), 1) << "the other process did not connect";
        // The server's side of the memfd handoff (common/handoff.h), as ps/server.cc does it.
        const std::string socket = req.at("socket").get<std::string>();
        UniqueFd sock = handoff::connect(socket, ::getpid(), "worker 0", Deadline::after(kTimeout));
        handoff::send(sock.get(), handoff::make_hello(handoff::scope_of(socket), 0), shard.fds(),
                      Deadline::after(kTimeout), "worker 0");
        body = nlohmann::json{{"attached", true}, {"pid", ::getpid()}, {"holder", shard.register_holder(0, ::getpid())},
                              {"first_row", 0}, {"rows", 0}, {"config", config_to_json(cfg)}}
                   .dump();
        ::close(done[0]);
      }
      ReplyHeader reply;
      reply.payload = body.size();
      Posted a = ep.isend(1, Msg::kReply, seq, &reply, sizeof reply);
      Posted b = body.empty() ? Posted{} : ep.isend(1, Msg::kReplyPayload, seq, body.data(), body.size());
      while (!ep.test(a) || (b && !ep.test(b))) ep.poll(10);
      if (h.op == Op::kBye) return;
    }
  });
  const std::string err = testing::internal::GetCapturedStderr();
  ASSERT_GT(intruder, 0);
  int status = 0;
  EXPECT_EQ(::waitpid(intruder, &status, 0), intruder);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  EXPECT_EQ(count_of(err, "refused a connection to its socket"), 1u) << err;
  EXPECT_NE(err.find(fmt::format("(pid {}): pid {} is none of the parameter servers awaited (0)", intruder, intruder)),
            std::string::npos)
      << err;
}

// bsp: the table equals a single-process reference that applies each step's summed pushes; every
// pull of step c sees exactly the steps before it (checked at every step, on every worker).
TEST(PsBsp, SameTablesAsASingleProcessReferenceAtEveryStep) {
  constexpr int kWorkers = 2, kServers = 2, kSteps = 12;
  TableConfig cfg;
  cfg.dim = 3;
  cfg.optimizer = Optimizer::kAdam;
  cfg.lr = 0.05f;
  cfg.init = Initializer::kUniform;
  cfg.init_a = -1;
  cfg.init_b = 1;
  cfg.seed = 9;
  const std::vector<uint64_t> universe = {3, 5, 8, 13, 21, 34, 55, 89};
  // The fixed sequence: worker w at step s pushes ids[(w + s + k) % 8] for k < 5 (a duplicate
  // included), gradients a function of (w, s, k).
  auto step_ids = [&](int w, int s) {
    std::vector<uint64_t> ids;
    for (int k = 0; k < 5; ++k) ids.push_back(universe[size_t((w + s + k) % 8)]);
    ids.push_back(ids[0]);
    return ids;
  };
  auto step_grads = [&](int w, int s) {
    std::vector<float> g;
    for (int k = 0; k < 6; ++k)
      for (int j = 0; j < 3; ++j) g.push_back(std::sin(float(w * 100 + s * 10 + k + j * 0.3)));
    return g;
  };
  // Reference after each step: the same float operations in the same order (duplicates summed on
  // the worker in push order, then workers summed in worker order, then one Adam update per row).
  std::vector<std::vector<float>> reference;  // [step] -> rows of `universe`
  {
    TableShard t("ref", cfg);
    for (int s = 0; s <= kSteps; ++s) {
      std::vector<float> rows(universe.size() * 3);
      t.read(universe.data(), universe.size(), rows.data());
      reference.push_back(rows);
      if (s == kSteps) break;
      std::vector<uint64_t> ids;
      std::vector<float> sum;
      std::unordered_map<uint64_t, size_t> at;
      for (int w = 0; w < kWorkers; ++w) {
        auto wid = step_ids(w, s);
        auto g = step_grads(w, s);
        std::vector<uint64_t> uid;
        std::vector<float> ug;
        std::unordered_map<uint64_t, size_t> wat;
        for (size_t i = 0; i < wid.size(); ++i) {
          auto [it, fresh] = wat.try_emplace(wid[i], uid.size());
          if (fresh) {
            uid.push_back(wid[i]);
            ug.insert(ug.end(), g.begin() + long(i * 3), g.begin() + long(i * 3 + 3));
          } else {
            for (int j = 0; j < 3; ++j) ug[it->second * 3 + size_t(j)] += g[i * 3 + size_t(j)];
          }
        }
        for (size_t i = 0; i < uid.size(); ++i) {
          auto [it, fresh] = at.try_emplace(uid[i], ids.size());
          if (fresh) {
            ids.push_back(uid[i]);
            sum.insert(sum.end(), ug.begin() + long(i * 3), ug.begin() + long(i * 3 + 3));
          } else {
            for (int j = 0; j < 3; ++j) sum[it->second * 3 + size_t(j)] += ug[i * 3 + size_t(j)];
          }
        }
      }
      t.apply(ids.data(), ids.size(), sum.data());
    }
  }
  run_job(kServers, kWorkers, ConsistencyMode::parse("bsp"), [&](Client& c) {
    c.create_table("emb", cfg);
    EXPECT_EQ(c.mode().mode, Mode::kBsp);
    const int w = c.worker_index();
    for (int s = 0; s < kSteps; ++s) {
      // Worker 1 dawdles: bsp must still hold worker 0's pull until worker 1's step is in.
      if (w == 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      ASSERT_EQ(pull_rows(c, "emb", universe), reference[size_t(s)]) << "worker " << w << " step " << s;
      auto ids = step_ids(w, s);
      auto g = step_grads(w, s);
      if (s % 3 == 2) {
        std::vector<float> rows(universe.size() * 3);
        c.push_pull("emb", ids.data(), ids.size(), g.data(), universe.data(), universe.size(), rows.data());
        ASSERT_EQ(rows, reference[size_t(s) + 1]) << "push_pull, worker " << w << " step " << s;
      } else {
        c.push("emb", ids.data(), ids.size(), g.data());
        c.step();
      }
    }
    EXPECT_EQ(c.clock(), uint64_t(kSteps));
    ASSERT_EQ(pull_rows(c, "emb", universe), reference[kSteps]);
  });
}

// stale:K: no worker's pull runs more than K steps ahead of the slowest worker.
TEST(PsStale, APullWaitsWhileAnotherWorkerIsMoreThanKStepsBehind) {
  constexpr int K = 2;
  std::atomic<int> slow_steps{0};
  TableConfig cfg;
  cfg.dim = 2;
  run_job(1, 2, ConsistencyMode::parse("stale:2"), [&](Client& c) {
    c.create_table("t", cfg);
    std::vector<uint64_t> ids = {1, 2};
    std::vector<float> rows(4);
    if (c.worker_index() == 1) {
      for (int s = 0; s < 6; ++s) {
        std::this_thread::sleep_for(std::chrono::milliseconds(30));
        slow_steps = s + 1;  // before the server can know
        c.step();
      }
      return;
    }
    for (int s = 0; s < 6; ++s) {
      c.pull("t", ids.data(), ids.size(), rows.data());
      // A pull in step s may run once every worker has ended s - K steps.
      EXPECT_GE(slow_steps.load(), s - K) << "pull in step " << s;
      c.step();
    }
  });
}

TEST(PsTable, DuplicateIdsArePulledAsOneRowAndTheirGradientsSummed) {
  TableConfig cfg;
  cfg.dim = 2;
  cfg.lr = 1.0f;
  run_job(2, 1, {}, [&](Client& c) {
    c.create_table("t", cfg);
    std::vector<uint64_t> ids = {5, 9, 5, 5};
    std::vector<float> g = {1, 2, 10, 20, 100, 200, 1000, 2000};
    c.push("t", ids.data(), ids.size(), g.data());
    auto rows = pull_rows(c, "t", ids);
    EXPECT_EQ(rows, (std::vector<float>{-1101, -2202, -10, -20, -1101, -2202, -1101, -2202}));
    auto h = c.pull_async("t", ids.data(), ids.size(), rows.data());
    while (!h->done()) {
    }
    EXPECT_EQ(rows[0], -1101);
  });
}

TEST(PsTable, DenseTablesAreRangeShardedAndRefuseRowsOutside) {
  TableConfig cfg;
  cfg.dim = 2;
  cfg.dense = true;
  cfg.rows = 10;
  cfg.lr = 1.0f;
  run_job(3, 1, {}, [&](Client& c) {
    c.create_table("d", cfg);
    std::vector<uint64_t> ids = {0, 3, 4, 9};
    std::vector<float> g(8, 1.0f);
    c.push("d", ids.data(), ids.size(), g.data());
    EXPECT_EQ(pull_rows(c, "d", ids), std::vector<float>(8, -1.0f));
    EXPECT_EQ(c.stats("d").rows, 10u);
    std::vector<uint64_t> bad = {2, 10};
    try {
      pull_rows(c, "d", bad);
      FAIL() << "row 10 of a 10-row table was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("row 10 is outside the dense table's 10 rows"), std::string::npos)
          << e.what();
    }
    EXPECT_EQ(pull_rows(c, "d", {9}), std::vector<float>(2, -1.0f));  // still serving
  });
}

TEST(PsErrors, BadNamesDimensionsAndOversizedRequestsAreRefusedAndTheServerServesOn) {
  // Read at each server start (max_request_setting), so this holds however the tests are run.
  ::setenv("COHORT_PS_MAX_REQUEST", "65536", 1);
  TableConfig cfg;
  cfg.dim = 8;
  run_job(2, 2, {}, [&](Client& c) {
    c.create_table("emb", cfg);
    try {
      pull_rows(c, "nope", {1});
      FAIL() << "unknown table accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("no table 'nope'"), std::string::npos) << e.what();
    }
    TableConfig other = cfg;
    other.dim = 16;
    try {
      c.create_table("emb", other);
      FAIL() << "a second declaration with another dim was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("dim 8 (asked: 16)"), std::string::npos) << e.what();
    }
    std::vector<uint64_t> many(20000);
    for (size_t i = 0; i < many.size(); ++i) many[i] = i;
    std::vector<float> rows(many.size() * 8);
    try {
      c.pull("emb", many.data(), many.size(), rows.data());
      FAIL() << "an oversized request was sent";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("COHORT_PS_MAX_REQUEST"), std::string::npos) << e.what();
    }
    try {
      c.create_table(std::string(80, 'x'), cfg);
      FAIL() << "an 80-character name was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("1 to 63 characters"), std::string::npos) << e.what();
    }
    EXPECT_EQ(pull_rows(c, "emb", {1, 2}), std::vector<float>(16, 0.0f));  // still serving
  });
  ::unsetenv("COHORT_PS_MAX_REQUEST");
}

// A handle that outlives its Client: closing the client completed the pull on the way (its rows are
// in the buffer), and the handle answers from it; no use of the freed client (ASan checks this in
// CI). Through messages, so that the pull is still in flight when the client closes.
TEST(PsClient, AHandleThatOutlivesItsClientAnswersFromItsOperation) {
  DirectSetting setting(false);
  TableConfig cfg;
  cfg.dim = 2;
  cfg.init = Initializer::kConstant;
  cfg.init_a = 0.5f;
  auto store = make_memory_store();
  const Roles roles{2, 1};
  test::run_ranks(3, [&](int r) {
    if (r < 2) return serve(store, r, roles, {}, kTimeout);
    auto c = Client::create(store, 0, roles, kTimeout);
    c->create_table("t", cfg);
    const std::vector<uint64_t> ids = {1, 2, 3, 4, 5, 6};
    std::vector<float> rows(ids.size() * 2, 0.0f);
    std::shared_ptr<Handle> h = c->pull_async("t", ids.data(), ids.size(), rows.data());
    c.reset();
    EXPECT_TRUE(h->done());
    h->wait();
    EXPECT_EQ(rows, std::vector<float>(12, 0.5f));
  });
}

// expected_rows that no host's memory can hold (2^40 rows of 67 bytes, halved over 2 servers) is
// refused at create_table with the figures, and the servers serve on.
TEST(PsErrors, ExpectedRowsBeyondTheHostsMemoryAreRefusedAtCreateTable) {
  TableConfig cfg;
  cfg.dim = 2;
  cfg.expected_rows = uint64_t(1) << 40;
  run_job(2, 1, {}, [&](Client& c) {
    try {
      c.create_table("huge", cfg);
      FAIL() << "a table for 2^40 rows was created";
    } catch (const InvalidArgument& e) {
      const std::string what = e.what();
      // 2^39 each, and 1/64 more for the hash's spread; 24 bytes a row and 43 of index (bytes_per_row)
      EXPECT_NE(what.find("table 'huge': 558345748480 rows on this server (its share of expected_rows) at 67 bytes a "
                          "row make 34840.0 GiB, more than this host's memory ("),
                std::string::npos)
          << what;
      EXPECT_NE(what.find("lower expected_rows or add servers"), std::string::npos) << what;
    }
    cfg.expected_rows = 1000;
    c.create_table("fits", cfg);
    EXPECT_EQ(pull_rows(c, "fits", {1}), std::vector<float>(2, 0.0f));
  });
}

TEST(PsMemory, BytesPerRowAreAsStated) {
  for (auto storage : {DataType::kFloat32, DataType::kFloat16, DataType::kBFloat16}) {
    TableConfig cfg;
    cfg.dim = 16;
    cfg.optimizer = Optimizer::kAdagrad;
    cfg.storage = storage;
    run_job(2, 1, {}, [&](Client& c) {
      c.create_table("m", cfg);
      std::vector<uint64_t> ids(100000);
      for (size_t i = 0; i < ids.size(); ++i) ids[i] = i * 2654435761ull;
      std::vector<float> g(ids.size() * 16, 0.5f);
      for (size_t off = 0; off < ids.size(); off += 25000)
        c.push("m", ids.data() + off, 25000, g.data() + off * 16);
      TableStats s = c.stats("m");
      EXPECT_EQ(s.rows, ids.size());
      EXPECT_EQ(s.applied_rows, ids.size());
      // As stated: bytes_per_row each, plus each server's last arena chunk (2 MiB), partly empty.
      double per_row = double(s.bytes) / double(s.rows);
      EXPECT_LE(double(s.bytes), double(s.rows * bytes_per_row(cfg)) + 2 * double(2 << 20)) << "storage " << int(storage);
      EXPECT_GE(per_row, double(bytes_per_row(cfg) - 32));
      // fp16 rows round-trip to within fp16's precision.
      auto rows = pull_rows(c, "m", {ids[7]});
      EXPECT_NEAR(rows[0], -0.01f, storage == DataType::kFloat32 ? 1e-6 : 1e-3);
    });
  }
}

// expected_rows sizes a shard's index up front: creating that many rows never doubles it (each doubling
// pauses every process that creates rows), while a shard without the hint doubles as it fills.
TEST(PsMemory, ExpectedRowsSizeTheIndexSoThatItNeverDoubles) {
  TableConfig cfg;
  cfg.dim = 4;
  std::vector<uint64_t> ids(50000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = i * 0x9e3779b97f4a7c15ull;
  std::vector<float> g(ids.size() * 4, 1.0f);
  TableShard hinted("h", cfg, 0, 0, kTimeout, ids.size());
  hinted.apply(ids.data(), ids.size(), g.data());
  EXPECT_EQ(hinted.rows(), ids.size());
  EXPECT_EQ(hinted.index_doublings(), 0u);
  TableShard plain("p", cfg, 0, 0, kTimeout);
  plain.apply(ids.data(), ids.size(), g.data());
  EXPECT_EQ(plain.index_doublings(), 7u);  // 1024 buckets to 131072
  // The hint is part of the table's configuration, refused for dense tables.
  // Through the servers: each sizes its index for its share. 100,000 rows on 2 servers: 50,000 (+1/64)
  // each, so 2^17 buckets of 16 bytes each, before any row exists (1024 buckets without the hint).
  cfg.expected_rows = 100000;
  run_job(2, 1, {}, [&](Client& c) {
    c.create_table("e", cfg);
    EXPECT_EQ(c.table("e").expected_rows, 100000u);
    EXPECT_EQ(c.stats("e").bytes, 2u * (1u << 17) * 16u);
    TableConfig unhinted = cfg;
    unhinted.expected_rows = 0;
    c.create_table("u", unhinted);
    EXPECT_EQ(c.stats("u").bytes, 2u * 1024u * 16u);
    TableConfig dense = cfg;
    dense.dense = true;
    dense.rows = 10;
    EXPECT_THROW(c.create_table("d", dense), InvalidArgument);
  });
}

TEST(PsSaveLoad, RoundTripFromOneServerToTwoKeepsRowsAndOptimizerState) {
  test::TempDir dir;
  TableConfig cfg;
  cfg.dim = 4;
  cfg.optimizer = Optimizer::kAdagrad;
  cfg.lr = 0.1f;
  TableConfig dense = cfg;
  dense.dense = true;
  dense.rows = 50;
  dense.optimizer = Optimizer::kAdam;
  std::vector<uint64_t> ids;
  for (uint64_t i = 0; i < 200; ++i) ids.push_back(i * 1000003);
  std::vector<uint64_t> rows50;
  for (uint64_t i = 0; i < 50; ++i) rows50.push_back(i);
  std::vector<float> g(ids.size() * 4), g2(ids.size() * 4);
  for (size_t i = 0; i < g.size(); ++i) {
    g[i] = std::cos(float(i));
    g2[i] = std::sin(float(i));
  }
  std::vector<float> after_a, dense_a;
  run_job(1, 1, {}, [&](Client& c) {
    c.create_table("sparse", cfg);
    c.create_table("dense", dense);
    c.push("sparse", ids.data(), ids.size(), g.data());
    c.push("dense", rows50.data(), 50, g.data());
    c.save(dir.path());
    // What the next step gives with the state as saved:
    c.push("sparse", ids.data(), ids.size(), g2.data());
    c.push("dense", rows50.data(), 50, g2.data());
    after_a = pull_rows(c, "sparse", ids);
    dense_a = pull_rows(c, "dense", rows50);
  });
  ASSERT_TRUE(std::filesystem::exists(dir.file("manifest.json")));
  ASSERT_TRUE(std::filesystem::exists(test_util::shards_dir(dir.path()) + "/sparse.shard-0-of-1"));
  run_job(2, 1, {}, [&](Client& c) {
    c.load(dir.path());
    EXPECT_EQ(c.stats("sparse").rows, ids.size());
    c.push("sparse", ids.data(), ids.size(), g2.data());
    c.push("dense", rows50.data(), 50, g2.data());
    EXPECT_EQ(pull_rows(c, "sparse", ids), after_a);
    EXPECT_EQ(pull_rows(c, "dense", rows50), dense_a);
  });
}

// A load replaces the tables that workers have mapped: every worker, the loading one and the
// others, then reads the loaded rows (the old shard is retired; they map the new one).
TEST(PsSaveLoad, ALoadReplacesTheRowsThatAttachedWorkersRead) {
  test::TempDir dir;
  TableConfig cfg;
  cfg.dim = 4;
  cfg.lr = 1.0f;
  const std::vector<uint64_t> ids = {5, 6, 1ull << 50};
  std::barrier sync(2);
  run_job(1, 2, {}, [&](Client& c) {
    c.create_table("t", cfg);
    std::vector<float> g(ids.size() * 4, 1.0f);
    if (c.worker_index() == 0) c.push("t", ids.data(), ids.size(), g.data());  // rows at -1
    sync.arrive_and_wait();
    EXPECT_EQ(pull_rows(c, "t", ids), std::vector<float>(12, -1.0f));  // both mapped the shard
    sync.arrive_and_wait();
    if (c.worker_index() == 0) c.save(dir.path());
    sync.arrive_and_wait();
    c.push("t", ids.data(), ids.size(), g.data());  // each: -1 more, so -3
    sync.arrive_and_wait();
    EXPECT_EQ(pull_rows(c, "t", ids), std::vector<float>(12, -3.0f));
    sync.arrive_and_wait();
    if (c.worker_index() == 1) c.load(dir.path());
    sync.arrive_and_wait();
    EXPECT_EQ(pull_rows(c, "t", ids), std::vector<float>(12, -1.0f)) << "worker " << c.worker_index();
    sync.arrive_and_wait();
    c.push("t", ids.data(), ids.size(), g.data());
    sync.arrive_and_wait();
    EXPECT_EQ(pull_rows(c, "t", ids), std::vector<float>(12, -3.0f)) << "worker " << c.worker_index();
    if (c.worker_index() == 0) {
      EXPECT_EQ(c.stats("t").direct_applied_rows, 6u);  // the two pushes after the load
    }
  });
}

// bsp: a save after step() holds every worker's pushes of that step, though they are applied only
// when the last worker's step reaches the server (the save waits for it, like a pull).
TEST(PsSaveLoad, BspSaveAfterAStepHoldsEveryWorkersPushesOfIt) {
  test::TempDir dir;
  TableConfig cfg;
  cfg.dim = 1;
  cfg.lr = 1.0f;
  const std::vector<uint64_t> ids = {11, 12};
  run_job(2, 2, ConsistencyMode::parse("bsp"), [&](Client& c) {
    c.create_table("t", cfg);
    std::vector<float> g = {1.0f, 2.0f};
    if (c.worker_index() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));  // its step comes last
    c.push("t", ids.data(), ids.size(), g.data());
    c.step();
    if (c.worker_index() == 0) c.save(dir.path());
  });
  run_job(1, 1, {}, [&](Client& c) {
    c.load(dir.path());
    EXPECT_EQ(pull_rows(c, "t", ids), (std::vector<float>{-2.0f, -4.0f}));
  });
}

TEST(PsMode, ParsesTheThreeModesAndRefusesOthers) {
  EXPECT_EQ(ConsistencyMode::parse("async").mode, Mode::kAsync);
  EXPECT_EQ(ConsistencyMode::parse("bsp").mode, Mode::kBsp);
  auto s = ConsistencyMode::parse("stale:3");
  EXPECT_EQ(s.mode, Mode::kStale);
  EXPECT_EQ(s.staleness, 3);
  EXPECT_EQ(s.to_string(), "stale:3");
  EXPECT_EQ(ConsistencyMode::parse("stale:0").mode, Mode::kBsp);
  EXPECT_THROW(ConsistencyMode::parse("sync"), ConfigError);
  EXPECT_THROW(ConsistencyMode::parse("stale:-1"), ConfigError);
  EXPECT_THROW(ConsistencyMode::parse("stale:x"), ConfigError);
}

}  // namespace
}  // namespace cohort::ps
