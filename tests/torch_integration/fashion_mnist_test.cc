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

// Runs the job on 2 processes that meet through RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT.
std::vector<ProcessResult> run_two_ranks(const std::vector<std::string>& args) {
  const int port = cohort::test::free_port();
  std::vector<ProcessResult> results(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      results[r] = run_process(args, {"RANK=" + std::to_string(r), "WORLD_SIZE=2", "LOCAL_RANK=" + std::to_string(r),
                                      "LOCAL_WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port),
                                      "COHORT_TIMEOUT=30"},
                               90);
    });
  for (auto& t : threads) t.join();
  return results;
}

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

}  // namespace
