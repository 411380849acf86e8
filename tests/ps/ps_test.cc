// The parameter server's tables and requests, with servers and workers as threads of one process (real
// transports over loopback and shared memory, a memory store): sharding, initializers, duplicate ids,
// dense tables, memory per row, and refused requests. The consistency modes are in
// ps_consistency_test.cc, workers on the server's host in ps_shared_rows_test.cc and
// ps_holders_test.cc, save and load in ps_save_load_test.cc.
#include <gtest/gtest.h>

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "cohort/error.h"
#include "cohort/ps.h"
#include "ps/sharding.h"
#include "ps/table.h"
#include "ps/wire.h"
#include "ps_test_util.h"
#include "store/memory_store.h"
#include "support/test_support.h"

namespace cohort::ps {
namespace {

using test_util::kTimeout;
using test_util::pull_rows;
using test_util::run_job;
using test_util::DirectSetting;

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

}  // namespace
}  // namespace cohort::ps
