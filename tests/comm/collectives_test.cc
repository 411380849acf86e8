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
#include "support/test_support.h"

namespace cohort {
namespace {

using test::run_ranks;

// Value of element i on rank r: small integers so every dtype and op has an exact reference
// (prod stays small, int8 does not overflow).
double input_value(int r, size_t i, ReduceOp op) {
  if (op == ReduceOp::kProd) return double(((r + i) % 3) + 1) * (((r + 2 * i) % 5 == 0) ? -1 : 1);
  return double(int((r * 7 + i * 3) % 11) - 5);
}

double input_for(int r, size_t i, DataType t, ReduceOp op) {
  double v = input_value(r, i, op);
  if (t == DataType::kUInt8) v = std::fabs(v);
  return v;
}

double reference(int world, size_t i, DataType t, ReduceOp op) {
  return fold_reference(world, op, [&](int r) { return input_for(r, i, t, op); });
}

double tolerance(DataType t, double expected) {
  if (t == DataType::kFloat16) return 2e-3 * std::max(1.0, std::fabs(expected)) + 1e-3;
  if (t == DataType::kBFloat16) return 1e-2 * std::max(1.0, std::fabs(expected)) + 1e-2;
  if (t == DataType::kFloat32) return 1e-5 * std::max(1.0, std::fabs(expected));
  return 1e-9;
}

// Wraps integer results the way fixed-width arithmetic does (int8 sums of 8 ranks stay in range).
std::shared_ptr<Communicator> make(std::shared_ptr<Store> store, int rank, int world) {
  CommOptions o;
  o.timeout = std::chrono::seconds(30);
  return Communicator::create(store, rank, world, o);
}

const DataType kAllTypes[] = {DataType::kInt8,     DataType::kUInt8,     DataType::kInt32,   DataType::kInt64,
                              DataType::kFloat16,  DataType::kBFloat16,  DataType::kFloat32, DataType::kFloat64};
const ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kAvg};

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
