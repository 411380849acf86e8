// shm::Group's single-copy collectives on allocate_shared buffers: a peer's buffer that this rank maps is
// copied with plain loads and stores (reduce_scatter reduces it where it lies), not by the kernel. Every
// data-moving collective gives its definition's bytes with every buffer shared, with some ranks' buffers
// shared and others' not, and after a rank has dropped the allocation a peer's buffer lies in (the kernel
// copies then); the copy report says how many bytes went through the mapping. 2 and 3 ranks as threads,
// and 2 forked processes.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "collectives/shm/group.h"
#include "support/fork_ranks.h"
#include "single_copy_support.h"
#include "support/test_support.h"

namespace cohort::shm {
namespace {

using std::chrono::milliseconds;

using test_single_copy::byte_of;

// A rank's buffers for one round of collectives: from allocate_shared (a collective call: every rank makes
// them in the same order) or ordinary memory, as `shared` says for this rank.
struct Buffers {
  std::shared_ptr<void> send_memory, recv_memory;
  std::vector<uint8_t> send_private, recv_private;
  uint8_t* send = nullptr;
  uint8_t* recv = nullptr;
  Buffers(Group& g, size_t send_bytes, size_t recv_bytes, bool shared) {
    send_memory = g.allocate_shared(send_bytes);
    recv_memory = g.allocate_shared(recv_bytes);
    if (shared) {
      send = static_cast<uint8_t*>(send_memory.get()), recv = static_cast<uint8_t*>(recv_memory.get());
    } else {
      send_private.resize(send_bytes), recv_private.resize(recv_bytes);
      send = send_private.data(), recv = recv_private.data();
    }
  }
};

// Every collective of the single-copy path on `bytes` per block, each buffer shared where shared(rank)
// says; checks every byte against the definition. Returns the bytes this rank copied from or into a peer
// whose buffer was shared (these must all have gone through the mapping).
template <typename SharedOf>
uint64_t exercise(Group& g, int r, int world, size_t bytes, SharedOf shared_of) {
  const size_t W = static_cast<size_t>(world);
  const bool mine_shared = shared_of(r);
  uint64_t expect_mapped = 0;
  std::map<std::string, size_t> wrong;  // bytes or elements unlike the definition, per collective
  auto peers_shared = [&](int except) {
    uint64_t n = 0;
    for (int q = 0; q < world; ++q) n += q != except && shared_of(q);
    return n;
  };
  {  // allgather: each rank reads every peer's contribution
    Buffers b(g, bytes, bytes * W, mine_shared);
    for (size_t i = 0; i < bytes; ++i) b.send[i] = byte_of(r, -1, i);
    g.allgather(b.send, b.recv, bytes);
    for (int q = 0; q < world; ++q)
      for (size_t i = 0; i < bytes; ++i) if (b.recv[q * bytes + i] != byte_of(q, -1, i)) ++wrong["allgather"];
    expect_mapped += peers_shared(r) * bytes;
  }
  {  // alltoall (uniform alltoallv): block q of each rank's input goes to rank q
    Buffers b(g, bytes * W, bytes * W, mine_shared);
    for (int q = 0; q < world; ++q)
      for (size_t i = 0; i < bytes; ++i) b.send[q * bytes + i] = byte_of(r, q, i);
    std::vector<size_t> counts(W, bytes), displs(W);
    for (size_t q = 0; q < W; ++q) displs[q] = q * bytes;
    g.alltoallv(b.send, counts.data(), displs.data(), b.recv, counts.data(), displs.data(), 1);
    for (int q = 0; q < world; ++q)
      for (size_t i = 0; i < bytes; ++i) if (b.recv[q * bytes + i] != byte_of(q, r, i)) ++wrong["alltoall"];
    expect_mapped += peers_shared(r) * bytes;
  }
  {  // reduce_scatter of int32 sums (exact in any order): the peers' inputs are reduced where they lie
    const size_t n = bytes / 4;
    Buffers b(g, n * 4 * W, n * 4, mine_shared);
    auto value = [](int rank, size_t i) { return static_cast<int32_t>((rank * 131 + i * 7) % 1000) - 300; };
    auto* in = reinterpret_cast<int32_t*>(b.send);
    for (size_t i = 0; i < n * W; ++i) in[i] = value(r, i);
    g.reduce_scatter(b.send, b.recv, n, DataType::kInt32, ReduceOp::kSum);
    const auto* out = reinterpret_cast<const int32_t*>(b.recv);
    for (size_t i = 0; i < n; ++i) {
      int32_t want = 0;
      for (int q = 0; q < world; ++q) want += value(q, r * n + i);
      if (out[i] != want) ++wrong["reduce_scatter"];
    }
    expect_mapped += peers_shared(r) * n * 4;
  }
  for (int root = 0; root < world; ++root) {
    {  // gather: the others write their block into the root's output
      Buffers b(g, bytes, bytes * W, mine_shared);
      for (size_t i = 0; i < bytes; ++i) b.send[i] = byte_of(r, root, i);
      g.gather(b.send, r == root ? b.recv : nullptr, bytes, root);
      if (r == root)
        for (int q = 0; q < world; ++q)
          for (size_t i = 0; i < bytes; ++i) if (b.recv[q * bytes + i] != byte_of(q, root, i)) ++wrong["gather"];
      if (r != root && shared_of(root)) expect_mapped += bytes;
    }
    {  // scatter: the others read their block from the root's input
      Buffers b(g, bytes * W, bytes, mine_shared);
      if (r == root)
        for (size_t i = 0; i < bytes * W; ++i) b.send[i] = byte_of(root, static_cast<int>(i / bytes), i);
      g.scatter(r == root ? b.send : nullptr, b.recv, bytes, root);
      for (size_t i = 0; i < bytes; ++i) if (b.recv[i] != byte_of(root, r, r * bytes + i)) ++wrong["scatter"];
      if (r != root && shared_of(root)) expect_mapped += bytes;
    }
    {  // broadcast: the receivers read from the root's buffer, the root may write a share into theirs
      Buffers b(g, bytes * W, 0, mine_shared);
      if (r == root)
        for (size_t i = 0; i < bytes * W; ++i) b.send[i] = byte_of(root, root, i);
      const Group::CopiedBytes before = g.single_copied();
      g.broadcast(b.send, bytes * W, root);
      for (size_t i = 0; i < bytes * W; ++i) if (b.send[i] != byte_of(root, root, i)) ++wrong["broadcast"];
      const Group::CopiedBytes after = g.single_copied();
      if (r != root && shared_of(root)) expect_mapped += after.pulled - before.pulled;
      if (r == root)
        for (int q = 0; q < world; ++q)
          if (q != root && shared_of(q)) expect_mapped += (after.pushed - before.pushed) / (W - 1);
    }
  }
  for (const auto& [what, n] : wrong) EXPECT_EQ(n, 0u) << what << ", rank " << r << ", " << bytes << " bytes per block";
  return expect_mapped;
}

std::vector<std::unique_ptr<Group>> make_groups(int world) {
  return test_single_copy::make_groups(world, test_single_copy::single_copy_options(), "shared-buffers");
}

class ShmSharedBuffersWorld : public ::testing::TestWithParam<int> {};

// Every buffer shared: every byte that crosses between ranks goes through the mapping.
TEST_P(ShmSharedBuffersWorld, EveryCollectiveCopiesThroughTheMappingAndMatchesItsDefinition) {
  const int world = GetParam();
  auto groups = make_groups(world);
  test::run_ranks(world, [&](int r) {
    Group& g = *groups[r];
    ASSERT_TRUE(g.single_copy()) << g.single_copy_why();
    for (size_t bytes : {size_t{4}, size_t{4096 * 3 + 20}, size_t{300000}}) {
      const Group::CopiedBytes before = g.single_copied();
      const uint64_t want = exercise(g, r, world, bytes, [](int) { return true; });
      const Group::CopiedBytes after = g.single_copied();
      EXPECT_EQ(after.mapped - before.mapped, want) << "rank " << r << ", " << bytes << " bytes per block";
      EXPECT_EQ(after.mapped - before.mapped, (after.pulled - before.pulled) + (after.pushed - before.pushed))
          << "rank " << r << ": some bytes were copied by the kernel";
    }
    g.barrier();
  });
}

// Rank 0's buffers shared, the others' ordinary: each transfer goes its own way (mapped from or into rank
// 0's, the kernel for the rest), with the same results.
TEST_P(ShmSharedBuffersWorld, SharedAndPrivateBuffersMixInOneCall) {
  const int world = GetParam();
  auto groups = make_groups(world);
  test::run_ranks(world, [&](int r) {
    Group& g = *groups[r];
    const Group::CopiedBytes before = g.single_copied();
    const uint64_t want = exercise(g, r, world, 4096 * 5 + 12, [](int q) { return q == 0; });
    const Group::CopiedBytes after = g.single_copied();
    EXPECT_EQ(after.mapped - before.mapped, want) << "rank " << r;
    if (r == 0) {  // every peer of rank 0 has ordinary buffers
      EXPECT_EQ(after.mapped - before.mapped, 0u) << "rank 0's peers' buffers must have been copied by the kernel";
    }
    EXPECT_GT((after.pulled - before.pulled) + (after.pushed - before.pushed), 0u) << "rank " << r;
    g.barrier();
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmSharedBuffersWorld, ::testing::Values(2, 3),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// A rank that has dropped its handle of an allocation no longer maps it: a peer's buffer in that
// allocation is then read by the kernel, and the result is the same.
TEST(ShmSharedBuffers, AnAllocationThisRankDroppedIsCopiedByTheKernel) {
  auto groups = make_groups(2);
  test::run_ranks(2, [&](int r) {
    Group& g = *groups[r];
    const size_t bytes = 100000;
    std::shared_ptr<void> memory = g.allocate_shared(bytes);
    auto* in = static_cast<uint8_t*>(memory.get());
    for (size_t i = 0; i < bytes; ++i) in[i] = byte_of(r, -1, i);
    std::vector<uint8_t> out(2 * bytes);
    if (r == 1) {  // rank 1 contributes a copy in ordinary memory and lets go of the allocation
      std::vector<uint8_t> copy(in, in + bytes);
      memory.reset();
      const Group::CopiedBytes before = g.single_copied();
      g.allgather(copy.data(), out.data(), bytes);
      EXPECT_EQ(g.single_copied().mapped, before.mapped) << "rank 1 no longer maps rank 0's part";
      EXPECT_EQ(g.single_copied().pulled - before.pulled, bytes);
    } else {
      const Group::CopiedBytes before = g.single_copied();
      g.allgather(in, out.data(), bytes);
      EXPECT_EQ(g.single_copied().mapped, before.mapped) << "rank 1's input is ordinary memory";
    }
    for (int q = 0; q < 2; ++q)
      for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(out[q * bytes + i], byte_of(q, -1, i)) << "rank " << r;
    g.barrier();
  });
}

// Two processes: the mapping is each process's own view of the peer's part (not the same address), and
// an allgather and an alltoall of 1 MiB blocks from shared inputs copy every byte through it.
TEST(ShmSharedBuffersProcesses, TwoProcessesCopyThroughTheirOwnMappingsOfThePeersPart) {
  const int world = 2;
  const std::string address = random_address("shared-buffers-procs");
  // A rank's exit code names the check that failed (an exception: 99, its message on stderr).
  const std::vector<pid_t> pids = test::fork_ranks(world, [&](int r) {
    GroupOptions o = GroupOptions::from_env(world);
    o.single_copy = true;
    auto g = Group::create_at(address, r, world, milliseconds(20000), o);
    if (!g->single_copy()) return 10;
    const size_t bytes = (size_t{1} << 20) + 64;
    std::shared_ptr<void> send = g->allocate_shared(bytes * world);
    auto* in = static_cast<uint8_t*>(send.get());
    for (size_t i = 0; i < bytes * world; ++i) in[i] = byte_of(r, static_cast<int>(i / bytes), i);
    std::vector<uint8_t> out(bytes * world);
    g->allgather(in, out.data(), bytes);  // every rank contributes the start of its input
    for (int q = 0; q < world; ++q)
      for (size_t i = 0; i < bytes; ++i)
        if (out[q * bytes + i] != byte_of(q, 0, i)) return 11;
    std::vector<size_t> counts(world, bytes), displs{0, bytes};
    g->alltoallv(in, counts.data(), displs.data(), out.data(), counts.data(), displs.data(), 1);
    for (int q = 0; q < world; ++q)
      for (size_t i = 0; i < bytes; ++i)
        if (out[q * bytes + i] != byte_of(q, r, r * bytes + i)) return 12;
    if (g->single_copied().mapped != 2 * bytes || g->single_copied().pulled != 2 * bytes) return 13;
    g->barrier();
    return 0;
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int r = 0; r < world; ++r) {
    const int status = test::wait_for_exit(pids[r], deadline);
    EXPECT_TRUE(test::exited_zero(status)) << "rank " << r << ": " << test::describe_exit(status)
                                           << " (10: no single copy, 11: allgather wrong, 12: alltoall wrong, "
                                           << "13: not every byte went through the mapping)";
  }
}

}  // namespace
}  // namespace cohort::shm
