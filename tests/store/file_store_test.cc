// Tests of FileStore: same semantics as the other stores, shared through one file.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "cohort/error.h"
#include "store/tcp_store.h"
#include "support/test_support.h"

namespace cohort {
namespace {

using namespace std::chrono_literals;

TEST(FileStore, EveryOperation) {
  test::TempDir dir;
  auto s = make_file_store(dir.file("store"));
  s->set("a", "1");
  EXPECT_EQ(s->get("a"), "1");
  EXPECT_EQ(s->add("n", 4), 4);
  EXPECT_EQ(s->add("n", 1), 5);
  EXPECT_EQ(s->compare_set("c", "", "x"), "x");
  EXPECT_EQ(s->compare_set("c", "y", "z"), "x");
  EXPECT_EQ(s->compare_set("c", "x", "z"), "z");
  EXPECT_EQ(s->compare_set("missing", "e", "d"), "e");
  EXPECT_TRUE(s->check({"a", "n"}));
  EXPECT_FALSE(s->check({"a", "zz"}));
  EXPECT_EQ(s->num_keys(), 3);
  EXPECT_TRUE(s->remove("c"));
  EXPECT_FALSE(s->remove("c"));
  s->multi_set({"k1", "k2"}, {std::string("v\0", 2), "w"});
  EXPECT_EQ(s->multi_get({"k2", "k1"}), (std::vector<std::string>{"w", std::string("v\0", 2)}));
  s->set("text", "abc");
  EXPECT_THROW(s->add("text", 1), InvalidArgument);
  EXPECT_THROW(s->multi_set({"a"}, {}), InvalidArgument);
}

TEST(FileStore, SeparateOpenersShareTheFile) {
  test::TempDir dir;
  auto writer = make_file_store(dir.file("store"));
  auto reader = make_file_store(dir.file("store"));
  std::thread t([&] {
    std::this_thread::sleep_for(100ms);
    writer->set("late", "v");
  });
  EXPECT_EQ(reader->get("late"), "v");
  t.join();
  // Atomic add from many openers (each its own lock file descriptor, as separate processes have).
  test::run_ranks(4, [&](int) {
    auto s = make_file_store(dir.file("store"));
    for (int i = 0; i < 50; ++i) s->add("count", 1);
  });
  EXPECT_EQ(reader->add("count", 0), 200);
}

TEST(FileStore, WaitTimesOutNamingTheMissingKeys) {
  test::TempDir dir;
  auto s = make_file_store(dir.file("store"));
  s->set("r/0", "1");
  auto start = std::chrono::steady_clock::now();
  try {
    s->wait({"r/0", "r/1"}, 200ms);
    FAIL() << "expected a timeout";
  } catch (const TimeoutError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("r/1"), std::string::npos) << m;
    EXPECT_EQ(m.find("r/0"), std::string::npos) << m;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
}

TEST(FileStore, BarrierAcrossOpeners) {
  test::TempDir dir;
  test::run_ranks(4, [&](int rank) {
    auto s = make_file_store(dir.file("store"));
    s->barrier("fb", rank, 4, 10s);
  });
}

}  // namespace
}  // namespace cohort
