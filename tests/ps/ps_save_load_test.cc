// Save and load: a round trip from one server count to another keeps rows and optimizer state, a load
// replaces the rows attached workers read, a bsp save holds a whole step. And when something is wrong:
// damaged manifests and shard files, a directory a server cannot write, rows created while a save runs.
// A load or save is all or nothing across the servers
// (staged, then committed), the worker gets one error naming the server, the file and what was wrong,
// and the servers serve on.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "cohort/error.h"
#include "ps/sharding.h"
#include "ps_test_util.h"

namespace cohort::ps {
namespace {

namespace fs = std::filesystem;
using test_util::pull_rows;
using test_util::refusal;
using test_util::run_job;
using test_util::shards_dir;

std::string slurp(const std::string& path) { return test::read_file(path); }

// A shard file's header line and its records (8-byte id, then dim values and the optimizer's state).
struct ShardFile {
  nlohmann::json head;
  size_t head_bytes = 0;
  std::string records;
};
ShardFile read_shard(const std::string& path) {
  std::string all = slurp(path);
  const size_t nl = all.find('\n');
  EXPECT_NE(nl, std::string::npos) << path;
  ShardFile f;
  f.head = nlohmann::json::parse(all.substr(0, nl));
  f.head_bytes = nl + 1;
  f.records = all.substr(nl + 1);
  return f;
}

TEST(PsSaveLoad, ABadManifestOrShardFileIsOneErrorNamingItAndEveryServerKeepsItsTables) {
  test::TempDir tmp;
  const std::string good = tmp.file("good");
  TableConfig cfg;
  cfg.dim = 4;
  cfg.lr = 1.0f;
  TableConfig dense = cfg;
  dense.dense = true;
  dense.rows = 20;
  std::vector<uint64_t> ids, rows20;
  for (uint64_t i = 0; i < 200; ++i) ids.push_back(i * 7919 + 3);
  for (uint64_t i = 0; i < 20; ++i) rows20.push_back(i);
  std::vector<float> g(ids.size() * 4, 1.0f);
  // Each case: a copy of the good save, damaged; the file the error names; what it says.
  struct Case {
    const char* what;
    std::function<void(const std::string& dir)> damage;
    std::string file;
    std::string expect;
  };
  const size_t record = 8 + 4 * 4;
  auto edit = [](const std::string& path, const std::function<void(std::string&)>& f) {
    std::string text = slurp(path);
    f(text);
    test::write_file(path, text);
  };
  auto manifest_with = [&](const std::string& key, const nlohmann::json& value) {
    return [=](const std::string& dir) {
      edit(dir + "/manifest.json", [&](std::string& text) {
        auto j = nlohmann::json::parse(text);
        j["tables"]["t"][key] = value;
        text = j.dump();
      });
    };
  };
  const std::vector<Case> cases = {
      {"no manifest", [](const std::string& dir) { fs::remove(dir + "/manifest.json"); }, "manifest.json",
       "cannot open it: No such file or directory"},
      {"a manifest that is not JSON", [](const std::string& dir) { test::write_file(dir + "/manifest.json", "{tables"); },
       "manifest.json", "is not valid JSON"},
      {"a table of dim 0", manifest_with("dim", 0), "manifest.json", "table 't': dim 0: expected 1 to 1048576"},
      {"an unknown optimizer", manifest_with("optimizer", "rmsprop"), "manifest.json",
       "table 't': optimizer 'rmsprop': expected sgd, adagrad or adam"},
      {"a missing shard", [](const std::string& dir) { fs::remove(shards_dir(dir) + "/t.shard-1-of-2"); }, "t.shard-1-of-2",
       "cannot open it: No such file or directory"},
      {"a truncated shard",
       [&](const std::string& dir) { edit(shards_dir(dir) + "/t.shard-1-of-2", [](std::string& t) { t.resize(t.size() - 10); }); },
       "t.shard-1-of-2", "rows its header counts"},
      {"a shard whose header is not JSON",
       [&](const std::string& dir) { edit(shards_dir(dir) + "/t.shard-0-of-2", [](std::string& t) { t[0] = 'x'; }); },
       "t.shard-0-of-2", "header line is not valid JSON"},
      {"a shard with bytes after its rows",
       [&](const std::string& dir) { edit(shards_dir(dir) + "/t.shard-0-of-2", [](std::string& t) { t += "xyz"; }); },
       "t.shard-0-of-2", "holds more than the"},
      // Server 1's shard has one id twice. Only server 1 holds that id now, so only server 1 can
      // tell; server 0 stages its tables without fault and must drop them too.
      {"a shard with an id twice, seen by one server",
       [&](const std::string& dir) {
         edit(shards_dir(dir) + "/t.shard-1-of-2", [&](std::string& t) {
           const size_t first = t.find('\n') + 1;
           std::memcpy(t.data() + first + record, t.data() + first, 8);  // record 1's id := record 0's
         });
       },
       "t.shard-1-of-2", "row 1: id"},
  };
  run_job(2, 1, {}, [&](Client& c) {
    c.create_table("t", cfg);
    c.create_table("d", dense);
    c.push("t", ids.data(), ids.size(), g.data());
    c.push("d", rows20.data(), rows20.size(), g.data());
    c.save(good);  // rows at -1
    c.push("t", ids.data(), ids.size(), g.data());
    c.push("d", rows20.data(), rows20.size(), g.data());  // now -2: what a failed load must leave
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& k = cases[i];
      const std::string bad = tmp.file("bad" + std::to_string(i));
      fs::copy(good, bad, fs::copy_options::recursive);
      // The manifest, or a shard in the folder the manifest names.
      const std::string file = (k.file == "manifest.json" ? bad : shards_dir(bad)) + "/" + k.file;
      k.damage(bad);
      const std::string m = refusal([&] { c.load(bad); });
      EXPECT_NE(m.find("load: " + file + ": "), std::string::npos) << k.what << ": " << m;
      EXPECT_NE(m.find(k.expect), std::string::npos) << k.what << ": " << m;
      EXPECT_EQ(m.rfind("parameter server ", 0), 0u) << k.what << ": " << m;
      EXPECT_EQ(m.find('\n'), std::string::npos) << k.what << ": " << m;
      // All or nothing: every server still serves its old rows, of both tables.
      ASSERT_EQ(pull_rows(c, "t", ids), std::vector<float>(ids.size() * 4, -2.0f)) << "after " << k.what;
      ASSERT_EQ(pull_rows(c, "d", rows20), std::vector<float>(rows20.size() * 4, -2.0f)) << "after " << k.what;
      EXPECT_EQ(c.stats("t").rows, ids.size()) << "after " << k.what;
    }
    c.load(good);
    EXPECT_EQ(pull_rows(c, "t", ids), std::vector<float>(ids.size() * 4, -1.0f));
    EXPECT_EQ(pull_rows(c, "d", rows20), std::vector<float>(rows20.size() * 4, -1.0f));
  });
}

// Configurations from a manifest pass the checks of create_table: one outside them (here a dense
// table of 2^50 rows, which no server could hold) is refused before any table is made.
TEST(PsSaveLoad, AManifestConfigurationPassesTheChecksOfANewTable) {
  test::TempDir tmp;
  TableConfig cfg;
  cfg.dim = 2;
  run_job(1, 1, {}, [&](Client& c) {
    c.create_table("t", cfg);
    c.save(tmp.path());
    auto j = nlohmann::json::parse(slurp(tmp.file("manifest.json")));
    j["tables"]["t"]["dense"] = true;
    j["tables"]["t"]["rows"] = uint64_t{1} << 50;
    test::write_file(tmp.file("manifest.json"), j.dump());
    const std::string m = refusal([&] { c.load(tmp.path()); });
    EXPECT_NE(m.find("load: " + tmp.file("manifest.json") + ": table 't': "), std::string::npos) << m;
    EXPECT_NE(m.find("a dense table holds at most 2^44 values"), std::string::npos) << m;
    EXPECT_EQ(c.table("t").dense, false);
  });
}

// A save that one server cannot write is one error naming that server, the file and why; the other
// server's shard is deleted again, and the directory still holds the previous save whole. Server 1
// holds 1000 rows, server 0 one, and no file may grow past 8 KiB: only server 1's disk is "full".
TEST(PsSaveLoad, ASaveThatOneServerCannotWriteIsOneErrorAndThePreviousSaveStaysWhole) {
  test::TempDir tmp;
  TableConfig cfg;
  cfg.dim = 2;
  cfg.lr = 1.0f;
  std::vector<uint64_t> ids;
  for (uint64_t id = 0; ids.size() < 1000; ++id)
    if (shard_of_id(id, 2) == 1) ids.push_back(id);
  for (uint64_t id = 0;; ++id)
    if (shard_of_id(id, 2) == 0) {
      ids.push_back(id);
      break;
    }
  std::vector<float> g(ids.size() * 2, 1.0f);
  const std::string dir = tmp.file("ckpt");
  run_job(2, 1, {}, [&](Client& c) {
    c.create_table("t", cfg);
    c.push("t", ids.data(), ids.size(), g.data());
    c.save(dir);  // rows at -1
    const std::string good = shards_dir(dir);
    c.push("t", ids.data(), ids.size(), g.data());  // -2
    std::string m;
    {
      test_util::FileSizeLimit full(8192);
      m = refusal([&] { c.save(dir); });
    }
    EXPECT_EQ(m.rfind("parameter server 1: save: " + dir + "/shards-", 0), 0u) << m;
    EXPECT_NE(m.find("/t.shard-1-of-2: cannot write it: File too large"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    std::vector<std::string> left;
    for (const auto& e : fs::directory_iterator(dir)) left.push_back(e.path().filename().string());
    std::sort(left.begin(), left.end());
    EXPECT_EQ(left, (std::vector<std::string>{"manifest.json", fs::path(good).filename().string()}))
        << "the failed save left files behind";
    c.load(dir);
    EXPECT_EQ(pull_rows(c, "t", ids), std::vector<float>(ids.size() * 2, -1.0f)) << "the previous save was mixed "
                                                                                   "with the failed one";
    // A directory that cannot be made (its parent is a file) is one error naming it; the servers serve on.
    test::write_file(tmp.file("file"), "x");
    const std::string m2 = refusal([&] { c.save(tmp.file("file") + "/sub"); });
    EXPECT_NE(m2.find("save: " + tmp.file("file") + "/sub/shards-"), std::string::npos) << m2;
    EXPECT_NE(m2.find(": cannot create the directory: Not a directory"), std::string::npos) << m2;
    EXPECT_EQ(pull_rows(c, "t", ids), std::vector<float>(ids.size() * 2, -1.0f));
  });
}

// Workers on the server's host create rows in its shared memory while it saves: each file's header
// counts exactly the rows the file holds (a row created meanwhile is in the file or not counted), and
// a load of it has those rows. A race, so many saves: kJobs jobs of kSaves each, every job with a
// fresh table so that the files stay small. (Before the header counted the records written, 18 of 20
// runs on a 2-core machine had saves whose header counted fewer rows than the file held, 1 to 14 of
// 160; the other two had none.)
TEST(PsSaveLoad, ASaveCountsTheRowsItWroteWhileWorkersCreateRows) {
  // In memory where there is a tmpfs: a save syncs its files, and this test makes 160 of them.
  const char* tmpdir = std::getenv("TMPDIR");
  test_util::ScopedEnv in_memory("TMPDIR", fs::is_directory("/dev/shm") ? "/dev/shm" : tmpdir ? tmpdir : "/tmp");
  test::TempDir tmp;
  TableConfig cfg;
  cfg.dim = 2;
  cfg.lr = 1.0f;
  constexpr int kJobs = 40, kSaves = 4;
  // Workers 1 and 2 create rows all along (up to kRows each). Two, so that one is creating rows at
  // almost any moment (they take turns at the insert lock), and so that the server's thread is
  // preempted now and then on a machine with few cores.
  constexpr uint64_t kRows = 200000;
  const size_t record = 8 + 2 * 4;
  int checked = 0, grew = 0;
  for (int job = 0; job < kJobs; ++job) {
    std::atomic<bool> saving{false}, stop{false};
    std::atomic<int> stopped{0};
    std::vector<uint64_t> counted(kSaves);
    uint64_t loaded_rows = 0;
    run_job(1, 3, {}, [&](Client& c) {
      c.create_table("t", cfg);
      if (c.worker_index() > 0) {
        std::vector<uint64_t> ids(256);
        std::vector<float> g(ids.size() * 2, 1.0f);
        const uint64_t first = uint64_t(c.worker_index()) << 32;
        uint64_t next = first;
        while (!stop.load()) {
          if (!saving.load() || next >= first + kRows) {
            std::this_thread::yield();
            continue;
          }
          for (auto& id : ids) id = next++;
          c.push("t", ids.data(), ids.size(), g.data());
        }
        ++stopped;  // no push of its own can reach the loaded table
        return;
      }
      saving = true;
      for (int s = 0; s < kSaves; ++s) {
        const std::string dir = tmp.file("s" + std::to_string(s));
        c.save(dir);
        ShardFile f = read_shard(shards_dir(dir) + "/t.shard-0-of-1");
        counted[size_t(s)] = f.head.at("rows").get<uint64_t>();
        EXPECT_EQ(f.records.size(), counted[size_t(s)] * record)
            << "job " << job << " save " << s << ": its header counts " << counted[size_t(s)]
            << " rows, the file holds " << double(f.records.size()) / double(record);
        ++checked;
        if (s + 1 < kSaves) fs::remove_all(dir);
      }
      stop = true;
      while (stopped.load() < 2) std::this_thread::yield();
      c.load(tmp.file("s" + std::to_string(kSaves - 1)));
      loaded_rows = c.stats("t").rows;
    });
    fs::remove_all(tmp.file("s" + std::to_string(kSaves - 1)));
    EXPECT_EQ(loaded_rows, counted.back()) << "job " << job;
    grew += counted.back() > counted.front();
  }
  EXPECT_EQ(checked, kJobs * kSaves);
  EXPECT_GT(grew, 0) << "no rows were created during the saves";
}


// ---- the ways that work: across server counts, under attached workers, after a bsp step ----

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

}  // namespace
}  // namespace cohort::ps
