// shm::Group's single-copy path (process_vm_readv/writev between the ranks' own buffers): allgather(v),
// alltoall(v), gather, scatter, broadcast and reduce_scatter give the same bytes as the definitions, at odd
// sizes, sizes the rank count does not divide, zero counts in the v-variants, in place, 1 to 4 ranks as threads
// and 3 as forked processes; the check at creation and its way out (COHORT_SHM_SINGLE_COPY=0); an alltoallv
// whose counts disagree between ranks is a MismatchError naming both; the communicator sends these collectives
// to the group from the single-copy size on and over the transports below it.
#include <gtest/gtest.h>

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "collectives/shm/group.h"
#include "comm/communicator_impl.h"
#include "store/memory_store.h"
#include "support/fork_ranks.h"
#include "single_copy_support.h"
#include "support/test_support.h"

namespace cohort::shm {
namespace {

using std::chrono::milliseconds;

using test_single_copy::byte_of;
using test_single_copy::single_copy_options;

std::vector<std::unique_ptr<Group>> make_groups(int world, const GroupOptions& opt) {
  return test_single_copy::make_groups(world, opt, "single-copy");
}

// alltoallv's counts: from rank `from` to rank `to`, elements; some pairs send nothing.
size_t pair_count(int from, int to, size_t n) {
  return (from + 2 * to) % 3 == 1 ? 0 : n + static_cast<size_t>(from * 5 + to);
}

// Every single-copy collective on one rank of `world`, checked against its definition; returns how
// many group calls it made (each one a single copy when world > 1).
int exercise(Group& g, int r, int world) {
  const size_t W = static_cast<size_t>(world);
  int calls = 0;
  for (size_t n : {size_t{1}, size_t{5}, size_t{700}, size_t{2501}}) {
    // allgather of an odd byte count, separate, in place at its block, and in == out.
    const size_t bytes = n * 3 + 1;
    std::vector<uint8_t> want(bytes * W), mine(bytes);
    for (int q = 0; q < world; ++q)
      for (size_t i = 0; i < bytes; ++i) want[q * bytes + i] = byte_of(q, -1, i);
    std::memcpy(mine.data(), want.data() + r * bytes, bytes);
    std::vector<uint8_t> all(bytes * W, 0xEE);
    g.allgather(mine.data(), all.data(), bytes), ++calls;
    EXPECT_EQ(all, want) << "allgather n=" << n << " rank " << r;
    std::vector<uint8_t> same(bytes * W, 0xEE);
    std::memcpy(same.data() + r * bytes, mine.data(), bytes);
    g.allgather(same.data() + r * bytes, same.data(), bytes), ++calls;
    EXPECT_EQ(same, want) << "allgather in place n=" << n << " rank " << r;
    std::fill(same.begin(), same.end(), 0xEE);
    std::memcpy(same.data() + r * bytes, mine.data(), bytes);
    g.allgather(same.data(), same.data(), bytes), ++calls;
    EXPECT_EQ(same, want) << "allgather in == out n=" << n << " rank " << r;

    // allgatherv of int32 with a zero count for some ranks (rank 1 always gives nothing).
    std::vector<size_t> counts(W);
    for (int q = 0; q < world; ++q) counts[q] = q == 1 ? 0 : n + static_cast<size_t>(q);
    const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
    std::vector<int32_t> vwant, vmine;
    for (int q = 0; q < world; ++q)
      for (size_t i = 0; i < counts[q]; ++i) {
        vwant.push_back(q * 100000 + static_cast<int32_t>(i));
        if (q == r) vmine.push_back(vwant.back());
      }
    std::vector<int32_t> vall(total + 1, -7);  // +1: a guard that must survive
    g.allgatherv(vmine.data(), vmine.size(), vall.data(), counts.data(), sizeof(int32_t)), ++calls;
    EXPECT_EQ(std::vector<int32_t>(vall.begin(), vall.end() - 1), vwant) << "allgatherv n=" << n << " rank " << r;
    EXPECT_EQ(vall.back(), -7) << "allgatherv wrote past the end, rank " << r;

    // alltoall (uniform alltoallv) of n odd-sized 3-byte elements, separate and in place.
    const size_t elem = 3;
    std::vector<size_t> ucounts(W, n), udispls(W);
    for (size_t q = 0; q < W; ++q) udispls[q] = q * n;
    std::vector<uint8_t> send(n * elem * W), expect(n * elem * W);
    for (int q = 0; q < world; ++q)
      for (size_t i = 0; i < n * elem; ++i) {
        send[q * n * elem + i] = byte_of(r, q, i);
        expect[q * n * elem + i] = byte_of(q, r, i);
      }
    std::vector<uint8_t> recv(send.size(), 0xEE);
    g.alltoallv(send.data(), ucounts.data(), udispls.data(), recv.data(), ucounts.data(), udispls.data(), elem);
    ++calls;
    EXPECT_EQ(recv, expect) << "alltoall n=" << n << " rank " << r;
    g.alltoallv(send.data(), ucounts.data(), udispls.data(), send.data(), ucounts.data(), udispls.data(), elem);
    ++calls;
    EXPECT_EQ(send, expect) << "alltoall in place n=" << n << " rank " << r;

    // alltoallv with zero counts and gaps between the blocks (offsets in elements of 8 bytes).
    std::vector<size_t> sc(W), sd(W), rc(W), rd(W);
    size_t so = 3, ro = 1;
    for (int q = 0; q < world; ++q) {
      sc[q] = pair_count(r, q, n), sd[q] = so, so += sc[q] + 2;
      rc[q] = pair_count(q, r, n), rd[q] = ro, ro += rc[q] + 1;
    }
    std::vector<uint64_t> vs(so), vr(ro, 0xDEAD), vexpect(ro, 0xDEAD);
    for (int q = 0; q < world; ++q) {
      for (size_t i = 0; i < sc[q]; ++i) vs[sd[q] + i] = (uint64_t(r) << 40) | (uint64_t(q) << 20) | i;
      for (size_t i = 0; i < rc[q]; ++i) vexpect[rd[q] + i] = (uint64_t(q) << 40) | (uint64_t(r) << 20) | i;
    }
    g.alltoallv(vs.data(), sc.data(), sd.data(), vr.data(), rc.data(), rd.data(), sizeof(uint64_t)), ++calls;
    EXPECT_EQ(vr, vexpect) << "alltoallv n=" << n << " rank " << r;

    // reduce_scatter of n floats per block holding small integers (exact sums in any order), separate
    // and in cohort's three in-place forms; int32 max too.
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kAvg}) {
      auto value = [&](int rank, size_t i) {
        return static_cast<float>((rank * 7 + static_cast<int>(i % 13)) % 11 - 4);
      };
      std::vector<float> in(n * W), block(n), expect_block(n);
      for (size_t i = 0; i < n * W; ++i) in[i] = value(r, i);
      for (size_t i = 0; i < n; ++i) {
        float acc = value(0, r * n + i);
        for (int q = 1; q < world; ++q)
          acc = op == ReduceOp::kMax ? std::max(acc, value(q, r * n + i)) : acc + value(q, r * n + i);
        expect_block[i] = op == ReduceOp::kAvg ? acc / static_cast<float>(world) : acc;
      }
      g.reduce_scatter(in.data(), block.data(), n, DataType::kFloat32, op), ++calls;
      EXPECT_EQ(block, expect_block) << "reduce_scatter op " << reduce_op_name(op) << " n=" << n << " rank " << r;
      std::vector<float> same = in;
      g.reduce_scatter(same.data(), same.data() + r * n, n, DataType::kFloat32, op), ++calls;
      EXPECT_EQ(std::vector<float>(same.begin() + r * n, same.begin() + (r + 1) * n), expect_block)
          << "reduce_scatter on its own block, n=" << n << " rank " << r;
      same = in;
      g.reduce_scatter(same.data(), same.data(), n, DataType::kFloat32, op), ++calls;
      EXPECT_EQ(std::vector<float>(same.begin(), same.begin() + n), expect_block)
          << "reduce_scatter in == out, n=" << n << " rank " << r;
    }
    {
      std::vector<int32_t> in(n * W), out(n);
      for (size_t i = 0; i < n * W; ++i) in[i] = static_cast<int32_t>((r * 31 + i * 17) % 1000) - 500;
      g.reduce_scatter(in.data(), out.data(), n, DataType::kInt32, ReduceOp::kMax), ++calls;
      std::vector<int32_t> want_max(n, INT32_MIN);
      for (size_t i = 0; i < n; ++i)
        for (int q = 0; q < world; ++q)
          want_max[i] = std::max(want_max[i], static_cast<int32_t>((q * 31 + (r * n + i) * 17) % 1000) - 500);
      EXPECT_EQ(out, want_max) << "reduce_scatter int32 max n=" << n << " rank " << r;
    }

    for (int root = 0; root < world; ++root) {
      // gather of odd blocks to every root, and the root's in-place form (its block already in place).
      std::vector<uint8_t> gathered(r == root ? bytes * W : 0, 0xEE);
      g.gather(mine.data(), r == root ? gathered.data() : nullptr, bytes, root), ++calls;
      if (r == root) {
        EXPECT_EQ(gathered, want) << "gather root " << root << " n=" << n;
        std::fill(gathered.begin(), gathered.end(), 0xEE);
        std::memcpy(gathered.data() + r * bytes, mine.data(), bytes);
      }
      g.gather(r == root ? gathered.data() : mine.data(), r == root ? gathered.data() : nullptr, bytes, root), ++calls;
      if (r == root) {
        EXPECT_EQ(gathered, want) << "gather in place root " << root << " n=" << n;
      }
      // scatter: block q of the root's `want`-like table goes to rank q.
      std::vector<uint8_t> table(r == root ? bytes * W : 0), got(bytes, 0xEE);
      for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<uint8_t>(want[i] ^ root);
      g.scatter(r == root ? table.data() : nullptr, got.data(), bytes, root), ++calls;
      std::vector<uint8_t> block(bytes);
      for (size_t i = 0; i < bytes; ++i) block[i] = static_cast<uint8_t>(want[r * bytes + i] ^ root);
      EXPECT_EQ(got, block) << "scatter root " << root << " rank " << r;
      // broadcast of an odd size from every root.
      std::vector<uint8_t> sent(bytes * 5 + 3), buf(sent.size(), 0xEE);
      for (size_t i = 0; i < sent.size(); ++i) sent[i] = byte_of(root, root, i);
      if (r == root) buf = sent;
      g.broadcast(buf.data(), buf.size(), root), ++calls;
      EXPECT_EQ(buf, sent) << "broadcast root " << root << " rank " << r;
    }
  }
  return calls;
}

class ShmSingleCopyWorld : public ::testing::TestWithParam<int> {};

TEST_P(ShmSingleCopyWorld, EveryDataMovingCollectiveCopiesOnceAndMatchesItsDefinition) {
  const int world = GetParam();
  auto groups = make_groups(world, single_copy_options());
  test::run_ranks(world, [&](int r) {
    EXPECT_EQ(groups[r]->single_copy(), world > 1) << groups[r]->single_copy_why();
    const int calls = exercise(*groups[r], r, world);
    // Every call took the single-copy path (one rank alone copies locally and counts none).
    EXPECT_EQ(groups[r]->single_copies(), world > 1 ? static_cast<uint64_t>(calls) : 0u);
    groups[r]->barrier();
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmSingleCopyWorld, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// A single-copy broadcast keeps the root's core busy too: where the ranks have a CPU each, the root
// writes the last page-aligned bytes/P of every receiver's buffer while each receiver reads the rest;
// where they share CPUs (more ranks than this process may use), the receivers read it all. Sizes
// around the point where the share becomes one page (P*4096 - 1: the receivers copy all), odd sizes,
// every root, 2 to 4 ranks (as threads: their CPU sets are this process's).
TEST(ShmSingleCopy, BroadcastRootWritesItsShareIntoEveryReceiverWhileTheyReadTheRest) {
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof allowed, &allowed), 0);
  const int cpus = CPU_COUNT(&allowed);
  for (int world = 2; world <= 4; ++world) {
    auto groups = make_groups(world, single_copy_options());
    const size_t W = static_cast<size_t>(world);
    const bool splits = cpus >= world;
    const std::vector<size_t> sizes = {W * 4096 - 1, W * 4096, W * 4096 + 1, W * 4096 * 3 + 77, (size_t{3} << 20) + 5};
    test::run_ranks(world, [&](int r) {
      Group& g = *groups[r];
      EXPECT_EQ(g.broadcast_splits(), splits) << world << " ranks, " << cpus << " CPUs";
      for (const size_t n : sizes) {
        EXPECT_EQ(Group::broadcast_root_share(n, world), n / W / 4096 * 4096) << "n=" << n;
        const size_t share = splits ? Group::broadcast_root_share(n, world) : 0;
        for (int root = 0; root < world; ++root) {
          std::vector<uint8_t> sent(n), buf(n, 0xEE);
          for (size_t i = 0; i < n; ++i) sent[i] = byte_of(root, world, i);
          if (r == root) buf = sent;
          const Group::CopiedBytes before = g.single_copied();
          g.broadcast(buf.data(), n, root);
          const Group::CopiedBytes after = g.single_copied();
          ASSERT_EQ(buf, sent) << "broadcast n=" << n << " root " << root << " rank " << r << " of " << world;
          if (r == root) {
            EXPECT_EQ(after.pushed - before.pushed, (W - 1) * share) << "root's writes, n=" << n << " of " << world;
            EXPECT_EQ(after.pulled, before.pulled) << "n=" << n;
          } else {
            EXPECT_EQ(after.pulled - before.pulled, n - share) << "receiver's reads, n=" << n << " of " << world;
            EXPECT_EQ(after.pushed, before.pushed) << "n=" << n;
          }
        }
      }
      // Every rank was a root with shares of whole pages: it wrote into its peers exactly when split.
      EXPECT_EQ(g.single_copied().pushed > 0, splits) << "rank " << r << " of " << world;
    });
  }
}

TEST(ShmSingleCopy, TurnedOffEveryRankStagesAndSaysWhy) {
  GroupOptions o = single_copy_options();
  o.single_copy = false;
  auto groups = make_groups(3, o);
  test::run_ranks(3, [&](int r) {
    EXPECT_FALSE(groups[r]->single_copy());
    EXPECT_NE(groups[r]->single_copy_why().find("COHORT_SHM_SINGLE_COPY=0"), std::string::npos)
        << groups[r]->single_copy_why();
    EXPECT_FALSE(groups[r]->single_copy_for(size_t{1} << 30));
    // allgather and broadcast still run, staged through the slots.
    std::vector<uint8_t> mine(5001, static_cast<uint8_t>(r + 1)), all(5001 * 3);
    groups[r]->allgather(mine.data(), all.data(), mine.size());
    for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], i / 5001 + 1);
    EXPECT_EQ(groups[r]->single_copies(), 0u);
  });
}

TEST(ShmSingleCopy, OneRankOffTurnsItOffForAll) {
  // The verdict must be alike on every rank (each decides its path alone): one rank that cannot (here:
  // will not) copy single keeps every rank on the staged paths.
  const std::string address = random_address("single-copy-one-off");
  std::vector<std::unique_ptr<Group>> groups(2);
  test::run_ranks(2, [&](int r) {
    GroupOptions o = single_copy_options();
    o.single_copy = r == 0;
    groups[r] = Group::create_at(address, r, 2, milliseconds(20000), o);
    EXPECT_FALSE(groups[r]->single_copy()) << "rank " << r;
  });
}

TEST(ShmSingleCopy, AlltoallvCountsThatDisagreeAreAMismatchNamingTheSender) {
  auto groups = make_groups(2, single_copy_options());
  std::vector<std::string> errors(2);
  const auto start = std::chrono::steady_clock::now();
  test::run_ranks(2, [&](int r) {
    // Rank 1 sends 4 elements to rank 0, which expects 3; rank 0 sends 2, as rank 1 expects.
    std::vector<size_t> sc = r == 0 ? std::vector<size_t>{1, 2} : std::vector<size_t>{4, 1};
    std::vector<size_t> rc = r == 0 ? std::vector<size_t>{1, 3} : std::vector<size_t>{2, 1};
    std::vector<size_t> sd{0, 4}, rd{0, 4};
    std::vector<uint32_t> s(8, 1), d(8, 0);
    try {
      groups[r]->alltoallv(s.data(), sc.data(), sd.data(), d.data(), rc.data(), rd.data(), sizeof(uint32_t));
    } catch (const Error& e) {
      errors[r] = e.what();
    }
  });
  EXPECT_NE(errors[0].find("local rank 1 sends 4 elements to local rank 0, which expects 3"), std::string::npos)
      << errors[0];
  EXPECT_FALSE(errors[1].empty()) << "rank 1 must fail too (its peer failed the call)";
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

// Forked processes: the copies cross address spaces, as in a job.
TEST(ShmSingleCopyProcesses, ThreeProcessesCopyBetweenTheirOwnBuffersFromTheDefaultSizeOn) {
  const int world = 3;
  const std::string address = random_address("single-copy-procs");
  // A rank's exit code names the check that failed (an exception: 99, its message on stderr).
  const std::vector<pid_t> pids = test::fork_ranks(world, [&](int r) {
    GroupOptions o = GroupOptions::from_env(world);
    o.single_copy = true;
    o.single_copy_bytes = size_t{1} << 20;
    auto g = Group::create_at(address, r, world, milliseconds(20000), o);
    int code = !g->single_copy() ? 10 : 0;
    // 1 MiB + 7 bytes per rank (over the limit, not divisible by 3), and 1000 bytes (under it).
    for (size_t bytes : {(size_t{1} << 20) + 7, size_t{1000}}) {
      std::vector<uint8_t> mine(bytes), all(bytes * world);
      for (size_t i = 0; i < bytes; ++i) mine[i] = byte_of(r, -1, i);
      const uint64_t before = g->single_copies();
      g->allgather(mine.data(), all.data(), bytes);
      for (int q = 0; q < world && code == 0; ++q)
        for (size_t i = 0; i < bytes; ++i)
          if (all[q * bytes + i] != byte_of(q, -1, i)) code = 11;
      if (code == 0 && (g->single_copies() - before == 1) != (bytes * world >= (size_t{1} << 20))) code = 12;
      std::vector<size_t> counts(world, bytes), displs(world);
      for (int q = 0; q < world; ++q) displs[q] = q * bytes;
      std::vector<uint8_t> send(bytes * world), recv(bytes * world);
      for (int q = 0; q < world; ++q)
        for (size_t i = 0; i < bytes; ++i) send[q * bytes + i] = byte_of(r, q, i);
      g->alltoallv(send.data(), counts.data(), displs.data(), recv.data(), counts.data(), displs.data(), 1);
      for (int q = 0; q < world && code == 0; ++q)
        for (size_t i = 0; i < bytes; ++i)
          if (recv[q * bytes + i] != byte_of(q, r, i)) code = 13;
      // broadcast of the whole size from every root: over the limit the root writes a share into
      // each other process while they read the rest (push and pull across address spaces).
      const size_t total = bytes * world;
      for (int root = 0; root < world && code == 0; ++root) {
        std::vector<uint8_t> buf(total, 0xEE);
        if (r == root)
          for (size_t i = 0; i < total; ++i) buf[i] = byte_of(root, world, i);
        const Group::CopiedBytes was = g->single_copied();
        g->broadcast(buf.data(), total, root);
        for (size_t i = 0; i < total && code == 0; ++i)
          if (buf[i] != byte_of(root, world, i)) code = 14;
        const uint64_t share =
            total >= (size_t{1} << 20) && g->broadcast_splits() ? Group::broadcast_root_share(total, world) : 0;
        if (code == 0 && r == root && g->single_copied().pushed - was.pushed != (world - 1) * share) code = 15;
      }
    }
    g->barrier();
    return code;
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int r = 0; r < world; ++r) {
    const int status = test::wait_for_exit(pids[r], deadline);
    EXPECT_TRUE(test::exited_zero(status)) << "rank " << r << ": " << test::describe_exit(status)
                                           << " (10: no single copy, 11: allgather wrong, "
                                           << "12: wrong path for the size, 13: alltoall wrong, 14: broadcast wrong, "
                                           << "15: the broadcast's root did not write its share)";
  }
}

}  // namespace
}  // namespace cohort::shm

namespace cohort {
namespace {

// Through the communicator (3 ranks as threads, transport shm): allgatherv, alltoall(v), gather and
// scatter go to the group from its single-copy size on and over the transports below it, with the same
// results either way.
TEST(ShmSingleCopyCommunicator, LargeDataMovingCollectivesRunOnTheGroupAndSmallOnesOnTheTransports) {
  auto store = make_memory_store();
  test::run_ranks(3, [&](int r) {
    CommOptions o;
    o.timeout = std::chrono::seconds(10);  // a rank that failed an assertion leaves the others waiting
    o.transport = "shm";
    auto comm = Communicator::create(store, r, 3, o);
    auto* impl = dynamic_cast<comm::CommunicatorImpl*>(comm.get());
    ASSERT_TRUE(impl && impl->shm_group());
    shm::Group& g = *impl->shm_group();
    ASSERT_TRUE(g.single_copy()) << g.single_copy_why();
    EXPECT_NE(comm->link_report().find("large transfers: single copy"), std::string::npos) << comm->link_report();
    // Per rank 349,526 floats (3 x that is just over 4 MiB, above the default 1 MiB) and 1001 (under it).
    for (size_t n : {size_t{349526}, size_t{1001}}) {
      const bool large = n * 3 * sizeof(float) >= (size_t{1} << 20);
      const uint64_t before = g.single_copies();
      std::vector<float> send(n * 3), recv(n * 3, -1);
      for (size_t i = 0; i < send.size(); ++i) send[i] = static_cast<float>(r * 1000000 + i);
      comm->alltoall(send.data(), recv.data(), n, DataType::kFloat32);
      for (int q = 0; q < 3; ++q)
        for (size_t i = 0; i < n; i += 997)
          ASSERT_EQ(recv[q * n + i], static_cast<float>(q * 1000000 + r * n + i)) << "alltoall n=" << n;
      std::vector<size_t> counts(3, n), displs{0, n, 2 * n};
      comm->alltoallv(send.data(), counts, displs, recv.data(), counts, displs, DataType::kFloat32);
      ASSERT_EQ(recv[2 * n + n - 1], static_cast<float>(2 * 1000000 + r * n + n - 1)) << "alltoallv n=" << n;
      std::vector<float> mine(n, static_cast<float>(r + 1)), all(n * 3, 0);
      comm->gather(mine.data(), all.data(), n, DataType::kFloat32, 1);
      if (r == 1) {
        for (size_t i = 0; i < all.size(); i += 991) ASSERT_EQ(all[i], static_cast<float>(i / n + 1)) << "gather";
      }
      std::vector<float> part(n, 0);
      comm->scatter(send.data(), part.data(), n, DataType::kFloat32, 2);
      ASSERT_EQ(part[n - 1], static_cast<float>(2 * 1000000 + r * n + n - 1)) << "scatter n=" << n;
      std::vector<size_t> vcounts{n, 0, n + 1};
      std::vector<float> vmine(vcounts[r], static_cast<float>(r + 5)), vall(2 * n + 1, 0);
      comm->allgatherv(vmine.data(), vmine.size(), vall.data(), vcounts, DataType::kFloat32);
      ASSERT_EQ(vall[0], 5.0f);
      ASSERT_EQ(vall[2 * n], 7.0f) << "allgatherv n=" << n;
      // alltoallv takes the group whenever single copy is on; the other four only when large.
      const uint64_t want = large ? 5 : 1;
      EXPECT_EQ(g.single_copies() - before, want) << "n=" << n;
    }
  });
}

}  // namespace
}  // namespace cohort
