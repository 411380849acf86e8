// The parameter server's consistency modes (async, bsp, stale:K; ConsistencyMode), with servers and
// workers as threads of one process: async loses no push on either path, bsp equals a single-process
// reference at every step, stale:K keeps every pull within K steps of the slowest worker.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include "cohort/error.h"
#include "cohort/ps.h"
#include "ps/table.h"
#include "ps_test_util.h"

namespace cohort::ps {
namespace {

using test_util::kTimeout;
using test_util::pull_rows;
using test_util::run_job;
using test_util::DirectSetting;

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
