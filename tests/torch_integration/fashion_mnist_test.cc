// The main job's program as a process: bad input gets one clear line; checkpoint, SIGKILL, resume
// ends with the same weights as an uninterrupted run (1 process, and 2 processes meeting through
// torchrun-style variables so no launcher is needed).
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>
#include <thread>

#include "support/test_support.h"

namespace {

using cohort::test::ProcessResult;
using cohort::test::run_process;

const std::string kProgram = COHORT_FASHION_MNIST;
const bool kHaveData = std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");

int lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

std::string digest_of(const ProcessResult& r) {
  std::smatch m;
  if (std::regex_search(r.out, m, std::regex("final weights digest: ([0-9a-f]+)"))) return m[1];
  return "";
}

TEST(FashionMnist, BadInputIsOneClearLine) {
  auto r = run_process({kProgram, "--data-dir", "/nonexistent"}, {}, 60);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("/nonexistent/train-images-idx3-ubyte.gz: no such file"), std::string::npos) << r.err;

  r = run_process({kProgram, "--model", "resnet"}, {}, 60);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("--model"), std::string::npos) << r.err;

  r = run_process({kProgram, "--batch", "0"}, {}, 60);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("--batch: must be at least 1, got 0"), std::string::npos) << r.err;

  r = run_process({kProgram, "--lr", "-0.1"}, {}, 60);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("--lr: must be positive, got -0.1"), std::string::npos) << r.err;
}

std::vector<std::string> small_job(const std::string& dir) {
  return {kProgram, "--model", "seed", "--train-samples", "1600", "--epochs", "2", "--checkpoint-dir", dir,
          "--checkpoint-every", "7", "--print-digest"};
}

TEST(FashionMnist, KillAndResumeOneProcess) {
  if (!kHaveData) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  cohort::test::TempDir tmp;
  auto full = run_process(small_job(tmp.file("a")), {}, 60);
  ASSERT_EQ(full.exit_code, 0) << full.err;
  EXPECT_NE(full.out.find("epoch: 0, step: 10, loss is "), std::string::npos) << full.out;
  EXPECT_NE(full.out.find("test accuracy: "), std::string::npos) << full.out;
  const std::string want = digest_of(full);
  ASSERT_FALSE(want.empty()) << full.out;

  auto args = small_job(tmp.file("b"));
  args.insert(args.end(), {"--kill-after-steps", "60"});  // 50 steps per epoch: dies in epoch 2, after checkpoint 56
  auto killed = run_process(args, {}, 60);
  EXPECT_EQ(killed.exit_code, 128 + 9) << killed.err;
  ASSERT_TRUE(std::filesystem::exists(tmp.file("b") + "/checkpoint.bin"));

  args = small_job(tmp.file("b"));
  args.push_back("--resume");
  auto resumed = run_process(args, {}, 60);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_NE(resumed.out.find("resuming from"), std::string::npos);
  EXPECT_NE(resumed.out.find("at epoch 1, step 6"), std::string::npos) << resumed.out;
  EXPECT_EQ(digest_of(resumed), want);
}

// Runs the job on `world` processes that meet through RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT.
std::vector<ProcessResult> run_ranks(int world, const std::vector<std::string>& args,
                                     const std::vector<std::string>& extra_env = {}) {
  const int port = cohort::test::free_port();
  std::vector<ProcessResult> results(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      std::vector<std::string> env = {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(world),
                                      "LOCAL_RANK=" + std::to_string(r), "LOCAL_WORLD_SIZE=" + std::to_string(world),
                                      "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port),
                                      "COHORT_TIMEOUT=30"};
      env.insert(env.end(), extra_env.begin(), extra_env.end());
      results[static_cast<size_t>(r)] = run_process(args, env, 90);
    });
  for (auto& t : threads) t.join();
  return results;
}
std::vector<ProcessResult> run_two_ranks(const std::vector<std::string>& args) { return run_ranks(2, args); }

TEST(FashionMnist, KillAndResumeTwoRanks) {
  if (!kHaveData) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  cohort::test::TempDir tmp;
  auto full = run_two_ranks(small_job(tmp.file("a")));
  ASSERT_EQ(full[0].exit_code, 0) << full[0].err;
  ASSERT_EQ(full[1].exit_code, 0) << full[1].err;
  const std::string want = digest_of(full[0]);
  ASSERT_FALSE(want.empty()) << full[0].out;
  EXPECT_EQ(full[1].out.find("loss is"), std::string::npos) << "only rank 0 prints";

  auto args = small_job(tmp.file("b"));
  args.insert(args.end(), {"--kill-after-steps", "30"});  // 25 steps per epoch per rank
  auto killed = run_two_ranks(args);
  EXPECT_EQ(killed[0].exit_code, 128 + 9) << killed[0].err;

  args = small_job(tmp.file("b"));
  args.push_back("--resume");
  auto resumed = run_two_ranks(args);
  ASSERT_EQ(resumed[0].exit_code, 0) << resumed[0].err;
  ASSERT_EQ(resumed[1].exit_code, 0) << resumed[1].err;
  EXPECT_NE(resumed[0].out.find("at epoch 1, step 3"), std::string::npos) << resumed[0].out;
  EXPECT_EQ(digest_of(resumed[0]), want);
}

// An elastic job's next generation: the same checkpoint directory, another world size, no --resume
// (a restart resumes by itself). The interrupted epoch goes on from its sample position.
TEST(FashionMnist, ARestartResumesByItselfAtAnotherWorldSize) {
  if (!kHaveData) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  cohort::test::TempDir tmp;
  auto args = small_job(tmp.file("b"));
  args.insert(args.end(), {"--kill-after-steps", "30"});  // 2 ranks: 25 steps per epoch; checkpoint at step 28
  auto killed = run_two_ranks(args);
  EXPECT_EQ(killed[0].exit_code, 128 + 9) << killed[0].err;

  auto resumed = run_ranks(3, small_job(tmp.file("b")), {"COHORT_RESTART_COUNT=1"});
  for (const auto& r : resumed) ASSERT_EQ(r.exit_code, 0) << r.err;
  // Step 28 = epoch 1, step 3 of 25: 3 steps x 32 x 2 ranks = 192 of the epoch's 1600 positions.
  EXPECT_NE(resumed[0].out.find("at epoch 1, step 3 (sample 192 of the epoch's 1600; written by 2 ranks, 3 now; "
                                "restart 1)"),
            std::string::npos)
      << resumed[0].out;
  // The rest of epoch 1 over 3 ranks: 1408 samples, 470 for rank 0, 15 steps of 32.
  EXPECT_NE(resumed[0].out.find("epoch: 1, step: 10, loss is"), std::string::npos) << resumed[0].out;
  EXPECT_NE(resumed[0].out.find("11/18"), std::string::npos) << resumed[0].out;  // 3 steps before, 15 now
  EXPECT_NE(resumed[0].out.find("1408 samples on 3 ranks"), std::string::npos) << resumed[0].out;  // none twice
  EXPECT_NE(resumed[0].out.find("test accuracy: "), std::string::npos) << resumed[0].out;

  // A restart with no checkpoint yet starts from the beginning, and says so.
  auto fresh = run_process(small_job(tmp.file("none")), {"COHORT_RESTART_COUNT=2"}, 60);
  ASSERT_EQ(fresh.exit_code, 0) << fresh.err;
  EXPECT_NE(fresh.out.find("restart 2: no checkpoint in"), std::string::npos) << fresh.out;
}

}  // namespace
