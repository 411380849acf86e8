// The communicator's intra-host fast path: all ranks on one host -> collectives run on shm::Group;
// transport "tcp" (COHORT_TRANSPORT=tcp) keeps them on the transports. Results are the same either way.
#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

#include "cohort/communicator.h"
#include "comm/communicator_impl.h"
#include "store/memory_store.h"
#include "support/test_support.h"

namespace cohort {
namespace {

// The communicator's shm path is opt-in; settings are parsed on first use, so setting the variable
// before any communicator exists in this process is enough.
const bool shm_collectives_enabled = [] { return ::setenv("COHORT_SHM_COLLECTIVES", "1", 1) == 0; }();

void run_collectives(const std::string& transport, bool expect_shm) {
  auto store = make_memory_store();
  const int world = 3;
  test::run_ranks(world, [&](int r) {
    CommOptions o;
    o.timeout = std::chrono::seconds(30);
    o.transport = transport;
    auto comm = Communicator::create(store, r, world, o);
    auto* impl = dynamic_cast<comm::CommunicatorImpl*>(comm.get());
    ASSERT_NE(impl, nullptr);
    EXPECT_EQ(impl->shm_group() != nullptr, expect_shm) << "transport " << transport;
    const size_t n = 100003;
    std::vector<float> x(n);
    for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>((i % 7) + r);
    comm->allreduce(x.data(), x.data(), n, DataType::kFloat32, ReduceOp::kSum);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(x[i], static_cast<float>(3 * (i % 7) + 3)) << i;
    std::vector<int32_t> all(3 * 5), mine(5, r);
    comm->allgather(mine.data(), all.data(), 5, DataType::kInt32);
    for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], static_cast<int32_t>(i / 5));
    std::vector<double> b(9, r == 2 ? 4.5 : 0.0);
    comm->broadcast(b.data(), b.size(), DataType::kFloat64, 2);
    for (double v : b) ASSERT_EQ(v, 4.5);
    std::vector<int64_t> rs_in(3 * 4), rs_out(4);
    for (size_t i = 0; i < rs_in.size(); ++i) rs_in[i] = static_cast<int64_t>(i) * (r + 1);
    comm->reduce_scatter(rs_in.data(), rs_out.data(), 4, DataType::kInt64, ReduceOp::kSum);
    for (size_t i = 0; i < 4; ++i) ASSERT_EQ(rs_out[i], static_cast<int64_t>(r * 4 + i) * 6);
    auto work = comm->allreduce_async(x.data(), x.data(), n, DataType::kFloat32, ReduceOp::kMax);
    work->wait();
    comm->barrier();
  });
}

TEST(ShmCommunicator, AllLocalRanksUseTheSharedMemoryGroup) {
  ASSERT_TRUE(shm_collectives_enabled);
  run_collectives("auto", true);
}
TEST(ShmCommunicator, TransportTcpKeepsCollectivesOnTheTransports) { run_collectives("tcp", false); }

}  // namespace
}  // namespace cohort
