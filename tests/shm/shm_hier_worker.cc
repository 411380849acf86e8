// shm_hier_worker <store file> <rank> <size> MODE: one rank of the hierarchical-allreduce tests, run
// with COHORT_HOST_ID set per simulated host.
//   expect-hierarchical | expect-flat: checks the path the communicator chose and that allreduce
//     results (several dtypes, ops and odd sizes, counts below the ranks per host) are right. Prints
//     "ok" and exits 0, or prints the problem and exits 1 (3 on a cohort error).
//   kill VICTIM STAMP: after one good allreduce, rank VICTIM writes its time of death to STAMP and
//     SIGKILLs itself; the others loop on allreduce until it throws and print
//     "RAISED <seconds after the death> <message>", exit 0.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <thread>
#include <cstdlib>
#include <string>
#include <vector>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "comm/communicator_impl.h"
#include "store/tcp_store.h"

using namespace cohort;

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: shm_hier_worker <store file> <rank> <size> expect-hierarchical|expect-flat|kill ...\n");
    return 2;
  }
  const int rank = std::atoi(argv[2]), size = std::atoi(argv[3]);
  const std::string mode = argv[4];
  try {
    auto store = make_file_store(argv[1]);
    CommOptions o;
    o.timeout = std::chrono::seconds(30);
    auto comm = Communicator::create(store, rank, size, o);
    auto* impl = dynamic_cast<comm::CommunicatorImpl*>(comm.get());
    if (mode == "kill") {
      const int victim = std::atoi(argv[5]);
      const std::string stamp = argv[6];
      std::vector<float> x(1 << 16, 1.0f);
      comm->allreduce(x.data(), x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum);
      auto wall = [] {
        return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
      };
      if (rank == victim) {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        {
          std::ofstream f(stamp);
          f.precision(17);
          f << wall();
        }
        ::kill(::getpid(), SIGKILL);
      }
      try {
        for (;;) comm->allreduce(x.data(), x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum);
      } catch (const std::exception& e) {
        const double raised = wall();
        double died = 0;
        for (int i = 0; i < 200 && died == 0; ++i) {  // the victim writes before it dies
          std::ifstream f(stamp);
          if (!(f >> died)) died = 0, std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        std::printf("RAISED %.3f %s\n", raised - died, e.what());
        std::fflush(stdout);
        ::_exit(0);  // the communicator's peers are gone: no orderly teardown to wait for
      }
    }
    const bool want_hierarchical = mode == "expect-hierarchical";
    const bool is_hierarchical = impl != nullptr && impl->host_group() != nullptr && impl->shm_group() == nullptr;
    if (want_hierarchical != is_hierarchical) {
      std::printf("rank %d: expected the %s path, the communicator chose the other\n", rank,
                  want_hierarchical ? "hierarchical" : "flat");
      return 1;
    }
    for (size_t n : {size_t{1}, size_t{2}, size_t{3}, size_t{1001}, size_t{300007}}) {
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
