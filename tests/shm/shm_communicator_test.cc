// The communicator's intra-host fast path: all ranks on one host -> collectives run on shm::Group;
// transport "tcp" (COHORT_TRANSPORT=tcp) keeps them on the transports. Results are the same either way.
#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "cohort/error.h"
#include "cohort/communicator.h"
#include "collectives/shm/group.h"
#include "comm/communicator_impl.h"
#include "store/memory_store.h"
#include "support/test_support.h"

namespace cohort {
namespace {

// The shm path is the default; make sure an environment that turned it off does not skip these tests
// (settings are parsed on first use, before any communicator exists in this process).
const bool shm_collectives_enabled = [] { return ::setenv("COHORT_SHM_COLLECTIVES", "1", 1) == 0; }();

std::shared_ptr<Communicator> make_shm(std::shared_ptr<Store> store, int rank, int world, double timeout_s) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  o.transport = "shm";
  auto comm = Communicator::create(store, rank, world, o);
  auto* impl = dynamic_cast<comm::CommunicatorImpl*>(comm.get());
  if (impl == nullptr || impl->shm_group() == nullptr) throw std::runtime_error("no shm group with transport shm");
  return comm;
}

std::shared_ptr<Communicator> make_with(std::shared_ptr<Store> store, int rank, int world, const std::string& transport,
                                        int timeout_s = 30) {
  CommOptions o;
  o.timeout = std::chrono::seconds(timeout_s);
  o.transport = transport;
  return Communicator::create(store, rank, world, o);
}

// Three ranks as threads, each with its communicator over `transport`.
void on_three_ranks(const std::string& transport,
                    const std::function<void(int rank, Communicator& comm, comm::CommunicatorImpl* impl)>& body) {
  auto store = make_memory_store();
  test::run_ranks(3, [&](int r) {
    auto comm = make_with(store, r, 3, transport);
    auto* impl = dynamic_cast<comm::CommunicatorImpl*>(comm.get());
    ASSERT_NE(impl, nullptr);
    body(r, *comm, impl);
  });
}

void run_collectives(const std::string& transport, bool expect_shm) {
  on_three_ranks(transport, [&](int r, Communicator& c, comm::CommunicatorImpl* impl) {
    Communicator* comm = &c;
    EXPECT_EQ(impl->shm_group() != nullptr, expect_shm) << "transport " << transport;
    // The link probe ran at creation where there is a shm group (COHORT_SHM_PROBE defaults to 1).
    EXPECT_EQ(comm->link_report().find("local ranks on CPUs") != std::string::npos, expect_shm) << comm->link_report();
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
TEST(ShmCommunicator, TransportShmForcesTheSharedMemoryGroup) { run_collectives("shm", true); }

// allreduce_update on every path: fused in one pass (one host, both buffers from allocate_shared),
// and allreduce-then-update (ordinary memory; or the transports, with transport tcp). Same results.
void run_allreduce_update(const std::string& transport, bool expect_fused) {
  on_three_ranks(transport, [&](int r, Communicator& c, comm::CommunicatorImpl* impl) {
    Communicator* comm = &c;
    const size_t n = 100003;
    auto grad_memory = comm->allocate_shared(n * sizeof(float));
    auto param_memory = comm->allocate_shared(n * sizeof(float));
    std::vector<float> grad_vector(n), param_vector(n);
    for (bool shared : {true, false}) {
      float* grads = shared ? static_cast<float*>(grad_memory.get()) : grad_vector.data();
      float* params = shared ? static_cast<float*>(param_memory.get()) : param_vector.data();
      for (size_t i = 0; i < n; ++i) {
        grads[i] = static_cast<float>(r + 1) + static_cast<float>(i % 5);
        params[i] = static_cast<float>(i % 11);
      }
      comm->barrier();  // the last call's peers no longer write this rank's parameters
      const uint64_t fused_before = impl->shm_group() ? impl->shm_group()->fused_updates() : 0;
      comm->allreduce_update(grads, params, n, ReduceOp::kAvg, [](size_t, size_t m, const float* avg, float* p) {
        for (size_t i = 0; i < m; ++i) p[i] -= 0.25f * avg[i];
      });
      const uint64_t fused = impl->shm_group() ? impl->shm_group()->fused_updates() - fused_before : 0;
      EXPECT_EQ(fused, shared && expect_fused ? 1u : 0u) << transport << (shared ? " shared" : " ordinary");
      // avg of (q + 1 + i % 5) over q = 0..2 is 2 + i % 5: exact.
      for (size_t i = 0; i < n; ++i)
        ASSERT_EQ(params[i], static_cast<float>(i % 11) - 0.25f * (2.0f + static_cast<float>(i % 5)))
            << transport << (shared ? " shared" : " ordinary") << " element " << i;
    }
  });
}

TEST(ShmCommunicator, AllreduceUpdateIsFusedOnSharedMemoryAndTheSameEverywhereElse) {
  run_allreduce_update("auto", true);
  run_allreduce_update("tcp", false);
}

TEST(ShmCommunicator, AllreduceUpdateAgainstAPlainAllreduceIsAMismatchNamingBoth) {
  for (const std::string transport : {"auto", "tcp"}) {
    auto store = make_memory_store();
    std::vector<std::string> errors(2);
    test::run_ranks(2, [&](int r) {
      auto comm = make_with(store, r, 2, transport, 20);
      std::vector<float> grads(1000, 1.0f), params(1000, 0.0f);
      try {
        if (r == 0)
          comm->allreduce_update(grads.data(), params.data(), grads.size(), ReduceOp::kSum,
                                 [](size_t, size_t, const float*, float*) {});
        else
          comm->allreduce(grads.data(), grads.data(), grads.size(), DataType::kFloat32, ReduceOp::kSum);
        ADD_FAILURE() << "rank " << r << " (" << transport << "): no mismatch";
      } catch (const MismatchError& e) {
        errors[size_t(r)] = e.what();
      }
    });
    const std::string both = errors[0] + "\n" + errors[1];
    EXPECT_NE(both.find("allreduce+update(count=1000"), std::string::npos) << transport << ": " << both;
  }
}

// The shm path reports a mismatched call like the transports: MismatchError on both ranks, naming
// both calls; the communicator is failed for good afterwards.
TEST(ShmCommunicator, MismatchedSignaturesAreMismatchErrorsNamingBothCalls) {
  auto store = make_memory_store();
  std::vector<std::string> errors(3);
  test::run_ranks(3, [&](int r) {
    auto comm = make_shm(store, r, 3, 10);
    std::vector<float> v(64, 1.0f);
    comm->allreduce(v.data(), v.data(), 64, DataType::kFloat32, ReduceOp::kSum);  // one good call first
    try {
      // rank 2 reduces with max and a different count
      if (r == 2) comm->allreduce(v.data(), v.data(), 32, DataType::kFloat32, ReduceOp::kMax);
      else comm->allreduce(v.data(), v.data(), 64, DataType::kFloat32, ReduceOp::kSum);
      ADD_FAILURE() << "no mismatch on rank " << r;
    } catch (const MismatchError& e) {
      errors[size_t(r)] = e.what();
    } catch (const std::exception& e) {
      errors[size_t(r)] = std::string("other error: ") + e.what();
    }
    EXPECT_THROW(comm->barrier(), AbortedError);
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(errors[size_t(r)].find("mismatched calls"), std::string::npos) << r << ": " << errors[size_t(r)];
    EXPECT_NE(errors[size_t(r)].find("allreduce(count=64"), std::string::npos) << r << ": " << errors[size_t(r)];
    EXPECT_NE(errors[size_t(r)].find("allreduce(count=32"), std::string::npos) << r << ": " << errors[size_t(r)];
    EXPECT_NE(errors[size_t(r)].find("operation #2"), std::string::npos) << r << ": " << errors[size_t(r)];
  }
}

// A rank waiting in the group sees abort() (from another thread) and the operation's deadline, with
// the transports' wording naming the rank that did not arrive.
TEST(ShmCommunicator, WaitsSeeAbortAndTheDeadlineNamingTheMissingRank) {
  auto store = make_memory_store();
  std::string timeout_error;
  test::run_ranks(3, [&](int r) {
    auto comm = make_shm(store, r, 3, 1.0);
    float f = 1;
    comm->allreduce(&f, &f, 1, DataType::kFloat32, ReduceOp::kSum);
    if (r == 0) {
      std::thread aborter([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        comm->abort("test says stop");
      });
      auto start = std::chrono::steady_clock::now();
      EXPECT_THROW(comm->barrier(), AbortedError);  // ranks 1 and 2 do not join it
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(900));
      aborter.join();
    } else if (r == 1) {
      try {
        comm->barrier();  // rank 2 never joins; rank 0 aborts, which fails the group for rank 1 too
        ADD_FAILURE() << "barrier without rank 2 succeeded";
      } catch (const Error&) {
      }
    }
    store->barrier("abort-part-done", r, 3, std::chrono::seconds(10));
  });
  // The deadline alone: two ranks wait for a third that never comes.
  auto store2 = make_memory_store();
  test::run_ranks(3, [&](int r) {
    auto comm = make_shm(store2, r, 3, 1.0);
    float f = 1;
    comm->allreduce(&f, &f, 1, DataType::kFloat32, ReduceOp::kSum);
    if (r == 0) {
      try {
        comm->allreduce(&f, &f, 1, DataType::kFloat32, ReduceOp::kSum);
        ADD_FAILURE() << "allreduce without rank 2 succeeded";
      } catch (const TimeoutError& e) {
        timeout_error = e.what();
      } catch (const std::exception& e) {
        timeout_error = std::string("other error: ") + e.what();
      }
    } else if (r == 1) {
      try {
        comm->allreduce(&f, &f, 1, DataType::kFloat32, ReduceOp::kSum);
      } catch (const Error&) {
      }
    }
    store2->barrier("timeout-part-done", r, 3, std::chrono::seconds(10));
  });
  EXPECT_NE(timeout_error.find("its timeout (COHORT_TIMEOUT), waiting for rank(s) 2 [rank 2 ("), std::string::npos) << timeout_error;
  EXPECT_NE(timeout_error.find("last seen in operation #1 allreduce(count=1"), std::string::npos) << timeout_error;
}

}  // namespace
}  // namespace cohort
