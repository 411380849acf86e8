// A worker of the parameter-server launch tests (tests/ps/ps_launch_test.cc), started by
// `cohort run --ps N ... ps_worker MODE`:
//   basic  create a table, push known gradients, check what a pull returns, print "worker I ok"
//   loop   pull and push until something fails (the test kills a server meanwhile)
//   serve  for --ps-server program: a server meets the other servers through its own world
//          communicator, then runs cohort::ps::serve_from_env(); a worker runs basic
// and, started by tests/ps/ps_test.cc (not through the launcher) as worker WORKER of a job whose
// servers and other workers are the test's threads, meeting in the file store STORE:
//   hold STORE WORKER SERVERS WORKERS          pushes a gradient of ones to row 7 of table "big"
//          (dim 2^20, SGD, lr 1: a push writes 4 MiB in place) until killed; the test stops it
//          while it writes the row
//   create-rows STORE WORKER SERVERS WORKERS   pushes to fresh ids of table "fresh" (dim 4) until
//          killed, so that it mostly holds the lock that creates rows
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "cohort/ps.h"
#include "store/tcp_store.h"

namespace {

int basic() {
  auto ps = cohort::ps::Client::from_env();
  cohort::ps::TableConfig cfg;
  cfg.dim = 4;
  cfg.lr = 1.0f;
  ps->create_table("emb", cfg);
  std::vector<uint64_t> ids = {1, 2, 3, 1000000007};
  std::vector<float> grads(ids.size() * 4, 1.0f);
  ps->push("emb", ids.data(), ids.size(), grads.data());
  ps->step();
  std::vector<float> rows(ids.size() * 4);
  ps->pull("emb", ids.data(), ids.size(), rows.data());
  // Every worker pushed -1 once; in bsp mode all of them are in by now.
  for (float v : rows)
    if (v > -1.0f || v < -float(ps->num_workers())) {
      std::fprintf(stderr, "worker %d: unexpected value %g\n", ps->worker_index(), v);
      return 1;
    }
  std::printf("worker %d of %d ok (%d servers, mode %s, RANK=%s WORLD_SIZE=%s)\n", ps->worker_index(),
              ps->num_workers(), ps->num_servers(), ps->mode().to_string().c_str(), std::getenv("RANK"),
              std::getenv("WORLD_SIZE"));
  return 0;
}

int loop() {
  auto ps = cohort::ps::Client::from_env();
  cohort::ps::TableConfig cfg;
  cfg.dim = 16;
  ps->create_table("emb", cfg);
  std::vector<uint64_t> ids(256);
  std::vector<float> rows(ids.size() * 16), grads(ids.size() * 16, 0.01f);
  std::printf("worker %d looping\n", ps->worker_index());
  std::fflush(stdout);
  for (uint64_t step = 0;; ++step) {
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = step * 7 + i * 131;
    ps->pull("emb", ids.data(), ids.size(), rows.data());
    ps->push("emb", ids.data(), ids.size(), grads.data());
    ps->step();
  }
}

std::unique_ptr<cohort::ps::Client> file_store_client(char** argv) {
  std::printf("worker %s starting\n", argv[3]);  // a test may then join with a short timeout
  std::fflush(stdout);
  cohort::ps::Roles roles{std::atoi(argv[4]), std::atoi(argv[5])};
  return cohort::ps::Client::create(cohort::make_file_store(argv[2]), std::atoi(argv[3]), roles,
                                    std::chrono::seconds(20));
}

int hold(char** argv) {
  auto ps = file_store_client(argv);
  cohort::ps::TableConfig cfg;
  cfg.dim = 1u << 20;
  cfg.lr = 1.0f;
  ps->create_table("big", cfg);
  const uint64_t id = 7;
  std::vector<float> ones(cfg.dim, 1.0f);
  ps->push("big", &id, 1, ones.data());  // the row exists, and this worker has mapped the table
  std::printf("worker %d holding row 7\n", ps->worker_index());
  std::fflush(stdout);
  for (;;) ps->push("big", &id, 1, ones.data());
}

int create_rows(char** argv) {
  auto ps = file_store_client(argv);
  cohort::ps::TableConfig cfg;
  cfg.dim = 4;
  ps->create_table("fresh", cfg);
  std::vector<uint64_t> ids(4096);
  std::vector<float> grads(ids.size() * cfg.dim, 1.0f);
  for (uint64_t next = uint64_t(1) << 40, pushes = 0;; ++pushes) {
    for (auto& id : ids) id = next++;
    ps->push("fresh", ids.data(), ids.size(), grads.data());
    if (pushes == 0) {  // this worker has mapped the table, before anyone else
      std::printf("worker %d creating rows\n", ps->worker_index());
      std::fflush(stdout);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "basic";
  try {
    const char* role = std::getenv("COHORT_ROLE");
    if (mode == "serve" && role && std::strcmp(role, "server") == 0) {
      // The servers' own world (RANK/WORLD_SIZE count servers): it must not meet the workers'.
      auto servers = cohort::Communicator::from_env();
      int one = 1, count = 0;
      servers->allreduce(&one, &count, 1, cohort::DataType::kInt32, cohort::ReduceOp::kSum);
      std::printf("server %d of %d: %d servers met\n", servers->rank(), servers->size(), count);
      std::fflush(stdout);
      cohort::ps::serve_from_env();
      return 0;
    }
    if (mode == "loop") return loop();
    if ((mode == "hold" || mode == "create-rows") && argc == 6) return mode == "hold" ? hold(argv) : create_rows(argv);
    return basic();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ps_worker: %s\n", e.what());
    return 1;
  }
}
