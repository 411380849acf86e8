// Every collective on ranks-as-threads (real loopback TCP sockets, memory store) against a float64
// reference: world sizes 1-8, sizes 0, 1, primes and not divisible by the world, every dtype and op.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>
#include <thread>

#include "cohort/communicator.h"
#include "common/elements.h"
#include "common/half.h"
#include "store/memory_store.h"
#include "support/reduce_values.h"
#include "support/test_support.h"

namespace cohort {
namespace {

using test::run_ranks;
using test::input_for;
using test::kAllOps;
using test::kAllTypes;
using test::reference;
using test::tolerance;

std::shared_ptr<Communicator> make(std::shared_ptr<Store> store, int rank, int world) {
  CommOptions o;
  o.timeout = std::chrono::seconds(30);
  return Communicator::create(store, rank, world, o);
}

TEST(Collectives, AllreduceEveryDtypeOpAndWorld) {
  for (int world = 1; world <= 8; ++world) {
    auto store = make_memory_store();
    run_ranks(world, [&](int rank) {
      auto comm = make(store, rank, world);
      for (size_t count : {size_t(0), size_t(1), size_t(7), size_t(13), size_t(1031)}) {
        for (DataType t : kAllTypes) {
          for (ReduceOp op : kAllOps) {
            if (!op_supported(t, op)) continue;
            size_t es = dtype_size(t);
            std::vector<char> in(count * es + 1), out(count * es + 1);
            for (size_t i = 0; i < count; ++i) store_element(in.data(), i, t, input_for(rank, i, t, op));
            bool in_place = (count % 2) == 1;
            if (in_place) {
              out = in;
              comm->allreduce(out.data(), out.data(), count, t, op);
            } else {
              comm->allreduce(in.data(), out.data(), count, t, op);
            }
            for (size_t i = 0; i < count; ++i) {
              double want = reference(world, i, t, op);
              if (t == DataType::kUInt8 && op == ReduceOp::kProd) want = double(uint8_t(int64_t(want)));
              if (t == DataType::kInt8 && op == ReduceOp::kProd) want = double(int8_t(int64_t(want)));
              double got = load_element(out.data(), i, t);
              ASSERT_NEAR(got, want, tolerance(t, want))
                  << "world " << world << " count " << count << " " << dtype_name(t) << " " << reduce_op_name(op)
                  << " element " << i;
            }
          }
        }
      }
    });
  }
}

TEST(Collectives, LargeAllreduceFloat) {
  for (int world : {2, 3, 4}) {
    auto store = make_memory_store();
    run_ranks(world, [&](int rank) {
      auto comm = make(store, rank, world);
      size_t count = (3 << 20) / 4 + 17;  // several chunks, not divisible by the world
      std::vector<float> buf(count);
      for (size_t i = 0; i < count; ++i) buf[i] = float((rank + 1) * int(i % 100));
      comm->allreduce(buf.data(), buf.data(), count, DataType::kFloat32, ReduceOp::kSum);
      float f = float(world * (world + 1) / 2);
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(buf[i], f * float(i % 100)) << i;
    });
  }
}

}  // namespace
}  // namespace cohort
