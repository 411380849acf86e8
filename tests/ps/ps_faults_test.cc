// Faults that must cost only the request that met them: a deferred pull whose answer fails, and a
// save or load that meets a full disk, a rename that fails or a row lock held past the timeout. The
// worker that asked gets the error; every server serves on; the last good checkpoint still loads.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

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

// run_job with its own mode and timeout (servers' lock waits and workers' replies).
void run_job(int servers, int workers, ConsistencyMode mode, std::chrono::milliseconds timeout,
             const std::function<void(Client&)>& body) {
  auto store = make_memory_store();
  Roles roles{servers, workers};
  test::run_ranks(servers + workers, [&](int r) {
    if (r < servers) return serve(store, r, roles, mode, timeout);
    auto client = Client::create(store, r - servers, roles, timeout);
    body(*client);
  });
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

}  // namespace
}  // namespace cohort::ps
