// Workers on the server's host pull and push through the shard's shared rows themselves (table.h):
// concurrent pushes to hot rows while the index grows lose nothing, and a pull never sees half a push.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <random>
#include <set>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cohort/ps.h"
#include "ps_test_util.h"

namespace cohort::ps {
namespace {

using test_util::kTimeout;
using test_util::pull_rows;
using test_util::run_job;

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

}  // namespace
}  // namespace cohort::ps
