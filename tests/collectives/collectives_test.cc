// Every collective algorithm on ranks-as-threads (ThreadContext), at world sizes 1..8, against a
// float64 reference: counts 0, 1, primes and counts not divisible by the world size, every dtype
// and reduce op, in place and not, each forced algorithm and the automatic choice.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "cohort/error.h"
#include "collectives/collectives.h"
#include "collectives/select.h"
#include "common/elements.h"
#include "common/half.h"
#include "support/test_support.h"
#include "thread_context.h"

namespace cohort {
namespace {

using coll::Algorithm;

// Small chunks so that even the small test vectors run through many pipeline
// stages (settings are read once, so this must happen before any collective runs).
const bool kPipelineSettings = [] {
  setenv("COHORT_COLL_CHUNK", "64", 1);
  setenv("COHORT_COLL_SLOTS", "2", 1);
  return true;
}();

constexpr DataType kAllTypes[] = {DataType::kInt8,    DataType::kUInt8,    DataType::kInt32,   DataType::kInt64,
                                  DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32, DataType::kFloat64};
constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kAvg};
const std::vector<size_t> kCounts = {0, 1, 2, 3, 7, 13, 64, 97, 257, 1031};

bool is_unsigned(DataType t) { return t == DataType::kUInt8; }

// Inputs chosen so that the exact result is representable in every dtype (no overflow, sums of
// quarters stay exact in bfloat16); only avg and its division round.
double input_value(int rank, size_t i, DataType t, ReduceOp op) {
  const bool u = is_unsigned(t);
  const double frac = is_floating(t) ? 0.25 : 1.0;
  switch (op) {
    case ReduceOp::kProd:
      if (rank == 0) return u ? static_cast<double>(i % 4) : static_cast<double>(static_cast<int>(i % 7) - 3);
      return (!u && (i + static_cast<size_t>(rank)) % 3 == 0) ? -1.0 : 1.0;
    case ReduceOp::kMin:
    case ReduceOp::kMax: {
      int v = static_cast<int>((i * 13 + static_cast<size_t>(rank) * 29) % 23);
      return (u ? v : v - 11) * frac;
    }
    default: {
      int v = static_cast<int>((i * 31 + static_cast<size_t>(rank) * 17) % 11);
      return (u ? v : v - 5) * frac;
    }
  }
}

double tolerance(DataType t) {
  switch (t) {
    case DataType::kFloat16: return 1e-3;
    case DataType::kBFloat16: return 8e-3;
    case DataType::kFloat32: return 1e-6;
    case DataType::kFloat64: return 1e-12;
    default: return 0;
  }
}

double reference(int world, size_t i, DataType t, ReduceOp op) {
  return fold_reference(world, op, [&](int r) { return input_value(r, i, t, op); });
}

std::vector<char> make_input(int rank, size_t count, DataType t, ReduceOp op, size_t offset = 0) {
  std::vector<char> buf(count * dtype_size(t) + 1);
  for (size_t i = 0; i < count; ++i) store_element(buf.data(), i, t, input_value(rank, offset + i, t, op));
  return buf;
}

// Returns an empty string when `got[i]` matches reference element `first + i` for every i.
std::string check_reduced(const void* got, size_t count, size_t first, int world, DataType t, ReduceOp op) {
  for (size_t i = 0; i < count; ++i) {
    double want = reference(world, first + i, t, op);
    double have = load_element(got, i, t);
    if (std::fabs(have - want) > tolerance(t) * std::max(1.0, std::fabs(want))) {
      return fmt::format("element {}: got {} want {}", first + i, have, want);
    }
  }
  return "";
}

std::string describe(const char* what, int world, size_t count, DataType t, ReduceOp op, Algorithm a, bool in_place) {
  return fmt::format("{} world={} count={} dtype={} op={} algo={} in_place={}", what, world, count, dtype_name(t),
                     reduce_op_name(op), coll::algorithm_name(a), in_place);
}

// Runs body(ctx) on `world` thread ranks and checks that no message was left unmatched.
// Remembers the case being run so that a failure inside a rank says which one it was.
thread_local std::string t_case;

void run_world(int world, const std::function<void(coll::Context&, int)>& body) {
  test::ThreadWorld w(world, std::chrono::seconds(5));
  try {
    test::run_ranks(world, [&](int rank) {
      test::ThreadContext ctx(w, rank);
      body(ctx, rank);
      EXPECT_EQ(ctx.outstanding(), 0u) << "rank " << rank << " left requests un-waited";
    });
  } catch (const std::exception& e) {
    FAIL() << t_case << ": " << e.what();
  }
  EXPECT_TRUE(w.drained()) << "unmatched messages left in world of " << world << " " << t_case;
}

class Worlds : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Sizes, Worlds, ::testing::Range(1, 9));

TEST_P(Worlds, AllreduceEveryAlgorithmDtypeOp) {
  const int world = GetParam();
  for (Algorithm a : {Algorithm::kAuto, Algorithm::kRing, Algorithm::kHalvingDoubling, Algorithm::kRecursiveDoubling}) {
    for (size_t ci = 0; ci < kCounts.size(); ++ci) {
      const size_t count = kCounts[ci];
      for (DataType t : kAllTypes) {
        for (ReduceOp op : kAllOps) {
          if (!op_supported(t, op)) continue;
          const bool in_place = (ci + static_cast<size_t>(op)) % 2 == 0;
          const std::string what = describe("allreduce", world, count, t, op, a, in_place);
          t_case = what;
          std::vector<std::vector<char>> outs(static_cast<size_t>(world));
          run_world(world, [&](coll::Context& ctx, int r) {
            auto in = make_input(r, count, t, op);
            auto& out = outs[static_cast<size_t>(r)];
            if (in_place) {
              out = in;
              coll::allreduce(ctx, out.data(), out.data(), count, t, op, a);
            } else {
              out.assign(in.size(), 0);
              coll::allreduce(ctx, in.data(), out.data(), count, t, op, a);
            }
          });
          ASSERT_EQ(check_reduced(outs[0].data(), count, 0, world, t, op), "") << what;
          for (int r = 1; r < world; ++r) {
            ASSERT_EQ(std::memcmp(outs[0].data(), outs[static_cast<size_t>(r)].data(), count * dtype_size(t)), 0)
                << what << ": rank " << r << " differs bitwise from rank 0";
          }
        }
      }
    }
  }
}

// Random (non-exact) float inputs: results must still be bitwise identical on every rank.
TEST_P(Worlds, AllreduceBitwiseIdenticalOnRandomFloats) {
  const int world = GetParam();
  for (Algorithm a : {Algorithm::kRing, Algorithm::kHalvingDoubling, Algorithm::kRecursiveDoubling}) {
    for (DataType t : {DataType::kFloat32, DataType::kFloat16, DataType::kBFloat16, DataType::kFloat64}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kProd}) {
        const size_t count = 1000 + static_cast<size_t>(world);
        std::vector<std::vector<char>> outs(static_cast<size_t>(world));
        run_world(world, [&](coll::Context& ctx, int r) {
          auto& out = outs[static_cast<size_t>(r)];
          out.assign(count * dtype_size(t), 0);
          uint64_t x = 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(r + 1);
          for (size_t i = 0; i < count; ++i) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            store_element(out.data(), i, t, static_cast<double>(x % 100000) / 7919.0 - 6.0);
          }
          coll::allreduce(ctx, out.data(), out.data(), count, t, op, a);
        });
        for (int r = 1; r < world; ++r) {
          ASSERT_EQ(outs[0], outs[static_cast<size_t>(r)])
              << describe("allreduce", world, count, t, op, a, true) << ": rank " << r << " differs";
        }
      }
    }
  }
}

TEST_P(Worlds, ReduceEveryAlgorithmRootDtypeOp) {
  const int world = GetParam();
  for (Algorithm a : {Algorithm::kAuto, Algorithm::kBinomial, Algorithm::kRing}) {
    for (int root : {0, world - 1, world / 2}) {
      for (size_t ci = 0; ci < kCounts.size(); ++ci) {
        const size_t count = kCounts[ci];
        for (DataType t : kAllTypes) {
          for (ReduceOp op : kAllOps) {
            if (!op_supported(t, op)) continue;
            const bool in_place = ci % 2 == 1;
            std::vector<char> result;
            run_world(world, [&](coll::Context& ctx, int r) {
              auto in = make_input(r, count, t, op);
              if (r == root) {
                if (in_place) {
                  coll::reduce(ctx, in.data(), in.data(), count, t, op, root, a);
                  result = in;
                } else {
                  std::vector<char> out(in.size(), 0);
                  coll::reduce(ctx, in.data(), out.data(), count, t, op, root, a);
                  result = out;
                }
              } else {
                coll::reduce(ctx, in.data(), nullptr, count, t, op, root, a);
              }
            });
            ASSERT_EQ(check_reduced(result.data(), count, 0, world, t, op), "")
                << describe("reduce", world, count, t, op, a, in_place) << " root=" << root;
          }
        }
      }
    }
  }
}

TEST_P(Worlds, ReduceScatterEveryDtypeOp) {
  const int world = GetParam();
  for (Algorithm a : {Algorithm::kAuto, Algorithm::kRing}) {
    for (size_t ci = 0; ci < kCounts.size(); ++ci) {
      const size_t rc = kCounts[ci];
      for (DataType t : kAllTypes) {
        for (ReduceOp op : kAllOps) {
          if (!op_supported(t, op)) continue;
          const bool in_place = (ci + static_cast<size_t>(op)) % 2 == 1;
          std::vector<std::vector<char>> outs(static_cast<size_t>(world));
          run_world(world, [&](coll::Context& ctx, int r) {
            auto in = make_input(r, rc * static_cast<size_t>(world), t, op);
            auto& out = outs[static_cast<size_t>(r)];
            if (in_place) {
              coll::reduce_scatter(ctx, in.data(), in.data(), rc, t, op, a);
              out = in;
            } else {
              out.assign(rc * dtype_size(t) + 1, 0);
              coll::reduce_scatter(ctx, in.data(), out.data(), rc, t, op, a);
            }
          });
          for (int r = 0; r < world; ++r) {
            ASSERT_EQ(check_reduced(outs[static_cast<size_t>(r)].data(), rc, static_cast<size_t>(r) * rc, world, t, op), "")
                << describe("reduce_scatter", world, rc, t, op, a, in_place) << " rank " << r;
          }
        }
      }
    }
  }
}

// Data movement checks use a byte pattern naming (rank, index).
uint8_t pattern(int rank, size_t i) { return static_cast<uint8_t>(rank * 37 + i * 11 + 1); }

std::vector<char> patterned(int rank, size_t bytes, size_t first = 0) {
  std::vector<char> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<char>(pattern(rank, first + i));
  return v;
}

TEST_P(Worlds, BroadcastEveryAlgorithmAndRoot) {
  const int world = GetParam();
  for (Algorithm a : {Algorithm::kAuto, Algorithm::kBinomial, Algorithm::kScatterAllgather}) {
    for (int root = 0; root < world; ++root) {
      for (size_t count : kCounts) {
        for (DataType t : {DataType::kInt8, DataType::kFloat16, DataType::kFloat32, DataType::kFloat64}) {
          const size_t bytes = count * dtype_size(t);
          std::vector<std::vector<char>> outs(static_cast<size_t>(world));
          run_world(world, [&](coll::Context& ctx, int r) {
            auto& buf = outs[static_cast<size_t>(r)];
            buf = r == root ? patterned(root, bytes) : std::vector<char>(bytes, 0);
            coll::broadcast(ctx, buf.data(), count, t, root, a);
          });
          for (int r = 0; r < world; ++r) {
            ASSERT_EQ(outs[static_cast<size_t>(r)], patterned(root, bytes))
                << "broadcast world=" << world << " root=" << root << " count=" << count << " algo="
                << coll::algorithm_name(a) << " rank " << r;
          }
        }
      }
    }
  }
}

TEST_P(Worlds, AllgatherEveryAlgorithm) {
  const int world = GetParam();
  for (Algorithm a : {Algorithm::kAuto, Algorithm::kRing, Algorithm::kBruck}) {
    for (size_t ci = 0; ci < kCounts.size(); ++ci) {
      const size_t count = kCounts[ci];
      for (DataType t : {DataType::kUInt8, DataType::kBFloat16, DataType::kInt32, DataType::kInt64}) {
        const size_t bytes = count * dtype_size(t);
        const bool in_place = ci % 2 == 0;
        std::vector<char> want;
        for (int r = 0; r < world; ++r) {
          auto b = patterned(r, bytes);
          want.insert(want.end(), b.begin(), b.end());
        }
        std::vector<std::vector<char>> outs(static_cast<size_t>(world));
        run_world(world, [&](coll::Context& ctx, int r) {
          auto& out = outs[static_cast<size_t>(r)];
          out.assign(bytes * static_cast<size_t>(world), 0);
          auto mine = patterned(r, bytes);
          if (in_place) {
            std::copy(mine.begin(), mine.end(), out.begin() + static_cast<ptrdiff_t>(bytes * static_cast<size_t>(r)));
            coll::allgather(ctx, out.data(), out.data(), count, t, a);
          } else {
            coll::allgather(ctx, mine.data(), out.data(), count, t, a);
          }
        });
        for (int r = 0; r < world; ++r) {
          ASSERT_EQ(outs[static_cast<size_t>(r)], want) << "allgather world=" << world << " count=" << count
                                                        << " algo=" << coll::algorithm_name(a) << " rank " << r
                                                        << " in_place=" << in_place;
        }
      }
    }
  }
}

TEST_P(Worlds, AllgathervUnevenCountsIncludingZero) {
  const int world = GetParam();
  for (int variant = 0; variant < 4; ++variant) {
    for (bool in_place : {false, true}) {
      std::vector<size_t> counts(static_cast<size_t>(world));
      for (int r = 0; r < world; ++r) counts[static_cast<size_t>(r)] = static_cast<size_t>((r * 7 + variant * 13) % 11) * static_cast<size_t>(variant);
      const DataType t = DataType::kFloat32;
      std::vector<char> want;
      for (int r = 0; r < world; ++r) {
        auto b = patterned(r, counts[static_cast<size_t>(r)] * 4);
        want.insert(want.end(), b.begin(), b.end());
      }
      std::vector<std::vector<char>> outs(static_cast<size_t>(world));
      run_world(world, [&](coll::Context& ctx, int r) {
        auto& out = outs[static_cast<size_t>(r)];
        out.assign(want.size(), 0);
        auto mine = patterned(r, counts[static_cast<size_t>(r)] * 4);
        if (in_place) {
          size_t displ = std::accumulate(counts.begin(), counts.begin() + r, size_t{0}) * 4;
          std::copy(mine.begin(), mine.end(), out.begin() + static_cast<ptrdiff_t>(displ));
          coll::allgatherv(ctx, out.data(), counts[static_cast<size_t>(r)], out.data(), counts.data(), t);
        } else {
          coll::allgatherv(ctx, mine.data(), counts[static_cast<size_t>(r)], out.data(), counts.data(), t);
        }
      });
      for (int r = 0; r < world; ++r) {
        ASSERT_EQ(outs[static_cast<size_t>(r)], want) << "allgatherv world=" << world << " variant=" << variant << " rank " << r;
      }
    }
  }
}

TEST_P(Worlds, GatherAndScatterEveryRoot) {
  const int world = GetParam();
  for (int root = 0; root < world; ++root) {
    for (size_t count : kCounts) {
      for (bool in_place : {false, true}) {
        const size_t bytes = count * 2;
        const DataType t = DataType::kFloat16;
        std::vector<char> want;
        for (int r = 0; r < world; ++r) {
          auto b = patterned(r, bytes);
          want.insert(want.end(), b.begin(), b.end());
        }
        std::vector<char> gathered;
        std::vector<std::vector<char>> scattered(static_cast<size_t>(world));
        run_world(world, [&](coll::Context& ctx, int r) {
          auto mine = patterned(r, bytes);
          if (r == root) {
            std::vector<char> out(want.size(), 0);
            if (in_place) {
              std::copy(mine.begin(), mine.end(), out.begin() + static_cast<ptrdiff_t>(bytes * static_cast<size_t>(r)));
              coll::gather(ctx, out.data(), out.data(), count, t, root);
            } else {
              coll::gather(ctx, mine.data(), out.data(), count, t, root);
            }
            gathered = out;
            // Scatter the gathered vector back out.
            auto& s = scattered[static_cast<size_t>(r)];
            if (in_place) {
              coll::scatter(ctx, out.data(), out.data(), count, t, root);
              s.assign(out.begin() + static_cast<ptrdiff_t>(bytes * static_cast<size_t>(r)),
                       out.begin() + static_cast<ptrdiff_t>(bytes * static_cast<size_t>(r + 1)));
            } else {
              s.assign(bytes, 0);
              coll::scatter(ctx, out.data(), s.data(), count, t, root);
            }
          } else {
            coll::gather(ctx, mine.data(), nullptr, count, t, root);
            auto& s = scattered[static_cast<size_t>(r)];
            s.assign(bytes, 0);
            coll::scatter(ctx, nullptr, s.data(), count, t, root);
          }
        });
        ASSERT_EQ(gathered, want) << "gather world=" << world << " root=" << root << " count=" << count;
        for (int r = 0; r < world; ++r) {
          ASSERT_EQ(scattered[static_cast<size_t>(r)], patterned(r, bytes))
              << "scatter world=" << world << " root=" << root << " count=" << count << " rank " << r;
        }
      }
    }
  }
}

// alltoall and alltoallv (in place and not, uneven counts with gaps) at `world` ranks, every block checked.
void check_alltoall_and_alltoallv(int world) {
  const size_t p = static_cast<size_t>(world);
  for (size_t count : kCounts) {
    for (bool in_place : {false, true}) {
      const size_t bytes = count * 8;
      const DataType t = DataType::kInt64;
      // Rank r's block for rank d is patterned(r, bytes, d * bytes).
      std::vector<std::vector<char>> outs(p);
      run_world(world, [&](coll::Context& ctx, int r) {
        auto in = patterned(r, bytes * p);
        auto& out = outs[static_cast<size_t>(r)];
        if (in_place) {
          out = in;
          coll::alltoall(ctx, out.data(), out.data(), count, t);
        } else {
          out.assign(bytes * p, 0);
          coll::alltoall(ctx, in.data(), out.data(), count, t);
        }
      });
      for (int r = 0; r < world; ++r) {
        for (int s = 0; s < world; ++s) {
          auto want = patterned(s, bytes, static_cast<size_t>(r) * bytes);
          ASSERT_TRUE(std::equal(want.begin(), want.end(),
                                 outs[static_cast<size_t>(r)].begin() + static_cast<ptrdiff_t>(static_cast<size_t>(s) * bytes)))
              << "alltoall world=" << world << " count=" << count << " rank " << r << " block from " << s;
        }
      }
    }
  }
  // alltoallv: rank s sends (s + d + k) % 5 elements to rank d, packed with a gap of one element.
  for (int k = 0; k < 3; ++k) {
    auto n = [&](int s, int d) { return static_cast<size_t>((s + d + k) % 5) * static_cast<size_t>(k); };
    std::vector<std::vector<char>> outs(p);
    std::vector<std::vector<size_t>> rdispls(p);
    run_world(world, [&](coll::Context& ctx, int r) {
      std::vector<size_t> sc(p), sd(p), rc(p), rd(p);
      size_t so = 0, ro = 0;
      for (int d = 0; d < world; ++d) {
        sc[static_cast<size_t>(d)] = n(r, d), sd[static_cast<size_t>(d)] = so, so += n(r, d) + 1;
        rc[static_cast<size_t>(d)] = n(d, r), rd[static_cast<size_t>(d)] = ro, ro += n(d, r) + 1;
      }
      std::vector<char> in(so * 4);
      for (int d = 0; d < world; ++d) {
        auto b = patterned(r * 8 + d, n(r, d) * 4);
        std::copy(b.begin(), b.end(), in.begin() + static_cast<ptrdiff_t>(sd[static_cast<size_t>(d)] * 4));
      }
      auto& out = outs[static_cast<size_t>(r)];
      out.assign(ro * 4, 0);
      coll::alltoallv(ctx, in.data(), sc.data(), sd.data(), out.data(), rc.data(), rd.data(), DataType::kFloat32);
      rdispls[static_cast<size_t>(r)] = rd;
    });
    for (int r = 0; r < world; ++r) {
      for (int s = 0; s < world; ++s) {
        auto want = patterned(s * 8 + r, n(s, r) * 4);
        ASSERT_TRUE(std::equal(want.begin(), want.end(),
                               outs[static_cast<size_t>(r)].begin() +
                                   static_cast<ptrdiff_t>(rdispls[static_cast<size_t>(r)][static_cast<size_t>(s)] * 4)))
            << "alltoallv world=" << world << " k=" << k << " rank " << r << " from " << s;
      }
    }
  }
}

TEST_P(Worlds, AlltoallAndAlltoallv) { check_alltoall_and_alltoallv(GetParam()); }

// More ranks than the pairwise exchange keeps sends in flight (gather.cc's kExchangeWindow, 8): the
// window's waits run, and every block still lands where it belongs.
TEST(Collectives, AlltoallWiderThanItsSendWindow) { check_alltoall_and_alltoallv(11); }

TEST_P(Worlds, BarrierHoldsEveryoneUntilAllArrive) {
  const int world = GetParam();
  for (int round = 0; round < 20; ++round) {
    std::atomic<int> arrived{0};
    std::atomic<int> early{0};
    run_world(world, [&](coll::Context& ctx, int r) {
      if (r == round % world) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      arrived.fetch_add(1);
      coll::barrier(ctx);
      if (arrived.load() != world) early.fetch_add(1);
    });
    ASSERT_EQ(early.load(), 0) << "a rank left the barrier before all arrived (world " << world << ")";
  }
}

// Several collectives back to back on the same contexts (scratch and request lists are reused).
TEST_P(Worlds, MixedSequenceReusesState) {
  const int world = GetParam();
  test::ThreadWorld w(world);
  test::run_ranks(world, [&](int r) {
    test::ThreadContext ctx(w, r);
    for (int iter = 0; iter < 5; ++iter) {
      for (size_t count : {size_t{5000}, size_t{3}, size_t{70000}}) {
        std::vector<float> v(count, static_cast<float>(r + 1));
        coll::allreduce(ctx, v.data(), v.data(), count, DataType::kFloat32, ReduceOp::kSum);
        const float want = static_cast<float>(world * (world + 1) / 2);
        for (float x : v) ASSERT_EQ(x, want);
        coll::barrier(ctx);
        std::vector<int32_t> g(count * static_cast<size_t>(world));
        std::vector<int32_t> mine(count, r);
        coll::allgather(ctx, mine.data(), g.data(), count, DataType::kInt32);
        for (size_t i = 0; i < g.size(); ++i) ASSERT_EQ(g[i], static_cast<int32_t>(i / count));
      }
    }
  });
  EXPECT_TRUE(w.drained());
}

TEST(Selection, SizeRulesAndOverrides) {
  using coll::OpKind;
  EXPECT_EQ(coll::default_algorithm(OpKind::kAllreduce, 2, 8), Algorithm::kRecursiveDoubling);
  EXPECT_EQ(coll::default_algorithm(OpKind::kAllreduce, 2, 64 << 20), Algorithm::kRing);
  EXPECT_EQ(coll::default_algorithm(OpKind::kAllreduce, 2, 256 << 10), Algorithm::kRing);
  EXPECT_EQ(coll::default_algorithm(OpKind::kAllreduce, 6, 256 << 10), Algorithm::kHalvingDoubling);
  EXPECT_EQ(coll::default_algorithm(OpKind::kAllreduce, 6, 64 << 20), Algorithm::kRing);
  EXPECT_EQ(coll::default_algorithm(OpKind::kBroadcast, 8, 8), Algorithm::kBinomial);
  EXPECT_EQ(coll::default_algorithm(OpKind::kBroadcast, 8, 64 << 20), Algorithm::kScatterAllgather);
  EXPECT_EQ(coll::default_algorithm(OpKind::kAllgather, 5, 100), Algorithm::kBruck);
  EXPECT_EQ(coll::default_algorithm(OpKind::kAllgather, 5, 16 << 20), Algorithm::kRing);
  EXPECT_EQ(coll::default_algorithm(OpKind::kBarrier, 5, 0), Algorithm::kDissemination);
  // A forced algorithm the operation does not have is rejected before anything is sent.
  EXPECT_THROW(coll::select_algorithm(OpKind::kAllreduce, 4, 8, Algorithm::kBruck), InvalidArgument);
  EXPECT_EQ(coll::select_algorithm(OpKind::kAllreduce, 4, 8, Algorithm::kRing), Algorithm::kRing);
  for (int k = 0; k <= static_cast<int>(Algorithm::kDissemination); ++k) {
    auto a = static_cast<Algorithm>(k);
    EXPECT_EQ(coll::parse_algorithm(coll::algorithm_name(a)), a);
  }
  EXPECT_EQ(coll::parse_algorithm("rabenseifner"), Algorithm::kHalvingDoubling);
  EXPECT_FALSE(coll::parse_algorithm("fastest").has_value());
}

// COHORT_ALGO_<OP> is read once per process, so the override is checked in a child process: the
// test binary re-runs itself with the variable set and a filter selecting the child-side test.
// Settings are read once per process, so the override is checked in a child process started by
// Selection.EnvironmentOverrideParent (disabled here: ctest never runs it on its own).
TEST(Selection, DISABLED_EnvironmentOverrideChild) {
  ASSERT_NE(std::getenv("COHORT_TEST_ALGO_CHILD"), nullptr);
  EXPECT_EQ(coll::select_algorithm(coll::OpKind::kAllreduce, 2, 8), Algorithm::kRing);
  EXPECT_EQ(coll::select_algorithm(coll::OpKind::kAllgather, 2, 8), Algorithm::kRing);
}

TEST(Selection, EnvironmentOverrideParent) {
  const std::string self = std::string(COHORT_TEST_BIN_DIR) + "/collectives_tests";
  auto ok = test::run_process({self, "--gtest_also_run_disabled_tests", "--gtest_filter=Selection.DISABLED_EnvironmentOverrideChild"},
                              {"COHORT_TEST_ALGO_CHILD=1", "COHORT_ALGO_ALLREDUCE=ring", "COHORT_ALGO_ALLGATHER=ring"}, 30);
  EXPECT_EQ(ok.exit_code, 0) << ok.out << ok.err;
  EXPECT_NE(ok.out.find("[  PASSED  ] 1 test"), std::string::npos) << ok.out;
  EXPECT_EQ(ok.out.find("SKIPPED"), std::string::npos) << ok.out;
  auto bad = test::run_process({self, "--gtest_also_run_disabled_tests", "--gtest_filter=Selection.DISABLED_EnvironmentOverrideChild"},
                               {"COHORT_TEST_ALGO_CHILD=1", "COHORT_ALGO_ALLREDUCE=bruck"}, 30);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE((bad.out + bad.err).find("COHORT_ALGO_ALLREDUCE=bruck: expected ring|rhd|rd|auto"), std::string::npos)
      << bad.out << bad.err;
}

}  // namespace
}  // namespace cohort
