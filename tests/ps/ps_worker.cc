// A worker of the parameter-server launch tests (tests/ps/ps_launch_test.cc), started by
// `cohort run --ps N ... ps_worker MODE`:
//   basic  create a table, push known gradients, check what a pull returns, print "worker I ok"
//   loop   pull and push until something fails (the test kills a server meanwhile)
//   serve  for --ps-server program: a server meets the other servers through its own world
//          communicator, then runs cohort::ps::serve_from_env(); a worker runs basic
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "cohort/ps.h"

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
    return basic();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ps_worker: %s\n", e.what());
    return 1;
  }
}
