// examples/resnet as processes under `cohort run --nproc-per-node 2`, with a narrow net (--width 4)
// on a few hundred images so that each job takes a second or two: it trains (the loss it prints is
// finite), every rank ends with the same parameters AND batch norm buffers, and a job SIGKILLed
// mid-epoch that `cohort run --max-restarts 1` starts again resumes by itself from the sharded
// optimizer's checkpoint (--zero 2: every rank writes and reads its shard) and ends bit for bit where
// the uninterrupted job ends.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <regex>

#include "support/test_support.h"

namespace {

using cohort::test::ProcessResult;
using cohort::test::run_process;

const std::string kProgram = COHORT_RESNET;
const bool kHaveData = std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");

int lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

// Every rank's "rank R final digest (parameters and buffers): X", by rank.
std::map<int, std::string> digests(const ProcessResult& r) {
  std::map<int, std::string> out;
  const std::regex re("rank (\\d+) final digest \\(parameters and buffers\\): ([0-9a-f]{16})");
  for (auto it = std::sregex_iterator(r.out.begin(), r.out.end(), re); it != std::sregex_iterator(); ++it)
    out[std::stoi((*it)[1])] = (*it)[2];
  return out;
}

// The losses rank 0 printed, in order.
std::vector<double> losses(const ProcessResult& r) {
  std::vector<double> out;
  const std::regex re("loss is (\\S+)");
  for (auto it = std::sregex_iterator(r.out.begin(), r.out.end(), re); it != std::sregex_iterator(); ++it)
    out.push_back(std::strtod((*it)[1].str().c_str(), nullptr));
  return out;
}

// Batch 8 per rank; several gradient buckets (50 KiB each) for the width-4 net's 44.5k parameters (3
// buckets), so that the shards cut through buckets and parameters.
std::vector<std::string> job(std::vector<std::string> extra) {
  std::vector<std::string> argv{cohort::test::cohort_tool(), "run", "--nproc-per-node", "2"};
  std::vector<std::string> program{kProgram, "--width", "4", "--batch", "8", "--test-samples", "200",
                                   "--bucket-mb", "0.05", "--print-digest"};
  // Launcher flags (before the program) start with "cohort:", the program's follow it.
  for (auto it = extra.begin(); it != extra.end();) {
    if (it->rfind("cohort:", 0) == 0) {
      argv.push_back(it->substr(7));
      it = extra.erase(it);
    } else {
      ++it;
    }
  }
  argv.insert(argv.end(), program.begin(), program.end());
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

TEST(Resnet, BadInputIsOneClearLine) {
  auto r = run_process({kProgram, "--zero", "3"}, {}, 60);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("--zero"), std::string::npos) << r.err;

  r = run_process({kProgram, "--resume"}, {}, 60);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("--resume needs --checkpoint-dir"), std::string::npos) << r.err;
}

// DDP with momentum SGD: the loss falls, and the ranks end with the same parameters (the averaged
// gradients) and buffers (the job evaluates with rank 0's running statistics, broadcast once more after
// the last step; the broadcast before every training forward is ddp_test.cc's
// BufferBroadcastGivesEveryRankRankZerosRunningStatistics). 2 ranks x 160 images: 20 steps.
// The same job with the optimizer state sharded (--zero 1) ends bit for bit where it does: SGD is
// elementwise, and both ways a pair of ranks' gradients is averaged as (a + b) / 2.
TEST(Resnet, TwoRanksTrainAndEndWithTheSameParametersAndBuffersShardedOrNot) {
  if (!kHaveData) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  auto r = run_process(job({"--train-samples", "320"}), {}, 90);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto l = losses(r);
  ASSERT_EQ(l.size(), 2u) << r.out;  // steps 0 and 10, rank 0 only
  for (double v : l) EXPECT_TRUE(std::isfinite(v)) << r.out;
  EXPECT_LT(l.back(), l.front()) << r.out;
  EXPECT_NE(r.out.find("samples/s: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("320 samples on 2 ranks"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("test accuracy: "), std::string::npos) << r.out;
  const auto d = digests(r);
  ASSERT_EQ(d.size(), 2u) << r.out;
  EXPECT_EQ(d.at(0), d.at(1)) << r.out;

  auto sharded = run_process(job({"--train-samples", "320", "--zero", "1"}), {}, 90);
  ASSERT_EQ(sharded.exit_code, 0) << sharded.out << sharded.err;
  EXPECT_EQ(digests(sharded), d) << sharded.out;
}

// --fsdp: each of the four stages an FSDP unit, torch's SGD over the shards, over cohort's shared-memory
// transport. It ends bit for bit where DDP ends: with 2 ranks the reduce-scatter's average is (a + b) / 2
// as DDP's is, SGD is elementwise, and rank 0's running statistics (which the evaluation broadcasts)
// are its own under both.
TEST(Resnet, FsdpTwoRanksEndWithDdpsParametersAndBuffers) {
  if (!kHaveData) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  auto ddp = run_process(job({"--train-samples", "320"}), {}, 90);
  ASSERT_EQ(ddp.exit_code, 0) << ddp.out << ddp.err;
  const auto want = digests(ddp);
  ASSERT_EQ(want.size(), 2u) << ddp.out;
  auto fsdp = run_process(job({"--train-samples", "320", "--fsdp", "--verbose"}), {}, 90);
  ASSERT_EQ(fsdp.exit_code, 0) << fsdp.out << fsdp.err;
  EXPECT_NE(fsdp.out.find("FSDP units: 5"), std::string::npos) << fsdp.out;  // four stages and the root
  EXPECT_EQ(losses(fsdp), losses(ddp)) << fsdp.out;
  EXPECT_EQ(digests(fsdp), want) << fsdp.out;

  // What --fsdp does not combine with yet is one line, before any rank starts.
  auto r = run_process({kProgram, "--fsdp", "--zero", "1"}, {}, 60);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("--fsdp shards the parameters"), std::string::npos) << r.err;
}

// Both sharded trainings through real processes: 2 ranks x 80 images (10 steps per epoch) for 2 epochs,
// checkpoints every 3 steps; an uninterrupted job, then one whose ranks are SIGKILLed after step 14
// (epoch 1, step 4; the newest checkpoint is step 12), which `cohort run` starts again: the restart
// resumes from step 12 and ends with the uninterrupted job's digest, and the final step's shards of
// both ranks are on disk.
void killed_and_restarted_ends_like_the_uninterrupted_job(const std::vector<std::string>& mode) {
  cohort::test::TempDir tmp;
  std::vector<std::string> common{"--train-samples", "160", "--epochs", "2", "--checkpoint-every", "3"};
  common.insert(common.end(), mode.begin(), mode.end());
  auto args = common;
  args.insert(args.end(), {"--checkpoint-dir", tmp.file("a")});
  auto full = run_process(job(args), {}, 90);
  ASSERT_EQ(full.exit_code, 0) << full.out << full.err;
  const auto want = digests(full);
  ASSERT_EQ(want.size(), 2u) << full.out;
  EXPECT_EQ(want.at(0), want.at(1)) << full.out;
  for (double v : losses(full)) EXPECT_TRUE(std::isfinite(v)) << full.out;
  EXPECT_TRUE(std::filesystem::exists(tmp.file("a") + "/zero/step-20/shard-0-of-2.bin"));
  EXPECT_TRUE(std::filesystem::exists(tmp.file("a") + "/zero/step-20/shard-1-of-2.bin"));

  args = common;
  args.insert(args.end(), {"--checkpoint-dir", tmp.file("b"), "--kill-after-steps", "14", "cohort:--max-restarts",
                           "cohort:1"});
  auto restarted = run_process(job(args), {}, 90);
  ASSERT_EQ(restarted.exit_code, 0) << restarted.out << restarted.err;
  EXPECT_NE(restarted.out.find("resuming from " + tmp.file("b") + " at epoch 1, step 2 (sample 32 of the epoch's "
                                                                 "160; written by 2 ranks, 2 now; restart 1)"),
            std::string::npos)
      << restarted.out;
  EXPECT_EQ(digests(restarted), want) << restarted.out;
}

// Stage 2 of the sharded optimizer with Adam (two state tensors per chunk).
TEST(Resnet, ZeroStageTwoKilledAndRestartedEndsLikeTheUninterruptedJob) {
  if (!kHaveData) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  killed_and_restarted_ends_like_the_uninterrupted_job({"--optimizer", "adam", "--zero", "2"});
}

// resnet --fsdp's checkpoints are FSDP's sharded ones (FullyShardedDataParallel::save/load): AdamW's
// moments and the weights by shard, rank 0's batch norm statistics.
TEST(Resnet, FsdpKilledAndRestartedEndsLikeTheUninterruptedJob) {
  if (!kHaveData) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  killed_and_restarted_ends_like_the_uninterrupted_job({"--optimizer", "adamw", "--fsdp"});
}

}  // namespace
