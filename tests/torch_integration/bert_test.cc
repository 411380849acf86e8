// examples/bert as processes: its PyTorch twin (bench/bert_twin.py) starts from the same weights, data
// and masking; across real processes the sharded optimizer (ZeRO stage 2) trains as DDP does with
// half the optimizer state per rank, and its checkpoint written by 3 ranks resumes on 2 to the held-out loss
// of the unsharded optimizer resumed the same way.
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>
#include <thread>

#include "support/test_support.h"

namespace {

using cohort::test::ProcessResult;
using cohort::test::run_process;

const std::string kProgram = COHORT_BERT;
const bool kHaveData = std::filesystem::exists("/usr/share/wordnet/data.noun");

std::string first_match(const std::string& text, const std::string& pattern) {
  std::smatch m;
  return std::regex_search(text, m, std::regex(pattern)) ? std::string(m[1]) : std::string();
}
std::vector<double> losses(const std::string& out) {
  std::vector<double> v;
  static const std::regex re("loss: ([0-9.]+)");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it)
    v.push_back(std::stod((*it)[1]));
  return v;
}

// A model small enough for a test: 60,616 parameters, 3,000 training glosses.
std::vector<std::string> small_job(std::initializer_list<std::string> more) {
  std::vector<std::string> args{kProgram, "--hidden", "32", "--vocab", "1000", "--train-samples", "3000", "--dropout", "0"};
  args.insert(args.end(), more);
  return args;
}

std::vector<ProcessResult> run_ranks(int world, const std::vector<std::string>& args) {
  const int port = cohort::test::free_port();
  std::vector<ProcessResult> results(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      results[size_t(r)] = run_process(args,
                                       {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(world),
                                        "LOCAL_RANK=" + std::to_string(r), "LOCAL_WORLD_SIZE=" + std::to_string(world),
                                        "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port),
                                        "COHORT_TIMEOUT=30"},
                                       90);
    });
  for (auto& t : threads) t.join();
  return results;
}

TEST(Bert, BadInputIsOneClearLine) {
  auto r = run_process({kProgram, "--data-dir", "/nonexistent"}, {}, 60);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("cannot read /nonexistent/data.noun: no such file (install wordnet-base, or pass --data-dir)"),
            std::string::npos)
      << r.err;
  r = run_process({kProgram, "--hidden", "30", "--heads", "4"}, {}, 60);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--hidden 30 is not a multiple of --heads 4"), std::string::npos) << r.err;
  r = run_process({kProgram, "--zero", "3"}, {}, 60);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--zero"), std::string::npos) << r.err;
}

TEST(Bert, TheBannerCountsTheHeldOutGlossesItEvaluates) {
  if (!kHaveData) GTEST_SKIP() << "wordnet-base is not installed";
  // --test-samples 64 evaluates 64 glosses: the banner said the corpus's 5882.
  auto r = run_process(small_job({"--max-steps", "1", "--test-samples", "64"}), {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(first_match(r.out, "training and ([0-9]+) held-out glosses"), "64") << r.out;
}

TEST(Bert, ThePyTorchTwinStartsFromTheSameWeightsDataAndLoss) {
  if (!kHaveData) GTEST_SKIP() << "wordnet-base is not installed";
  auto cpp = run_process(small_job({"--max-steps", "2", "--print-digest"}), {}, 60);
  ASSERT_EQ(cpp.exit_code, 0) << cpp.err;
  auto py = run_process({COHORT_PYTHON3, std::string(COHORT_SOURCE_DIR) + "/bench/bert_twin.py", "--hidden", "32",
                         "--vocab", "1000", "--train-samples", "3000", "--dropout", "0", "--max-steps", "2",
                         "--print-digest"},
                        {}, 90);
  ASSERT_EQ(py.exit_code, 0) << py.err;
  const std::string weights = "initial weights digest: ([0-9a-f]+)";
  ASSERT_FALSE(first_match(cpp.out, weights).empty()) << cpp.out;
  EXPECT_EQ(first_match(cpp.out, weights), first_match(py.out, weights)) << cpp.out << py.out;
  // The same vocabulary, glosses and masks: the same first loss (printed to 4 places).
  const std::string first_loss = "step: 0/94, loss: ([0-9.]+)", held_out = "of (\\d+)\\)";
  ASSERT_FALSE(first_match(cpp.out, first_loss).empty()) << cpp.out;  // an empty match on both sides proves nothing
  ASSERT_FALSE(first_match(cpp.out, held_out).empty()) << cpp.out;
  EXPECT_EQ(first_match(cpp.out, first_loss), first_match(py.out, first_loss)) << cpp.out << py.out;
  EXPECT_EQ(first_match(cpp.out, held_out), first_match(py.out, held_out)) << "held-out masked tokens";
}

TEST(Bert, FsdpAcrossProcessesTrainsLikeDdpWithHalfTheOptimizerStatePerRank) {
  // cohort's real transport (shared memory between two processes) under FSDP's asynchronous
  // all-gathers and reduce-scatters, issued from the autograd hooks; every encoder layer a unit.
  if (!kHaveData) GTEST_SKIP() << "wordnet-base is not installed";
  auto ddp = run_ranks(2, small_job({"--max-steps", "11"}));
  auto fsdp = run_ranks(2, small_job({"--max-steps", "11", "--fsdp"}));
  for (const auto& r : ddp) ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const auto& r : fsdp) ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(fsdp[0].out.find("fully sharded (FSDP)"), std::string::npos) << fsdp[0].out;
  const auto a = losses(ddp[0].out), b = losses(fsdp[0].out);
  ASSERT_EQ(a.size(), 2u) << ddp[0].out;
  ASSERT_EQ(b.size(), a.size()) << fsdp[0].out;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 2e-3) << "loss line " << i;
  EXPECT_NEAR(std::stod(first_match(ddp[0].out, "held-out\\): ([0-9.]+)")),
              std::stod(first_match(fsdp[0].out, "held-out\\): ([0-9.]+)")), 0.01);
  // The optimizer steps the shards: each rank keeps the Adam moments of half the parameters.
  const double whole = std::stod(first_match(ddp[0].out, "rank 1: optimizer state ([0-9.]+) MB"));
  const double half = std::stod(first_match(fsdp[0].out, "rank 1: optimizer state ([0-9.]+) MB"));
  EXPECT_NEAR(half, whole / 2, 0.05) << fsdp[0].out;
}

TEST(Bert, FsdpCheckpointWrittenByThreeRanksResumesOnTwoWithTheSameWeights) {
  // bert --fsdp --checkpoint-dir: every rank writes its shard of the weights and of AdamW's moments; a
  // job at another world size re-cuts them (FullyShardedDataParallel::save/load). The weights digest
  // is taken over the gathered model (full_state_dict), so it is the same bytes at any world size.
  if (!kHaveData) GTEST_SKIP() << "wordnet-base is not installed";
  cohort::test::TempDir tmp;
  auto saved = run_ranks(3, small_job({"--fsdp", "--checkpoint-dir", tmp.path(), "--max-steps", "4", "--print-digest",
                                       "--test-samples", "16"}));
  for (const auto& r : saved) ASSERT_EQ(r.exit_code, 0) << r.err;
  for (int r = 0; r < 3; ++r)
    EXPECT_TRUE(std::filesystem::exists(tmp.path() + "/zero/step-4/shard-" + std::to_string(r) + "-of-3.bin")) << r;
  const std::string at_save = first_match(saved[0].out, "final weights digest: ([0-9a-f]+)");
  ASSERT_FALSE(at_save.empty()) << saved[0].out;

  auto resumed = run_ranks(2, small_job({"--fsdp", "--checkpoint-dir", tmp.path(), "--resume", "--max-steps", "3",
                                         "--print-digest", "--test-samples", "16"}));
  for (const auto& r : resumed) ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(resumed[0].out.find("at epoch 0, step 4 (written by 3 ranks, 2 now)"), std::string::npos) << resumed[0].out;
  EXPECT_EQ(first_match(resumed[0].out, "resumed weights digest: ([0-9a-f]+)"), at_save) << resumed[0].out;
  // It trains on from there (3 steps: losses of steps 4 to 6, none printed) and saves at 2 ranks.
  const std::string at_end = first_match(resumed[0].out, "final weights digest: ([0-9a-f]+)");
  EXPECT_FALSE(at_end.empty()) << resumed[0].out;
  EXPECT_NE(at_end, at_save);
  EXPECT_TRUE(std::filesystem::exists(tmp.path() + "/zero/step-7/shard-1-of-2.bin"));
}

TEST(Bert, TracePhasesSplitsEveryRanksStepIntoItsPhasesAndProbesTheCore) {
  // bert --trace-phases N (examples/common/phase_times.h): per rank, a line per step after the first N
  // and a summary of the phases' wall, thread CPU and process CPU, which must add up as time does.
  if (!kHaveData) GTEST_SKIP() << "wordnet-base is not installed";
  auto ranks = run_ranks(2, small_job({"--max-steps", "4", "--trace-phases", "1", "--test-samples", "16"}));
  for (int r = 0; r < 2; ++r) {
    const ProcessResult& p = ranks[size_t(r)];
    ASSERT_EQ(p.exit_code, 0) << p.err;
    const std::string rank = "rank " + std::to_string(r);
    // Steps 1 to 3: one line each, every phase's thread CPU and the two probes.
    for (int step = 1; step <= 3; ++step)
      EXPECT_FALSE(first_match(p.out, rank + " phases step " + std::to_string(step) +
                                          " on cpu [0-9]+: thread cpu ms zero_grad [0-9.]+ forward [0-9.]+ backward "
                                          "[0-9.]+ optimizer [0-9.]+ \\| probes fma ([0-9.]+) ms, 16 MiB read [0-9.]+ ms")
                       .empty())
          << "step " << step << ":\n" << p.out;
    EXPECT_TRUE(first_match(p.out, rank + " phases step (0) ").empty()) << "step 0 is warm-up:\n" << p.out;
    std::smatch m;
    const std::string number = "([0-9.]+)";
    const std::string triple = number + " / " + number + " / " + number;
    const std::regex summary(rank + " phases, ms per step over steps 1-3 \\(wall / thread cpu / process cpu\\): zero_grad " +
                             triple + ", forward " + triple + ", backward " + triple +
                             "(?: \\(of which waiting for peers " + number + "\\))?, optimizer " + triple + ", step " + triple +
                             "; per step [0-9]+ minor faults, [0-9.]+ involuntary switches, [0-9.]+ CPU changes; probes fma " +
                             number + " ms, 16 MiB read " + number + " ms");
    ASSERT_TRUE(std::regex_search(p.out, m, summary)) << p.out;
    auto at = [&](int i) { return std::stod(m[size_t(i)]); };
    // The phases make up the step: wall, thread CPU and process CPU each (to the print's rounding).
    for (int k = 0; k < 3; ++k)
      EXPECT_NEAR(at(1 + k) + at(4 + k) + at(7 + k) + at(11 + k), at(14 + k), 0.25) << "column " << k << ": " << m[0];
    // One thread's CPU time cannot pass the wall time, nor the whole process's.
    EXPECT_LE(at(15), at(14) + 0.1) << m[0];
    EXPECT_LE(at(15), at(16) + 0.1) << m[0];
    EXPECT_GT(at(15), 0) << m[0];
    EXPECT_GT(at(17), 0) << "the fma probe took no time: " << m[0];
    EXPECT_GT(at(18), 0) << "the read probe took no time: " << m[0];
  }
}

TEST(Bert, ShardedStageTwoAcrossProcessesTrainsLikeDdpAndResumesAtAnotherWorldSize) {
  if (!kHaveData) GTEST_SKIP() << "wordnet-base is not installed";
  auto ddp = run_ranks(2, small_job({"--max-steps", "11"}));
  auto zero = run_ranks(2, small_job({"--max-steps", "11", "--zero", "2"}));
  for (const auto& r : ddp) ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const auto& r : zero) ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto a = losses(ddp[0].out), b = losses(zero[0].out);
  ASSERT_EQ(a.size(), 2u) << ddp[0].out;
  ASSERT_EQ(b.size(), a.size()) << zero[0].out;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 2e-3) << "loss line " << i;
  EXPECT_NEAR(std::stod(first_match(ddp[0].out, "held-out\\): ([0-9.]+)")),
              std::stod(first_match(zero[0].out, "held-out\\): ([0-9.]+)")), 0.01);
  // Each rank keeps the Adam moments of half the parameters (and a little padding).
  const double whole = std::stod(first_match(ddp[0].out, "rank 1: optimizer state ([0-9.]+) MB"));
  const double half = std::stod(first_match(zero[0].out, "rank 1: optimizer state ([0-9.]+) MB"));
  EXPECT_NEAR(half, whole / 2, 0.05) << zero[0].out;

  // Killed at 3 ranks after the checkpoint of step 4; resumed on 2 ranks.
  cohort::test::TempDir tmp;
  auto killed = run_ranks(3, small_job({"--zero", "2", "--checkpoint-dir", tmp.path(), "--checkpoint-every", "4",
                                        "--kill-after-steps", "6"}));
  for (const auto& r : killed) EXPECT_EQ(r.exit_code, 128 + 9) << r.err;
  for (int r = 0; r < 3; ++r)
    EXPECT_TRUE(std::filesystem::exists(tmp.path() + "/zero/step-4/shard-" + std::to_string(r) + "-of-3.bin")) << r;
  // 256 held-out glosses tell the losses below apart as well as all 5,882, in a third of the time.
  auto resumed = run_ranks(2, small_job({"--zero", "2", "--checkpoint-dir", tmp.path(), "--resume", "--max-steps", "3",
                                         "--test-samples", "256"}));
  for (const auto& r : resumed) ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(resumed[0].out.find("at epoch 0, step 4 (written by 3 ranks, 2 now)"), std::string::npos) << resumed[0].out;
  EXPECT_TRUE(std::filesystem::exists(tmp.path() + "/zero/step-7/shard-1-of-2.bin"));  // its own at the end

  // The result: the same 4 steps at 3 ranks and 3 at 2 with the unsharded optimizer, whose checkpoint is
  // whole (nothing to re-cut at 2 ranks), reach the same held-out loss. Adam moments lost or misplaced
  // in re-cutting 3 shards into 2 move it by a hundredth (the shards of ranks 1 and 2 dropped: 6.7896
  // against 6.7794); the sharded and unsharded optimizers agree to 4 places here.
  cohort::test::TempDir unsharded_dir;
  auto before = run_ranks(3, small_job({"--checkpoint-dir", unsharded_dir.path(), "--max-steps", "4", "--test-samples", "64"}));
  for (const auto& r : before) ASSERT_EQ(r.exit_code, 0) << r.err;
  auto unsharded = run_ranks(
      2, small_job({"--checkpoint-dir", unsharded_dir.path(), "--resume", "--max-steps", "3", "--test-samples", "256"}));
  for (const auto& r : unsharded) ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_NE(unsharded[0].out.find("at epoch 0, step 4 (written by 3 ranks, 2 now)"), std::string::npos) << unsharded[0].out;
  const std::string held_out_loss = "masked-token loss \\(held-out\\): ([0-9.]+)";
  ASSERT_FALSE(first_match(resumed[0].out, held_out_loss).empty()) << resumed[0].out;
  ASSERT_FALSE(first_match(unsharded[0].out, held_out_loss).empty()) << unsharded[0].out;
  EXPECT_NEAR(std::stod(first_match(resumed[0].out, held_out_loss)), std::stod(first_match(unsharded[0].out, held_out_loss)),
              2e-3)
      << "sharded, resumed at 2 ranks:\n" << resumed[0].out << "unsharded, resumed at 2 ranks:\n" << unsharded[0].out;
}

}  // namespace
