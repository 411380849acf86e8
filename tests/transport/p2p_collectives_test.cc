// The collective correctness checks run over each point-to-point transport choice: shm alone, tcp
// alone, and mixed (ranks as threads split across two simulated hosts, so same-host peers go over shm
// and the others over tcp). COHORT_SHM_COLLECTIVES=0 for this whole binary, so that the coll::
// algorithms (not the shm::Group fast path) run over the transports under test.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cohort/communicator.h"
#include "common/elements.h"
#include "common/half.h"
#include "common/host_identity.h"
#include "store/memory_store.h"
#include "support/reduce_values.h"
#include "support/test_support.h"

namespace cohort {
namespace {

// Before any communicator reads it (settings are read once per process).
const bool kShmCollectivesOff = [] {
  ::setenv("COHORT_SHM_COLLECTIVES", "0", 1);
  return true;
}();

using test::run_ranks;
using test::input_for;
using test::kAllOps;
using test::kAllTypes;
using test::reference;
using test::tolerance;

struct Mode {
  const char* name;
  const char* transport;
  bool two_hosts;
};

// Mixed: odd ranks on one simulated host, even ranks on another (so rings alternate shm and tcp).
std::string host_of(const Mode& m, int rank) { return m.two_hosts ? (rank % 2 ? "hostB" : "hostA") : ""; }

std::shared_ptr<Communicator> make(const Mode& m, std::shared_ptr<Store> store, int rank, int world) {
  CommOptions o;
  o.timeout = std::chrono::seconds(30);
  o.transport = m.transport;
  return Communicator::create(store, rank, world, o);
}

int64_t val(int rank, size_t i) { return int64_t(rank) * 1000003 + int64_t(i); }

class P2PCollectives : public ::testing::TestWithParam<Mode> {};

// Every world size 1-8: allreduce of every dtype and op (odd sizes), then every other collective and
// point-to-point on int64 (sizes 0, 1, a prime, one that streams through several ring lengths).
TEST_P(P2PCollectives, EveryCollectiveEveryWorldSize) {
  const Mode m = GetParam();
  for (int world = 1; world <= 8; ++world) {
    auto store = make_memory_store();
    run_ranks(world, [&](int rank) {
      ScopedHostIdOverride host(host_of(m, rank));
      auto comm = make(m, store, rank, world);
      int same_host = 0;
      for (int r = 0; r < world; ++r) same_host += host_of(m, r) == host_of(m, rank) ? 1 : 0;
      ASSERT_EQ(comm->local_size(), same_host);
      // allreduce: all dtypes and ops
      for (size_t count : {size_t(1), size_t(13), size_t(1031)}) {
        for (DataType t : kAllTypes) {
          for (ReduceOp op : kAllOps) {
            if (!op_supported(t, op)) continue;
            size_t es = dtype_size(t);
            std::vector<char> in(count * es + 1), out(count * es + 1);
            for (size_t i = 0; i < count; ++i) store_element(in.data(), i, t, input_for(rank, i, t, op));
            comm->allreduce(in.data(), out.data(), count, t, op);
            for (size_t i = 0; i < count; ++i) {
              double want = reference(world, i, t, op);
              ASSERT_NEAR(load_element(out.data(), i, t), want, tolerance(t, want))
                  << m.name << " world " << world << " count " << count << " " << dtype_name(t) << " "
                  << reduce_op_name(op) << " element " << i;
            }
          }
        }
      }
      const DataType t = DataType::kInt64;
      for (size_t n : {size_t(0), size_t(1), size_t(13), size_t(world <= 4 ? 300007 : 20011)}) {
        const int root = int(n % size_t(world));
        // broadcast
        std::vector<int64_t> b(n);
        for (size_t i = 0; i < n; ++i) b[i] = rank == root ? val(root, i) : -1;
        comm->broadcast(b.data(), n, t, root);
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(b[i], val(root, i)) << m.name << " broadcast " << i;
        // reduce to root, and allreduce in place
        std::vector<int64_t> in(n), out(n, -1);
        for (size_t i = 0; i < n; ++i) in[i] = val(rank, i);
        comm->reduce(in.data(), out.data(), n, t, ReduceOp::kSum, root);
        std::vector<int64_t> all = in;
        comm->allreduce(all.data(), all.data(), n, t, ReduceOp::kSum);
        for (size_t i = 0; i < n; ++i) {
          int64_t want = 0;
          for (int r = 0; r < world; ++r) want += val(r, i);
          if (rank == root) {
            ASSERT_EQ(out[i], want) << m.name << " reduce " << i;
          }
          ASSERT_EQ(all[i], want) << m.name << " allreduce " << i;
        }
        // allgather and gather
        std::vector<int64_t> g(n * size_t(world), -1), gr(n * size_t(world), -1);
        comm->allgather(in.data(), g.data(), n, t);
        comm->gather(in.data(), gr.data(), n, t, root);
        for (int r = 0; r < world; ++r)
          for (size_t i = 0; i < n; ++i) {
            ASSERT_EQ(g[size_t(r) * n + i], val(r, i)) << m.name << " allgather";
            if (rank == root) {
              ASSERT_EQ(gr[size_t(r) * n + i], val(r, i)) << m.name << " gather";
            }
          }
        // scatter, reduce_scatter, alltoall: block b of rank r holds val(r * 16 + b, i)
        std::vector<int64_t> blocks(n * size_t(world)), one(n, -1), rs(n, -1), a2a(n * size_t(world), -1);
        for (int bl = 0; bl < world; ++bl)
          for (size_t i = 0; i < n; ++i) blocks[size_t(bl) * n + i] = val(rank * 16 + bl, i);
        comm->scatter(blocks.data(), one.data(), n, t, root);
        comm->reduce_scatter(blocks.data(), rs.data(), n, t, ReduceOp::kSum);
        comm->alltoall(blocks.data(), a2a.data(), n, t);
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(one[i], val(root * 16 + rank, i)) << m.name << " scatter";
          int64_t want = 0;
          for (int r = 0; r < world; ++r) want += val(r * 16 + rank, i);
          ASSERT_EQ(rs[i], want) << m.name << " reduce_scatter";
          for (int r = 0; r < world; ++r) ASSERT_EQ(a2a[size_t(r) * n + i], val(r * 16 + rank, i)) << m.name << " alltoall";
        }
        // point-to-point around a ring
        if (world > 1) {
          std::vector<int64_t> got(n, -1);
          int next = (rank + 1) % world, prev = (rank + world - 1) % world;
          if (rank % 2 == 0) {
            comm->send(in.data(), n, t, next, 5);
            comm->recv(got.data(), n, t, prev, 5);
          } else {
            comm->recv(got.data(), n, t, prev, 5);
            comm->send(in.data(), n, t, next, 5);
          }
          for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], val(prev, i)) << m.name << " send/recv";
        }
        comm->barrier();
      }
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, P2PCollectives,
                         ::testing::Values(Mode{"shm", "shm", false}, Mode{"tcp", "tcp", false},
                                           Mode{"mixed", "auto", true}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(P2PTransportSelection, ForcedShmAcrossHostsIsAConfigErrorNamingTheRankAndHost) {
  auto store = make_memory_store();
  run_ranks(2, [&](int rank) {
    ScopedHostIdOverride host(rank == 0 ? "hostA" : "hostB");
    CommOptions o;
    o.timeout = std::chrono::seconds(10);
    o.transport = "shm";
    try {
      Communicator::create(store, rank, 2, o);
      ADD_FAILURE() << "rank " << rank << ": created a shm-only communicator across two hosts";
    } catch (const ConfigError& e) {
      const int other = 1 - rank;
      std::string want = "rank " + std::to_string(other) + " (";
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(other == 0 ? "+hostA" : "+hostB"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
}  // namespace cohort
