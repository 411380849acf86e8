// shm_hier_worker <store file> <rank> <size>: one rank of the hierarchical-allreduce test. Run with
// COHORT_HOST_ID set per simulated host; checks that the communicator chose the hierarchical path and
// that allreduce results (several dtypes, ops and odd sizes) are right. Prints "ok" and exits 0, or
// prints the problem and exits 1 (3 on a cohort error).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "comm/communicator_impl.h"
#include "store/tcp_store.h"

using namespace cohort;

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: shm_hier_worker <store file> <rank> <size>\n");
    return 2;
  }
  const int rank = std::atoi(argv[2]), size = std::atoi(argv[3]);
  try {
    auto store = make_file_store(argv[1]);
    CommOptions o;
    o.timeout = std::chrono::seconds(30);
    auto comm = Communicator::create(store, rank, size, o);
    auto* impl = dynamic_cast<comm::CommunicatorImpl*>(comm.get());
    if (impl == nullptr || impl->host_group() == nullptr || impl->shm_group() != nullptr) {
      std::printf("rank %d: expected the hierarchical path (host group set, no flat shm group)\n", rank);
      return 1;
    }
    for (size_t n : {size_t{1}, size_t{3}, size_t{1001}, size_t{300007}}) {
      std::vector<double> d(n);
      for (size_t i = 0; i < n; ++i) d[i] = static_cast<double>((i % 13) * (rank + 1));
      comm->allreduce(d.data(), d.data(), n, DataType::kFloat64, ReduceOp::kSum);
      const double ranks_sum = size * (size + 1) / 2.0;
      for (size_t i = 0; i < n; ++i)
        if (d[i] != (i % 13) * ranks_sum) {
          std::printf("rank %d: float64 sum n=%zu element %zu is %g, expected %g\n", rank, n, i, d[i], (i % 13) * ranks_sum);
          return 1;
        }
      std::vector<int32_t> m(n);
      for (size_t i = 0; i < n; ++i) m[i] = static_cast<int32_t>((i + static_cast<size_t>(rank) * 7) % 101);
      comm->allreduce(m.data(), m.data(), n, DataType::kInt32, ReduceOp::kMax);
      for (size_t i = 0; i < n; ++i) {
        int32_t want = 0;
        for (int r = 0; r < size; ++r) want = std::max(want, static_cast<int32_t>((i + static_cast<size_t>(r) * 7) % 101));
        if (m[i] != want) {
          std::printf("rank %d: int32 max n=%zu element %zu is %d, expected %d\n", rank, n, i, m[i], want);
          return 1;
        }
      }
      std::vector<float> a(n, static_cast<float>(rank));
      comm->allreduce(a.data(), a.data(), n, DataType::kFloat32, ReduceOp::kAvg);
      for (size_t i = 0; i < n; ++i)
        if (std::fabs(a[i] - (size - 1) / 2.0f) > 1e-5f) {
          std::printf("rank %d: float32 avg n=%zu element %zu is %g\n", rank, n, i, a[i]);
          return 1;
        }
    }
    comm->barrier();
    std::printf("ok\n");
    return 0;
  } catch (const std::exception& e) {
    std::printf("rank %d: ERROR %s\n", rank, e.what());
    return 3;
  }
}
