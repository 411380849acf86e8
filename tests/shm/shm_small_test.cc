// shm::Group's small-message path (collectives/shm/small.h): allreduce, broadcast and allgather of up to
// InlineLines::kCapacity bytes per rank travel in the lines their ranks poll. Sizes around every edge of
// the layout (the first line's 32 data bytes, each further line's 64, the capacity, one element over it,
// which must take the slots), ranks as forked processes; rounds alternating with the slot paths (the
// lines and the slots share the group's parity); mismatched calls found from the lines' signatures.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cohort/error.h"
#include "collectives/shm/group.h"
#include "collectives/shm/small.h"
#include "support/fork_ranks.h"
#include "support/test_support.h"

namespace cohort::shm {
namespace {

using std::chrono::milliseconds;

// Byte counts around each edge of the lines: 0, one byte, the first line's data (32), the second line's
// (32 + 64), 512 (issue 51's largest small size), the capacity (992) and past it (1000, 8-byte elements).
constexpr size_t kEdges[] = {0, 1, 8, 31, 32, 33, 64, 96, 97, 160, 161, 512, 984, 992, 1000, 1024};

// A value no two (rank, index, call) share within a byte, so a block from the wrong rank, line or
// round shows.
uint8_t value(int rank, size_t i, int call) { return static_cast<uint8_t>(rank * 37 + i * 11 + call * 101 + 1); }

// Exit codes name the check that failed.
int check_sizes(Group& g, int world, int r) {
  const int root = world - 1;
  int call = 0;
  for (size_t bytes : kEdges) {
    ++call;
    const bool inline_expected = bytes <= InlineLines::kCapacity;
    // allreduce of int8 (every byte count is a count) and, where whole, float64.
    {
      std::vector<int8_t> buf(bytes);
      for (size_t i = 0; i < bytes; ++i) buf[i] = static_cast<int8_t>(value(r, i, call) & 0x0f);
      const uint64_t before = g.inline_calls();
      g.allreduce(buf.data(), buf.data(), bytes, DataType::kInt8, ReduceOp::kSum);
      if ((g.inline_calls() - before == 1) != inline_expected) return 10;
      for (size_t i = 0; i < bytes; ++i) {
        int sum = 0;
        for (int q = 0; q < world; ++q) sum += value(q, i, call) & 0x0f;
        if (buf[i] != static_cast<int8_t>(sum)) return 11;
      }
    }
    if (bytes % 8 == 0) {
      std::vector<double> in(bytes / 8), out(bytes / 8, -1);
      for (size_t i = 0; i < in.size(); ++i) in[i] = r + 0.25 * static_cast<double>(i);
      g.allreduce(in.data(), out.data(), in.size(), DataType::kFloat64, ReduceOp::kAvg);
      for (size_t i = 0; i < in.size(); ++i)
        if (out[i] != (world - 1) / 2.0 + 0.25 * static_cast<double>(i)) return 12;
    }
    // broadcast from the last rank.
    {
      std::vector<uint8_t> buf(bytes);
      for (size_t i = 0; i < bytes; ++i) buf[i] = value(r, i, call);
      const uint64_t before = g.inline_calls();
      g.broadcast(buf.data(), bytes, root);
      if ((g.inline_calls() - before == 1) != inline_expected) return 20;
      for (size_t i = 0; i < bytes; ++i)
        if (buf[i] != value(root, i, call)) return 21;
    }
    // allgather of `bytes` per rank, out of place and in place.
    for (bool in_place : {false, true}) {
      std::vector<uint8_t> out(bytes * world, 0), mine(bytes);
      for (size_t i = 0; i < bytes; ++i) mine[i] = value(r, i, call);
      if (in_place && bytes) std::memcpy(out.data() + r * bytes, mine.data(), bytes);
      const uint64_t before = g.inline_calls();
      g.allgather(in_place ? out.data() : mine.data(), out.data(), bytes);
      if ((g.inline_calls() - before == 1) != inline_expected) return 30;
      for (int q = 0; q < world; ++q)
        for (size_t i = 0; i < bytes; ++i)
          if (out[q * bytes + i] != value(q, i, call)) return 31;
    }
  }
  return 0;
}

TEST(ShmSmall, EveryEdgeOfTheLinesAcrossTwoAndThreeProcessesAndPastTheCapacityThroughTheSlots) {
  for (int world : {2, 3}) {
    const std::string address = random_address("test-small");
    test::run_forked_ranks(world, [&](int r) {
      auto g = Group::create_at(address, r, world, milliseconds(20000), GroupOptions::from_env(world));
      return check_sizes(*g, world, r);
    }, milliseconds(60000));
  }
}

TEST(ShmSmall, RoundsAlternatingWithTheSlotPathsReuseTheLinesOnlyAfterEveryPeerReadThem) {
  // Thousands of back-to-back small calls, every third one through the slots (4 KiB), each round's data
  // different: a rank that overwrote its lines before a peer had read them shows as a wrong sum.
  const int world = 2;
  const std::string address = random_address("test-small-rounds");
  test::run_forked_ranks(world, [&](int r) {
    GroupOptions o = GroupOptions::from_env(world);
    auto g = Group::create_at(address, r, world, milliseconds(20000), o);
    std::vector<int64_t> small(8), large(512);
    for (int call = 0; call < 3000; ++call) {
      std::vector<int64_t>& buf = call % 3 == 2 ? large : small;
      for (size_t i = 0; i < buf.size(); ++i) buf[i] = call * 1000 + static_cast<int64_t>(i) + r;
      g->allreduce(buf.data(), buf.data(), buf.size(), DataType::kInt64, ReduceOp::kSum);
      for (size_t i = 0; i < buf.size(); ++i)
        if (buf[i] != 2 * (call * 1000 + static_cast<int64_t>(i)) + 1) return 1;
    }
    return g->inline_calls() == 2000 ? 0 : 2;
  }, milliseconds(60000));
}

TEST(ShmSmall, MismatchedCallsAreFoundFromTheLinesAndAgainstTheSlotPath) {
  // Counts that differ (both inline), and an inline call against one that takes the slots (the peer
  // posts its step without lines): every rank gets a MismatchError naming the other's call.
  for (size_t other : {size_t{3}, size_t{200}}) {
    std::vector<std::unique_ptr<Group>> groups(2);
    const std::string address = random_address("test-small-mismatch");
    GroupOptions o = GroupOptions::from_env(2);
    test::run_ranks(2, [&](int r) { groups[r] = Group::create_at(address, r, 2, milliseconds(20000), o); });
    test::run_ranks(2, [&](int r) {
      const size_t count = r == 0 ? 2 : other;
      CallSignature call;
      call.count = count;
      call.seq = 7;
      call.kind = 1;
      groups[r]->set_call(call);
      std::vector<double> buf(count, 1.0);
      try {
        groups[r]->allreduce(buf.data(), buf.data(), count, DataType::kFloat64, ReduceOp::kSum);
        ADD_FAILURE() << "rank " << r << ": mismatched allreduce returned";
      } catch (const MismatchError& e) {
        EXPECT_NE(std::string(e.what()).find("count " + std::to_string(r == 0 ? other : 2)), std::string::npos)
            << e.what();
      }
    });
  }
}

}  // namespace
}  // namespace cohort::shm
