// shm::Group's small-message path (collectives/shm/small.h): allreduce, broadcast and allgather of up to
// InlineLines::kCapacity bytes per rank travel in the lines their ranks poll. Sizes around every edge of
// the layout (the first line's 32 data bytes, each further line's 64, the capacity, one element over it,
// which must take the slots), ranks as forked processes; rounds alternating with the slot paths (the
// lines and the slots share the group's parity); mismatched calls found from the lines' signatures; a
// broadcast's root that returns before its receivers read (GroupOptions::early_root).
#include <gtest/gtest.h>

#include <poll.h>
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

TEST(ShmSmall, ClaimingTheNextRoundsLinesAheadChangesNoDataWhateverTheNextCallsSize) {
  // A rank takes its next round's lines for writing while it waits in this one (GroupOptions::claim_lines,
  // InlineLines::claim), sized by this call, so the next call may write more lines or fewer than were
  // taken; an early broadcast root takes lines a receiver kDepth - 1 rounds behind may still be reading.
  // Thousands of calls, every op and size changing from call to call (one line, two, all 16, none),
  // the root rotating, a receiver now and then busy: each round's data differ, so a claim that wrote
  // anything, or a line taken from a reader that still needed it and not given back, shows as wrong data.
  // The same calls with the claim off are the control.
  const size_t kSizes[] = {8, 992, 64, 0, 512, 96, 33, 1, 160};
  for (bool claim : {true, false}) {
    const int world = 2;
    const std::string address = random_address("test-small-claim");
    test::run_forked_ranks(world, [&](int r) {
      GroupOptions o = GroupOptions::from_env(world);
      o.claim_lines = claim;
      o.early_root = true;
      auto g = Group::create_at(address, r, world, milliseconds(20000), o);
      std::vector<uint8_t> buf(InlineLines::kCapacity * world), mine(InlineLines::kCapacity);
      uint64_t nonempty = 0;
      for (int call = 0; call < 3000; ++call) {
        const size_t bytes = kSizes[call % 9];
        const int kind = (call / 9) % 3;
        nonempty += bytes > 0;  // each op meets every size, in a different order of sizes
        if (kind == 0) {
          std::vector<int8_t> v(bytes);
          for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<int8_t>(value(r, i, call) & 0x0f);
          g->allreduce(v.data(), v.data(), bytes, DataType::kInt8, ReduceOp::kSum);
          for (size_t i = 0; i < bytes; ++i)
            if (v[i] != static_cast<int8_t>((value(0, i, call) & 0x0f) + (value(1, i, call) & 0x0f))) return 1;
        } else if (kind == 1) {
          const int root = call % world;
          for (size_t i = 0; i < bytes; ++i) buf[i] = r == root ? value(root, i, call) : 0;
          g->broadcast(buf.data(), bytes, root);
          for (size_t i = 0; i < bytes; ++i)
            if (buf[i] != value(root, i, call)) return 2;
          if (r != root && call % 37 == 1) {  // busy for about 50 us: the root runs ahead meanwhile
            const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
            while (std::chrono::steady_clock::now() < until) {
            }
          }
        } else {
          for (size_t i = 0; i < bytes; ++i) mine[i] = value(r, i, call);
          g->allgather(mine.data(), buf.data(), bytes);
          for (int q = 0; q < world; ++q)
            for (size_t i = 0; i < bytes; ++i)
              if (buf[q * bytes + i] != value(q, i, call)) return 3;
        }
      }
      g->barrier();
      return g->inline_calls() >= nonempty ? 0 : 4;  // every call with data went inline
    }, milliseconds(60000));
  }
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

// Waits until `fd` is readable, at most `ms` milliseconds, and reads one byte; false when it did not come.
bool read_byte_within(int fd, int ms) {
  pollfd p{fd, POLLIN, 0};
  char c;
  return ::poll(&p, 1, ms) == 1 && ::read(fd, &c, 1) == 1;
}

TEST(ShmSmall, ABroadcastRootReturnsBeforeItsReceiversArriveAndTheyStillGetEveryRoundInOrder) {
  // (1) The root's broadcast returns while no receiver has called broadcast yet: the receivers call it
  // only once the root says, through a pipe, that its call returned (waiting for the receivers, as a
  // root did before, the pipe stays silent and the receivers give up after 5 s).
  // (2) Thousands of back-to-back broadcasts, the root rotating, inline (8 B, 512 B: the root returns at
  // once) and through the slots (4 KiB: one round; 64 KiB + 8: two chunks; the root waits), each round's
  // data different, a receiver now and then busy for a while so that the root runs ahead by up to
  // InlineLines::kDepth - 1 rounds: a root that wrote its lines or slot again before a receiver had read
  // them shows as wrong data, a logic_error or a timeout.
  for (int world : {2, 3}) {
    int ready[2];
    ASSERT_EQ(::pipe(ready), 0);
    const std::string address = random_address("test-small-early-root");
    test::run_forked_ranks(world, [&](int r) {
      GroupOptions o = GroupOptions::from_env(world);
      o.early_root = true;
      o.chunk_bytes = 64 << 10;
      auto g = Group::create_at(address, r, world, milliseconds(5000), o);
      uint64_t first = 0x0123456789abcdefull;
      if (r == 0) {
        g->broadcast(&first, sizeof first, 0);
        for (int q = 1; q < world; ++q)
          if (::write(ready[1], "x", 1) != 1) return 1;
      } else {
        if (!read_byte_within(ready[0], 5000)) return 2;  // the root's call did not return on its own
        uint64_t got = 0;
        g->broadcast(&got, sizeof got, 0);
        if (got != first) return 3;
      }
      const size_t kSizes[] = {8, 512, 4096, (64 << 10) + 8};
      std::vector<uint8_t> buf((64 << 10) + 8);
      uint64_t rooted = 0;
      for (int call = 0; call < 3000; ++call) {
        const int root = call % world;
        const size_t bytes = kSizes[call % 7 == 6 ? 3 : call % 3];
        if (call % 7 == 6 && call % 5 != 0) continue;  // the two-chunk size in a few calls only
        for (size_t i = 0; i < bytes; ++i) buf[i] = r == root ? value(root, i, call) : 0;
        g->broadcast(buf.data(), bytes, root);
        rooted += r == root && bytes <= InlineLines::kCapacity;
        for (size_t i = 0; i < bytes; ++i)
          if (buf[i] != value(root, i, call)) return 4;
        if (r != root && call % 61 == 0) {  // busy for about 50 us: the root goes on meanwhile
          const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
          while (std::chrono::steady_clock::now() < until) {
          }
        }
      }
      // (3) One root for a while: a broadcast through the slots (the root waits; its receivers compare the
      // root's call in its control line after their wait), then inline ones whose root runs ahead: it must
      // not overwrite that signature before they read it (a MismatchError naming a later call otherwise).
      for (int call = 0; call < 3000; ++call) {
        const size_t bytes = call % 8 == 0 ? 4096 : 8;
        for (size_t i = 0; i < bytes; ++i) buf[i] = r == 0 ? value(0, i, call) : 0;
        CallSignature sig;
        sig.seq = static_cast<uint32_t>(call + 1);
        sig.count = bytes;
        sig.kind = 2;
        g->set_call(sig);
        g->broadcast(buf.data(), bytes, 0);
        rooted += r == 0 && bytes <= InlineLines::kCapacity;
        for (size_t i = 0; i < bytes; ++i)
          if (buf[i] != value(0, i, call)) return 6;
      }
      g->set_call(CallSignature{});
      g->barrier();  // confirms the last broadcast
      // Every inline broadcast this rank was the root of returned early; the staged ones waited.
      return g->early_roots() == rooted + (r == 0) ? 0 : 5;
    }, milliseconds(60000));
    ::close(ready[0]);
    ::close(ready[1]);
  }
}

TEST(ShmSmall, AMismatchWithABroadcastWhoseRootReturnedIsNamedByEveryRank) {
  // A receiver that called something else names it at once; the root, whose broadcast returned, names it
  // at its next call. Two ranks that both think they are the root (a different root each) both return,
  // and both name the mismatch at their next call.
  struct Case {
    size_t count1;
    int root1;
  };
  for (Case c : {Case{3, 0}, Case{2, 1}}) {
    std::vector<std::unique_ptr<Group>> groups(2);
    const std::string address = random_address("test-small-early-mismatch");
    GroupOptions o = GroupOptions::from_env(2);
    o.early_root = true;
    test::run_ranks(2, [&](int r) { groups[r] = Group::create_at(address, r, 2, milliseconds(20000), o); });
    test::run_ranks(2, [&](int r) {
      const size_t count = r == 0 ? 2 : c.count1;
      const int root = r == 0 ? 0 : c.root1;
      CallSignature call;
      call.count = count;
      call.root = root;
      call.seq = 7;
      call.kind = 2;
      groups[r]->set_call(call);
      std::vector<double> buf(count, 1.0);
      std::string error;
      try {
        groups[r]->broadcast(buf.data(), count * sizeof(double), root);
        if (r != root) ADD_FAILURE() << "rank " << r << ": a receiver's mismatched broadcast returned";
        call.seq = 8;
        call.kind = 9;
        groups[r]->set_call(call);
        groups[r]->barrier();
        ADD_FAILURE() << "rank " << r << ": the call after a mismatched broadcast returned";
      } catch (const MismatchError& e) {
        error = e.what();
      }
      // The peer's call, as it published it: its count, and its seq (the broadcast's, 7).
      const size_t theirs = r == 0 ? c.count1 : 2;
      EXPECT_NE(error.find("count " + std::to_string(theirs) + ", seq 7"), std::string::npos) << r << ": " << error;
    });
  }
}

// What the root's next call would check, checked when the group's owner ends: a matched last broadcast
// confirms (the receivers got it), and two ranks that both took themselves for the root of their last
// call (nothing after it) both name the mismatch there instead of returning as if it had happened.
TEST(ShmSmall, TheLastEarlyBroadcastsAreConfirmedWhenTheGroupsOwnerEnds) {
  for (bool two_roots : {false, true}) {
    std::vector<std::unique_ptr<Group>> groups(2);
    const std::string address = random_address("test-small-early-end");
    GroupOptions o = GroupOptions::from_env(2);
    o.early_root = true;
    test::run_ranks(2, [&](int r) { groups[r] = Group::create_at(address, r, 2, milliseconds(20000), o); });
    test::run_ranks(2, [&](int r) {
      CallSignature call;
      call.count = 4;
      call.kind = 2;
      std::string error;
      try {
        for (int i = 0; i < 3; ++i) {
          const int root = two_roots && i == 2 ? r : 0;  // the last: each its own root
          call.root = root;
          call.seq = 10 + i;
          groups[r]->set_call(call);
          std::vector<double> buf(4, r == root ? 100.0 + i : -1.0);
          groups[r]->broadcast(buf.data(), sizeof(double) * buf.size(), root);
          if (!two_roots && buf[3] != 100.0 + i) ADD_FAILURE() << "rank " << r << " round " << i << ": " << buf[3];
        }
        groups[r]->confirm_early_broadcasts();
      } catch (const MismatchError& e) {
        error = e.what();
      }
      if (!two_roots) {
        EXPECT_EQ(error, "") << "rank " << r;
        if (r == 0) {
          EXPECT_EQ(groups[r]->early_roots(), 3u);
        }
      } else {
        // Each names the peer's call as the peer published it (its root, in the seq of the last call).
        EXPECT_NE(error.find("seq 12"), std::string::npos) << "rank " << r << ": '" << error << "'";
      }
    });
  }
}

}  // namespace
}  // namespace cohort::shm
