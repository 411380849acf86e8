// DistributedSampler split arithmetic (torch's) with the default permutation, and checkpoint files.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <set>

#include "cohort/error.h"
#include "support/test_support.h"
#include "cohort/train/checkpoint.h"
#include "cohort/train/sampler.h"

namespace cohort::train {
namespace {

TEST(DistributedSampler, PadsByWrappingAroundWithoutDropLast) {
  // 10 samples, 3 replicas, no shuffle: total 12, indices 0..9 then 0, 1.
  std::vector<std::vector<int64_t>> want = {{0, 3, 6, 9}, {1, 4, 7, 0}, {2, 5, 8, 1}};
  for (int r = 0; r < 3; ++r) {
    DistributedSampler s(10, 3, r, /*shuffle=*/false);
    EXPECT_EQ(s.num_samples(), 4);
    EXPECT_EQ(s.indices(), want[r]);
  }
  // Padding longer than the dataset repeats it: 2 samples over 5 replicas.
  DistributedSampler tiny(2, 5, 4, false);
  EXPECT_EQ(tiny.indices(), (std::vector<int64_t>{0}));
}

TEST(DistributedSampler, DropLastCutsTheTail) {
  for (int r = 0; r < 3; ++r) {
    DistributedSampler s(10, 3, r, false, 0, /*drop_last=*/true);
    EXPECT_EQ(s.num_samples(), 3);
    EXPECT_EQ(s.indices(), (std::vector<int64_t>{r, r + 3, r + 6}));
  }
}

TEST(DistributedSampler, ShuffleDependsOnSeedPlusEpochAndCoversTheData) {
  DistributedSampler a(100, 2, 0, true, 5), b(100, 2, 1, true, 5);
  std::set<int64_t> seen;
  for (auto i : a.indices()) seen.insert(i);
  for (auto i : b.indices()) seen.insert(i);
  EXPECT_EQ(seen.size(), 100u);
  auto first = a.indices();
  a.set_epoch(1);
  EXPECT_NE(a.indices(), first);
  DistributedSampler c(100, 2, 0, true, 6);  // seed 6, epoch 0 == seed 5, epoch 1
  EXPECT_EQ(c.indices(), a.indices());
}

TEST(DistributedSampler, UsesTheGivenPermutation) {
  auto reversed = [](int64_t n, uint64_t seed) {
    std::vector<int64_t> p;
    for (int64_t i = n - 1; i >= 0; --i) p.push_back(i);
    EXPECT_EQ(seed, 7u + 2u);
    return p;
  };
  DistributedSampler s(6, 2, 1, true, 7, false, reversed);
  s.set_epoch(2);
  EXPECT_EQ(s.indices(), (std::vector<int64_t>{4, 2, 0}));
}

TEST(DistributedSampler, BadArgumentsAreClear) {
  EXPECT_THROW(DistributedSampler(10, 0, 0), InvalidArgument);
  EXPECT_THROW(DistributedSampler(10, 2, 2), InvalidArgument);
}

// ---- resuming an epoch at another world size (docs/training.md, "Resuming") ----------------------

// What an epoch begun by `world0` ranks consumed in `steps` steps of `batch` per rank: each rank's
// first steps * batch indices (at most its whole list).
std::multiset<int64_t> consumed(int64_t n, int world0, int64_t batch, int64_t steps, uint64_t seed, int64_t epoch) {
  std::multiset<int64_t> out;
  for (int r = 0; r < world0; ++r) {
    DistributedSampler s(n, world0, r, true, seed);
    s.set_epoch(epoch);
    auto mine = s.indices();
    for (int64_t i = 0; i < std::min<int64_t>(steps * batch, static_cast<int64_t>(mine.size())); ++i)
      out.insert(mine[static_cast<size_t>(i)]);
  }
  return out;
}

TEST(DistributedSampler, AResumedEpochAtAnyWorldSizeTakesTheRestOfItsOrderOnce) {
  const int64_t n = 103, batch = 5, epoch = 3;
  const uint64_t seed = 7;
  for (int world0 : {1, 2, 4}) {
    DistributedSampler whole(n, world0, 0, true, seed);
    const int64_t steps_per_epoch = (whole.num_samples() + batch - 1) / batch;
    for (int64_t steps = 1; steps < steps_per_epoch; ++steps) {
      const int64_t cursor = steps * batch * world0;
      // The epoch's whole order, as the ranks that began it would have taken it (padding included).
      std::multiset<int64_t> everything = consumed(n, world0, batch, steps_per_epoch, seed, epoch);
      for (int world1 : {1, 2, 3, 4, 5, 8}) {
        std::multiset<int64_t> seen = consumed(n, world0, batch, steps, seed, epoch);
        std::vector<size_t> shares;
        int64_t longest = 0;
        for (int r = 0; r < world1; ++r) {
          DistributedSampler s(n, world1, r, true, seed);
          s.set_epoch(epoch);
          auto rest = s.indices_from(cursor, world0);
          shares.push_back(rest.size());
          longest = s.longest_share(cursor, world0);
          seen.insert(rest.begin(), rest.end());
        }
        EXPECT_EQ(seen, everything) << "world " << world0 << " -> " << world1 << " after " << steps << " steps: "
                                    << "every sample of the order once, none skipped or repeated";
        auto [lo, hi] = std::minmax_element(shares.begin(), shares.end());
        EXPECT_LE(*hi - *lo, 1u) << "shares differ by at most one";
        EXPECT_EQ(static_cast<int64_t>(*hi), longest);
      }
    }
  }
}

TEST(DistributedSampler, AResumedEpochAtTheSameWorldSizeGivesEachRankWhatItWouldHaveHad) {
  const int64_t n = 103, batch = 5, steps = 3;
  for (int r = 0; r < 4; ++r) {
    DistributedSampler s(n, 4, r, true, 11);
    s.set_epoch(2);
    auto whole = s.indices();
    auto rest = s.indices_from(steps * batch * 4, 4);
    EXPECT_EQ(rest, std::vector<int64_t>(whole.begin() + steps * batch, whole.end())) << "rank " << r;
  }
  DistributedSampler s(n, 4, 0);
  EXPECT_THROW(s.indices_from(-1, 4), InvalidArgument);
  EXPECT_THROW(s.indices_from(s.total_size_for(4) + 1, 4), InvalidArgument);
  EXPECT_TRUE(s.indices_from(s.total_size_for(4), 4).empty());
}

TEST(Checkpoint, TheNewestCompleteOneIsLoadedAndAnIncompleteNewestIsSkipped) {
  test::TempDir dir;
  EXPECT_FALSE(newest_complete_checkpoint(dir.path()).has_value());
  TrainingPosition first{0, 5, 5, 2, 320, 2}, second{0, 9, 9, 3, 512, 2};
  write_checkpoint(dir.path(), first, "first");
  write_checkpoint(dir.path(), second, "second");
  auto got = newest_complete_checkpoint(dir.path());
  ASSERT_TRUE(got);
  EXPECT_EQ(got->payload, "second");
  EXPECT_EQ(got->position.epoch_cursor, 512);
  EXPECT_EQ(got->position.epoch_world, 2);
  EXPECT_EQ(got->position.world_size, 3);
  // The newest cut short (a copy that stopped, a file system without atomic rename): the one before.
  std::string bytes = *read_file_if_exists(checkpoint_path(dir.path()));
  test::write_file(checkpoint_path(dir.path()), bytes.substr(0, bytes.size() - 2));
  got = newest_complete_checkpoint(dir.path());
  ASSERT_TRUE(got);
  EXPECT_EQ(got->payload, "first");
  ASSERT_EQ(got->skipped.size(), 1u);
  EXPECT_NE(got->skipped[0].find("checkpoint truncated"), std::string::npos) << got->skipped[0];
  // A damaged payload of the right length is caught by the digest.
  bytes.back() ^= 1;
  test::write_file(checkpoint_path(dir.path()), bytes);
  got = newest_complete_checkpoint(dir.path());
  ASSERT_TRUE(got);
  EXPECT_EQ(got->payload, "first");
  EXPECT_NE(got->skipped.at(0).find("checkpoint damaged"), std::string::npos) << got->skipped[0];
  // Neither complete: one error naming both.
  test::write_file(previous_checkpoint_path(dir.path()), "garbage");
  try {
    newest_complete_checkpoint(dir.path());
    ADD_FAILURE() << "expected an error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("no complete checkpoint in"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("checkpoint.1.bin is not a cohort checkpoint"), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, RoundTripAndAtomicReplace) {
  test::TempDir dir;
  const std::string path = checkpoint_path(dir.path() + "/ckpt");
  EXPECT_FALSE(read_file_if_exists(path).has_value());
  TrainingPosition pos{2, 17, 1234, 3};
  std::string payload("weights\0bytes", 13);
  write_file_atomically(path, encode_checkpoint(pos, payload));
  write_file_atomically(path, encode_checkpoint(pos, payload));  // replacing works
  auto bytes = read_file_if_exists(path);
  ASSERT_TRUE(bytes.has_value());
  std::string got_payload;
  TrainingPosition got = decode_checkpoint(*bytes, got_payload, path);
  EXPECT_EQ(got.epoch, 2);
  EXPECT_EQ(got.step_in_epoch, 17);
  EXPECT_EQ(got.global_step, 1234);
  EXPECT_EQ(got.world_size, 3);
  EXPECT_EQ(got_payload, payload);
  // No temp files left behind.
  int files = 0;
  for (auto& e : std::filesystem::directory_iterator(dir.path() + "/ckpt")) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
}

TEST(Checkpoint, TruncatedOrForeignFilesAreRejected) {
  std::string payload;
  auto bytes = encode_checkpoint({}, "0123456789");
  try {
    decode_checkpoint(bytes.substr(0, bytes.size() - 3), payload, "/x/checkpoint.bin");
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("/x/checkpoint.bin: checkpoint truncated"), std::string::npos) << e.what();
  }
  EXPECT_THROW(decode_checkpoint("PK\x03\x04", payload, "f"), InvalidArgument);
}

}  // namespace
}  // namespace cohort::train
