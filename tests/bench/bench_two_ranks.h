#pragma once
// `cohort bench` as two real processes meeting through torchrun-style variables (rank 0 hosts the
// store): what the bench tests run their cases with.
#include <string>
#include <thread>
#include <vector>

#include "support/test_support.h"

namespace cohort::test {

struct TwoRanks {
  ProcessResult rank0, rank1;
};

// cpus: empty, or "taskset -c" lists for rank 0 and rank 1 (each rank bound as cohort run binds).
inline TwoRanks run_two(const std::vector<std::string>& bench_args, const std::vector<std::string>& extra_env = {},
                        const std::vector<std::string>& cpus = {}) {
  const std::string port = std::to_string(free_port());
  TwoRanks out;
  auto run = [&](int rank, ProcessResult* res) {
    std::vector<std::string> argv;
    if (!cpus.empty()) argv = {"taskset", "-c", cpus[size_t(rank)]};
    argv.push_back(cohort_tool());
    argv.insert(argv.end(), bench_args.begin(), bench_args.end());
    std::vector<std::string> env = {"MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port, "RANK=" + std::to_string(rank),
                                    "WORLD_SIZE=2", "COHORT_TIMEOUT=60"};
    env.insert(env.end(), extra_env.begin(), extra_env.end());
    *res = run_process(argv, env, 90);
  };
  std::thread t1(run, 1, &out.rank1);
  run(0, &out.rank0);
  t1.join();
  return out;
}

}  // namespace cohort::test
