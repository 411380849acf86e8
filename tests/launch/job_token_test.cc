// The job token of `cohort run --token-file FILE` (docs/security.md): the file must be its owner's
// alone, and its token is the job's (every worker's COHORT_JOB_TOKEN, the key of the store and of the
// ranks' TCP hello). The hostile side, across hosts, is tests/multihost/test_auth.sh.
#include <sys/stat.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "support/test_support.h"

namespace cohort::test {
namespace {

TEST(JobToken, ATokenFileOthersCanReadIsRefused) {
  TempDir dir;
  const std::string file = dir.file("token");
  write_file(file, "0123456789abcdef\n");
  ASSERT_EQ(::chmod(file.c_str(), 0644), 0);
  auto r = run_process({cohort_tool(), "run", "--token-file", file, "-n", "1", "/bin/true"}, {}, 30);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--token-file " + file + ": mode 0644"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("chmod 600 " + file), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST(JobToken, EveryWorkerGetsTheTokenOfTheFile) {
  TempDir dir;
  const std::string file = dir.file("token");
  write_file(file, "0123456789abcdef\n");
  ASSERT_EQ(::chmod(file.c_str(), 0600), 0);
  auto r = run_process({cohort_tool(), "run", "--token-file", file, "-n", "2", "/bin/sh", "-c",
                        "echo \"$COHORT_JOB_TOKEN\" > " + dir.path() + "/seen.$RANK"},
                       {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(read_file(dir.file("seen.0")), "0123456789abcdef\n");
  EXPECT_EQ(read_file(dir.file("seen.1")), "0123456789abcdef\n");
}

// --dry-run says where a per-node job's token comes from, and that a job without one is open.
TEST(JobToken, TheDryRunSaysWhereTheTokenComesFrom) {
  TempDir dir;
  const std::string file = dir.file("token");
  write_file(file, "0123456789abcdef\n");
  ASSERT_EQ(::chmod(file.c_str(), 0600), 0);
  const std::vector<std::string> per_node = {cohort_tool(), "run", "--dry-run", "--nnodes", "2", "--node-rank", "1",
                                             "--master-addr", "127.0.0.1", "--master-port", "29400",
                                             "--nproc-per-node", "1"};
  auto with = per_node;
  with.insert(with.end(), {"--token-file", file, "/bin/true"});
  auto r = run_process(with, {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("job token       from --token-file " + file), std::string::npos) << r.out;
  auto without = per_node;
  without.push_back("/bin/true");
  r = run_process(without, {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("job token       none: the job is open"), std::string::npos) << r.out;
  // A task of an srun step: node 0 makes the token and the others decode it through munge.
  r = run_process({cohort_tool(), "run", "--dry-run", "--nproc-per-node", "1", "/bin/true"},
                  {"SLURM_JOB_ID=7", "SLURM_STEP_ID=0", "SLURM_STEP_NODELIST=h[0-1]", "SLURMD_NODENAME=h1",
                   "SLURM_STEP_TASKS_PER_NODE=1(x2)"},
                  30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("job token       made by node 0's launcher, through munge to the others"), std::string::npos)
      << r.out;
}

}  // namespace
}  // namespace cohort::test
