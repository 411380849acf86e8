// Every other communicator operation on ranks-as-threads (loopback TCP, memory store): rooted ops,
// gathers, scatters, reduce_scatter, alltoall(v), p2p, async, split/subgroup, bad input, abort,
// mismatch, and the launch-environment parser.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <numeric>
#include <thread>
#include <vector>

#include "cohort/communicator.h"
#include "comm/launch_env.h"
#include "store/memory_store.h"
#include "support/test_support.h"

namespace cohort {
namespace {

using test::run_ranks;

std::shared_ptr<Communicator> make(std::shared_ptr<Store> store, int rank, int world, int timeout_s = 30) {
  CommOptions o;
  o.timeout = std::chrono::seconds(timeout_s);
  return Communicator::create(store, rank, world, o);
}

// int64 values make every check exact; sizes 0, 1, a prime and one not divisible by the world.
const size_t kCounts[] = {0, 1, 13, 1000, 70001};

int64_t val(int rank, size_t i) { return int64_t(rank) * 1000003 + int64_t(i); }

TEST(Ops, RootedAndGatheringOpsAtEveryWorldSize) {
  for (int world = 1; world <= 8; ++world) {
    auto store = make_memory_store();
    run_ranks(world, [&](int rank) {
      auto comm = make(store, rank, world);
      EXPECT_EQ(comm->rank(), rank);
      EXPECT_EQ(comm->size(), world);
      EXPECT_EQ(comm->local_size(), world);
      EXPECT_EQ(comm->local_rank(), rank);
      for (size_t n : kCounts) {
        if (world > 5 && n > 1000) continue;  // keep the suite fast
        const DataType t = DataType::kInt64;
        int root = int(n % size_t(world));
        // broadcast
        std::vector<int64_t> b(n);
        for (size_t i = 0; i < n; ++i) b[i] = rank == root ? val(root, i) : -1;
        comm->broadcast(b.data(), n, t, root);
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(b[i], val(root, i));
        // reduce (sum) to root
        std::vector<int64_t> in(n), out(n, -1);
        for (size_t i = 0; i < n; ++i) in[i] = val(rank, i);
        comm->reduce(in.data(), out.data(), n, t, ReduceOp::kSum, root);
        if (rank == root) {
          for (size_t i = 0; i < n; ++i) {
            int64_t want = 0;
            for (int r = 0; r < world; ++r) want += val(r, i);
            ASSERT_EQ(out[i], want) << i;
          }
        }
        // allgather
        std::vector<int64_t> all(n * size_t(world), -1);
        comm->allgather(in.data(), all.data(), n, t);
        for (int r = 0; r < world; ++r)
          for (size_t i = 0; i < n; ++i) ASSERT_EQ(all[size_t(r) * n + i], val(r, i));
        // gather
        std::vector<int64_t> g(rank == root ? n * size_t(world) : 0, -1);
        comm->gather(in.data(), g.data(), n, t, root);
        if (rank == root) {
          for (int r = 0; r < world; ++r)
            for (size_t i = 0; i < n; ++i) ASSERT_EQ(g[size_t(r) * n + i], val(r, i));
        }
        // scatter
        std::vector<int64_t> src(rank == root ? n * size_t(world) : 0), dst(n, -1);
        if (rank == root)
          for (int r = 0; r < world; ++r)
            for (size_t i = 0; i < n; ++i) src[size_t(r) * n + i] = val(r, i) + 7;
        comm->scatter(src.data(), dst.data(), n, t, root);
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(dst[i], val(rank, i) + 7);
        // reduce_scatter (max)
        std::vector<int64_t> rs_in(n * size_t(world)), rs_out(n, -1);
        for (size_t i = 0; i < rs_in.size(); ++i) rs_in[i] = val(rank, i);
        comm->reduce_scatter(rs_in.data(), rs_out.data(), n, t, ReduceOp::kMax);
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(rs_out[i], val(world - 1, size_t(rank) * n + i));
        // alltoall
        std::vector<int64_t> a_in(n * size_t(world)), a_out(n * size_t(world), -1);
        for (int r = 0; r < world; ++r)
          for (size_t i = 0; i < n; ++i) a_in[size_t(r) * n + i] = val(rank, i) * 10 + r;
        comm->alltoall(a_in.data(), a_out.data(), n, t);
        for (int r = 0; r < world; ++r)
          for (size_t i = 0; i < n; ++i) ASSERT_EQ(a_out[size_t(r) * n + i], val(r, i) * 10 + rank);
      }
      comm->barrier();
    });
  }
}

TEST(Ops, AllgathervAndAlltoallvWithUnevenCounts) {
  for (int world : {1, 3, 4, 7}) {
    auto store = make_memory_store();
    run_ranks(world, [&](int rank) {
      auto comm = make(store, rank, world);
      std::vector<size_t> counts(static_cast<size_t>(world));
      for (int r = 0; r < world; ++r) counts[size_t(r)] = size_t(r * 3 % 5);  // includes zeros
      size_t total = std::accumulate(counts.begin(), counts.end(), size_t(0));
      std::vector<int32_t> mine(counts[size_t(rank)]), all(total, -1);
      for (size_t i = 0; i < mine.size(); ++i) mine[i] = rank * 100 + int(i);
      comm->allgatherv(mine.data(), mine.size(), all.data(), counts, DataType::kInt32);
      size_t k = 0;
      for (int r = 0; r < world; ++r)
        for (size_t i = 0; i < counts[size_t(r)]; ++i) ASSERT_EQ(all[k++], r * 100 + int(i));
      // alltoallv: rank r sends (r + p) % 3 elements to p
      std::vector<size_t> sc(static_cast<size_t>(world)), sd(static_cast<size_t>(world)), rc(static_cast<size_t>(world)),
          rd(static_cast<size_t>(world));
      size_t so = 0, ro = 0;
      for (int p = 0; p < world; ++p) {
        sc[size_t(p)] = size_t((rank + p) % 3);
        sd[size_t(p)] = so;
        so += sc[size_t(p)];
        rc[size_t(p)] = size_t((p + rank) % 3);
        rd[size_t(p)] = ro;
        ro += rc[size_t(p)];
      }
      std::vector<int32_t> s(so), r(ro, -1);
      for (int p = 0; p < world; ++p)
        for (size_t i = 0; i < sc[size_t(p)]; ++i) s[sd[size_t(p)] + i] = rank * 1000 + p * 10 + int(i);
      comm->alltoallv(s.data(), sc, sd, r.data(), rc, rd, DataType::kInt32);
      for (int p = 0; p < world; ++p)
        for (size_t i = 0; i < rc[size_t(p)]; ++i) ASSERT_EQ(r[rd[size_t(p)] + i], p * 1000 + rank * 10 + int(i));
    });
  }
}

TEST(Ops, PointToPointMatchesPerTagInOrder) {
  auto store = make_memory_store();
  run_ranks(2, [&](int rank) {
    auto comm = make(store, rank, 2);
    if (rank == 0) {
      for (int i = 0; i < 5; ++i) {
        int64_t v = i;
        comm->send(&v, 1, DataType::kInt64, 1, /*tag=*/uint32_t(i % 2));
      }
    } else {
      // tag 1 messages first: tags are independent streams
      for (int i : {1, 3, 0, 2, 4}) {
        int64_t v = -1;
        comm->recv(&v, 1, DataType::kInt64, 0, uint32_t(i % 2));
        ASSERT_EQ(v, i);
      }
    }
  });
}

// A receive from any source takes each sender's messages in order, names the sender, and mixes with
// receives that name it (one (peer, tag) stream either way). Ranks 1-3 each send 4 messages with tag 7
// and one with tag 9; rank 0 takes tag 9 from rank 2 by name first, then 12 from any source.
TEST(Ops, ReceiveFromAnySourceNamesTheSenderAndKeepsEachSendersOrder) {
  auto store = make_memory_store();
  run_ranks(4, [&](int rank) {
    auto comm = make(store, rank, 4);
    if (rank != 0) {
      int64_t tagged = rank * 100;
      comm->send(&tagged, 1, DataType::kInt64, 0, 9);
      for (int i = 0; i < 4; ++i) {
        int64_t v = rank * 10 + i;
        comm->send(&v, 1, DataType::kInt64, 0, 7);
      }
      return;
    }
    int64_t v = -1;
    comm->recv(&v, 1, DataType::kInt64, 2, 9);
    EXPECT_EQ(v, 200);
    std::map<int, std::vector<int64_t>> got;
    for (int i = 0; i < 12; ++i) {
      int from = comm->recv_any(&v, 1, DataType::kInt64, 7);
      ASSERT_GE(from, 1);
      ASSERT_LE(from, 3);
      EXPECT_EQ(v / 10, from) << "the value names its sender";
      got[from].push_back(v);
    }
    for (int r = 1; r <= 3; ++r) EXPECT_EQ(got[r], (std::vector<int64_t>{r * 10, r * 10 + 1, r * 10 + 2, r * 10 + 3}));
    // Ranks 1 and 3 still have their tag-9 messages for rank 0: from any source, both come.
    std::set<int> senders;
    for (int i = 0; i < 2; ++i) senders.insert(comm->recv_any(&v, 1, DataType::kInt64, 9));
    EXPECT_EQ(senders, (std::set<int>{1, 3}));
  });
}

TEST(Ops, ReceiveFromAnySourceTimesOutNamingTheRanksAndTag) {
  auto store = make_memory_store();
  std::string error;
  run_ranks(3, [&](int rank) {
    auto comm = make(store, rank, 3, /*timeout_s=*/1);
    if (rank == 0) {
      int64_t v;
      try {
        comm->recv_any(&v, 1, DataType::kInt64, 5);
      } catch (const TimeoutError& e) {
        error = e.what();
      }
    }
    store->barrier("any-done", rank, 3, std::chrono::seconds(10));
  });
  EXPECT_NE(error.find("a message with tag 5 from any of rank(s) 1-2 (recv from any source)"), std::string::npos)
      << error;
}

// send_async/recv_async are posted at once: each rank posts its receive before its send, and both
// complete (a blocking recv-then-send on both ranks would wait for ever). Large messages too (more
// than a socket's or a ring's buffer), and each test() moves them along without a wait.
TEST(Ops, NonBlockingSendAndReceivePostedInAnyOrderComplete) {
  for (size_t n : {size_t(1), size_t(3) << 20}) {
    auto store = make_memory_store();
    run_ranks(2, [&](int rank) {
      auto comm = make(store, rank, 2);
      const int peer = 1 - rank;
      std::vector<int32_t> out(n, rank + 1), in(n, -1);
      auto r = comm->recv_async(in.data(), n, DataType::kInt32, peer, 3);
      auto s = comm->send_async(out.data(), n, DataType::kInt32, peer, 3);
      if (rank == 0) {
        auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (!(r->test() && s->test()) && std::chrono::steady_clock::now() < until) std::this_thread::yield();
        ASSERT_TRUE(r->test() && s->test()) << "test() alone moves the messages";
      }
      r->wait();
      s->wait();
      EXPECT_EQ(r->exception(), nullptr);
      EXPECT_EQ(in[0], peer + 1);
      EXPECT_EQ(in[n - 1], peer + 1);
      // The blocking forms take the next messages of the same streams.
      int32_t x = rank * 7, y = -1;
      if (rank == 0) {
        comm->send(&x, 1, DataType::kInt32, peer, 3);
      } else {
        comm->recv(&y, 1, DataType::kInt32, peer, 3);
        EXPECT_EQ(y, 0);
      }
    });
  }
}

TEST(Ops, NonBlockingReceiveThatNeverMatchesFailsAtTheDeadlineNamingThePeer) {
  auto store = make_memory_store();
  std::string error;
  run_ranks(2, [&](int rank) {
    auto comm = make(store, rank, 2, /*timeout_s=*/1);
    if (rank == 0) {
      int64_t v;
      auto r = comm->recv_async(&v, 1, DataType::kInt64, 1, 4);
      try {
        r->wait();
      } catch (const TimeoutError& e) {
        error = e.what();
      }
      EXPECT_TRUE(r->test());
      EXPECT_NE(r->exception(), nullptr);
    }
    store->barrier("nb-done", rank, 2, std::chrono::seconds(10));
  });
  EXPECT_NE(error.find("waiting for rank(s) 1"), std::string::npos) << error;
}

TEST(Ops, AsyncWorkRunsInCallOrderWithBlockingCalls) {
  auto store = make_memory_store();
  run_ranks(3, [&](int rank) {
    auto comm = make(store, rank, 3);
    const size_t n = 100000;
    std::vector<std::vector<float>> bufs(4, std::vector<float>(n, float(rank + 1)));
    std::vector<std::shared_ptr<Work>> works;
    for (auto& b : bufs) works.push_back(comm->allreduce_async(b.data(), b.data(), n, DataType::kFloat32, ReduceOp::kSum));
    std::vector<float> g(3);
    float mine = float(rank);
    auto ag = comm->allgather_async(&mine, g.data(), 1, DataType::kFloat32);
    float x = float(rank);
    comm->allreduce(&x, &x, 1, DataType::kFloat32, ReduceOp::kMax);  // blocking, after the queue
    EXPECT_EQ(x, 2.0f);
    for (auto& w : works) w->wait();
    ag->wait(std::chrono::seconds(10));
    EXPECT_TRUE(ag->test());
    EXPECT_EQ(ag->exception(), nullptr);
    for (auto& b : bufs) EXPECT_EQ(b[n - 1], 6.0f);
    EXPECT_EQ(g, (std::vector<float>{0, 1, 2}));
    comm->barrier_async()->wait();
  });
}

TEST(Ops, SplitAndSubgroupAreIndependentCommunicators) {
  auto store = make_memory_store();
  run_ranks(5, [&](int rank) {
    auto comm = make(store, rank, 5);
    auto half = comm->split(rank % 2, -rank);  // key reverses the order
    ASSERT_TRUE(half);
    int expect_size = rank % 2 == 0 ? 3 : 2;
    EXPECT_EQ(half->size(), expect_size);
    // ranks ordered by key (-rank): highest old rank first
    std::vector<int> members;
    for (int r = 4; r >= 0; --r)
      if (r % 2 == rank % 2) members.push_back(r);
    EXPECT_EQ(members[size_t(half->rank())], rank);
    auto none = comm->split(rank == 4 ? -1 : 0, 0);
    EXPECT_EQ(none == nullptr, rank == 4);
    // concurrent ops on parent and child from two threads do not mix
    int64_t a = rank, b = rank;
    std::thread other([&] { half->allreduce(&b, &b, 1, DataType::kInt64, ReduceOp::kSum); });
    comm->allreduce(&a, &a, 1, DataType::kInt64, ReduceOp::kSum);
    other.join();
    EXPECT_EQ(a, 10);
    EXPECT_EQ(b, rank % 2 == 0 ? 6 : 4);
    if (rank == 1 || rank == 3 || rank == 4) {
      auto sub = comm->subgroup({4, 1, 3});
      EXPECT_EQ(sub->size(), 3);
      EXPECT_EQ(sub->rank(), rank == 4 ? 0 : rank == 1 ? 1 : 2);
      int64_t v = rank;
      sub->allreduce(&v, &v, 1, DataType::kInt64, ReduceOp::kSum);
      EXPECT_EQ(v, 8);
    }
    EXPECT_THROW(comm->subgroup({0, 0}), InvalidArgument);
    comm->barrier();
  });
}

TEST(Ops, InvalidArgumentsAreRejectedBeforeSendingAndLeaveTheCommunicatorUsable) {
  auto store = make_memory_store();
  run_ranks(2, [&](int rank) {
    auto comm = make(store, rank, 2);
    float f = 1;
    int32_t i = 1;
    EXPECT_THROW(comm->allreduce(nullptr, &f, 4, DataType::kFloat32, ReduceOp::kSum), InvalidArgument);
    EXPECT_THROW(comm->broadcast(&f, 1, DataType::kFloat32, 2), InvalidArgument);
    EXPECT_THROW(comm->reduce(&f, &f, 1, DataType::kFloat32, ReduceOp::kSum, -1), InvalidArgument);
    EXPECT_THROW(comm->allreduce(&i, &i, 1, DataType::kInt32, ReduceOp::kAvg), InvalidArgument);
    EXPECT_THROW(comm->allreduce(&i, &i, 1, DataType(42), ReduceOp::kSum), InvalidArgument);
    EXPECT_THROW(comm->allgatherv(&f, 1, &f, {1}, DataType::kFloat32), InvalidArgument);
    EXPECT_THROW(comm->send(&f, 1, DataType::kFloat32, 5), InvalidArgument);
    EXPECT_THROW(Communicator::create(store, 3, 2), InvalidArgument);
    comm->allreduce(&f, &f, 1, DataType::kFloat32, ReduceOp::kSum);
    EXPECT_EQ(f, 2.0f);
  });
}

TEST(Ops, MismatchedOperationsAreDetectedOnTheRanksInvolved) {
  auto store = make_memory_store();
  std::vector<std::string> errors(2);
  run_ranks(2, [&](int rank) {
    auto comm = make(store, rank, 2, 10);
    std::vector<float> v(64, 1.0f);
    // A rank that only sends (the broadcast root) may complete its call; it learns of the
    // mismatch at its next call at the latest. Either way the error is a MismatchError naming both.
    try {
      if (rank == 0) comm->allreduce(v.data(), v.data(), 64, DataType::kFloat32, ReduceOp::kSum);
      else comm->broadcast(v.data(), 64, DataType::kFloat32, 1);
      comm->barrier();
      ADD_FAILURE() << "no mismatch detected on rank " << rank;
    } catch (const MismatchError& e) {
      errors[size_t(rank)] = e.what();
    }
    // the communicator is failed for good
    EXPECT_THROW(comm->barrier(), AbortedError);
  });
  std::string both = errors[0] + "\n" + errors[1];
  EXPECT_NE(both.find("allreduce(count=64"), std::string::npos) << both;
  EXPECT_NE(both.find("broadcast(count=64"), std::string::npos) << both;
}

TEST(Ops, AllocateSharedBuffersReduceInPlaceAndAMisplacedRangeIsAMismatch) {
  auto store = make_memory_store();
  std::vector<std::string> errors(3);
  run_ranks(3, [&](int rank) {
    auto comm = make(store, rank, 3, 10);
    const size_t n = 100003;
    // Two buffers, like two DDP buckets, reduced asynchronously in place.
    std::vector<std::shared_ptr<void>> memory;
    for (int b = 0; b < 2; ++b) memory.push_back(comm->allocate_shared(n * sizeof(float)));
    std::vector<std::shared_ptr<Work>> works;
    for (int b = 0; b < 2; ++b) {
      float* f = static_cast<float*>(memory[b].get());
      for (size_t i = 0; i < n; ++i) f[i] = float(rank + 1) * float(b + 1);
      works.push_back(comm->allreduce_async(f, f, n, DataType::kFloat32, ReduceOp::kAvg));
    }
    for (auto& w : works) w->wait();
    for (int b = 0; b < 2; ++b) {
      const float* f = static_cast<const float*>(memory[b].get());
      for (size_t i = 0; i < n; i += 101) ASSERT_EQ(f[i], 2.0f * float(b + 1)) << "buffer " << b << " element " << i;
    }
    // Rank 2 reduces a range 16 floats further in: the ranks would write each other's memory at the
    // wrong place, so it is refused before anything moves.
    float* f = static_cast<float*>(memory[0].get()) + (rank == 2 ? 16 : 0);
    try {
      comm->allreduce(f, f, 50000, DataType::kFloat32, ReduceOp::kSum);
      ADD_FAILURE() << "no mismatch detected on rank " << rank;
    } catch (const MismatchError& e) {
      errors[size_t(rank)] = e.what();
    }
  });
  for (const auto& e : errors) EXPECT_NE(e.find("allocate_shared"), std::string::npos) << e;
}

TEST(Ops, ShareableAllreduceIsOneOperationWithItsAllocationAndAgainstAPlainAllreduceAMismatch) {
  auto store = make_memory_store();
  std::vector<std::string> errors(2);
  run_ranks(2, [&](int rank) {
    auto comm = make(store, rank, 2, 10);
    const size_t n = 100003;
    std::vector<float> mine(n, float(rank + 1));
    // Operation 1: both ranks ask for memory the peers map; the call returns it (one host).
    std::shared_ptr<void> memory = comm->allreduce_shareable(mine.data(), n, DataType::kFloat32, ReduceOp::kSum, true);
    ASSERT_NE(memory, nullptr);
    EXPECT_EQ(mine[n - 1], 3.0f);
    // Operation 2, in place on it; operation 3 on ordinary memory on rank 1 only (staged, no error).
    float* shared = static_cast<float*>(memory.get());
    for (float* buf : {shared, rank == 1 ? mine.data() : shared}) {
      std::fill_n(buf, n, float(rank + 1));
      EXPECT_EQ(comm->allreduce_shareable(buf, n, DataType::kFloat32, ReduceOp::kSum, false), nullptr);
      EXPECT_EQ(buf[n - 1], 3.0f);
    }
    // Operation 4: a plain allreduce against the shareable one (their rounds differ): a mismatch that
    // names operation 4 (no hidden operation came before it).
    try {
      if (rank == 0) comm->allreduce(shared, shared, n, DataType::kFloat32, ReduceOp::kSum);
      else comm->allreduce_shareable(mine.data(), n, DataType::kFloat32, ReduceOp::kSum, false);
      ADD_FAILURE() << "no mismatch detected on rank " << rank;
    } catch (const MismatchError& e) {
      errors[size_t(rank)] = e.what();
    }
  });
  for (const auto& e : errors) EXPECT_NE(e.find("allreduce #4 "), std::string::npos) << e;
}

TEST(Ops, AllocateSharedWhilePeersRunAnotherOperationFailsAtOnce) {
  // allocate_shared is collective: a rank that calls it while its peer runs an allreduce gets the
  // usual MismatchError (its barrier against the allreduce), not a wait until the deadline.
  auto store = make_memory_store();
  run_ranks(2, [&](int rank) {
    auto comm = make(store, rank, 2, 20);
    const auto start = std::chrono::steady_clock::now();
    std::vector<float> v(64, 1.0f);
    if (rank == 0) EXPECT_THROW(comm->allocate_shared(1 << 20), MismatchError);
    else EXPECT_THROW(comm->allreduce(v.data(), v.data(), 64, DataType::kFloat32, ReduceOp::kSum), MismatchError);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  });
}

TEST(Ops, AbortFailsPendingAndLaterCalls) {
  auto store = make_memory_store();
  run_ranks(2, [&](int rank) {
    auto comm = make(store, rank, 2);
    if (rank == 0) {
      std::thread aborter([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        comm->abort("test says stop");
      });
      float f = 0;
      // rank 1 never joins this allreduce
      EXPECT_THROW(comm->allreduce(&f, &f, 1, DataType::kFloat32, ReduceOp::kSum), AbortedError);
      aborter.join();
      try {
        comm->barrier();
        ADD_FAILURE() << "barrier after abort succeeded";
      } catch (const AbortedError& e) {
        EXPECT_NE(std::string(e.what()).find("test says stop"), std::string::npos) << e.what();
      }
    }
    store->barrier("abort-test-done", rank, 2, std::chrono::seconds(10));
  });
}

TEST(Ops, BootstrapTimeoutNamesMissingRanks) {
  auto store = make_memory_store();
  CommOptions o;
  o.timeout = std::chrono::milliseconds(600);
  o.slow_warning = std::chrono::milliseconds(200);
  try {
    Communicator::create(store, 0, 3, o);
    FAIL() << "create succeeded without the other ranks";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("missing rank(s) 1-2"), std::string::npos) << e.what();
  }
}

comm::LaunchEnv resolve(std::map<std::string, std::string> vars) {
  return comm::resolve_launch_env([&](const std::string& n) -> std::optional<std::string> {
    auto it = vars.find(n);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

TEST(LaunchEnv, ReadsLauncherTorchrunMpiAndSlurmVariables) {
  auto c = resolve({{"COHORT_RANK", "2"}, {"COHORT_WORLD_SIZE", "4"}, {"COHORT_STORE_ADDR", "10.0.0.1:29400"},
                    {"COHORT_JOB_ID", "j1"}, {"RANK", "2"}, {"WORLD_SIZE", "4"}});
  EXPECT_EQ(c.rank, 2);
  EXPECT_EQ(c.store_host, "10.0.0.1");
  EXPECT_EQ(c.store_port, 29400);
  EXPECT_FALSE(c.host_store);
  EXPECT_EQ(c.prefix, "cohort/job/j1/attempt/0/comm");
  auto t = resolve({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1234"}});
  EXPECT_TRUE(t.host_store);
  EXPECT_EQ(t.source, "torchrun");
  auto m = resolve({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"},
                    {"MASTER_PORT", "1234"}});
  EXPECT_EQ(m.rank, 1);
  EXPECT_FALSE(m.host_store);
  auto s = resolve({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  EXPECT_EQ(s.source, "Slurm");
}

TEST(LaunchEnv, MissingOrContradictoryEnvironmentIsOneConfigError) {
  EXPECT_THROW(resolve({}), ConfigError);
  EXPECT_THROW(resolve({{"RANK", "0"}}), ConfigError);
  EXPECT_THROW(resolve({{"RANK", "0"}, {"WORLD_SIZE", "2"}}), ConfigError);  // no MASTER_ADDR
  EXPECT_THROW(resolve({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}),
               ConfigError);
  EXPECT_THROW(resolve({{"COHORT_RANK", "1"}, {"COHORT_WORLD_SIZE", "2"}, {"COHORT_STORE_ADDR", "h:1"},
                        {"RANK", "0"}, {"WORLD_SIZE", "2"}}),
               ConfigError);
  EXPECT_THROW(resolve({{"COHORT_RANK", "1"}, {"COHORT_WORLD_SIZE", "2"}}), ConfigError);
  try {
    resolve({});
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("MASTER_ADDR"), std::string::npos);
  }
}

}  // namespace
}  // namespace cohort
