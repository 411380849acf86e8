// DistributedSampler split arithmetic (torch's) with the default permutation, and checkpoint files.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <set>

#include "cohort/error.h"
#include "support/test_support.h"
#include "train/checkpoint.h"
#include "train/sampler.h"

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
