// comm_worker: one rank of a test job, started N times by the fault tests (tests/comm/faults_test.cc)
// and usable as a quick benchmark.
//
//   comm_worker <mode> <store file | env> <rank> <size> [bytes]   ("env": Communicator::from_env)
//     once      one allreduce, prints the sum
//     loop      allreduce `bytes` (default 4096) forever; prints "ready" after the first one
//     mismatch  rank 1 calls allreduce with a different count than the others
//     two-roots every rank broadcasts 4 floats as the root (each its own rank), then returns from main:
//               a small broadcast's root does not wait, so only the communicator's end can name it
//     skip      10 allreduces, but rank 1 skips the 5th: it finishes one early and exits 0 while the
//               others wait in their 10th (the flight recorder names rank 1)
//     timed     allreduces for 3 s, then exits 0 (live stats)
//     stop      allreduces 20 ms apart; rank 1 stops itself (SIGSTOP) after the 6th (stall inspector)
//     bench     allreduce latency/bandwidth table (rank 0 prints)
//     exit-early:<how>    rank 1 ends before it creates its communicator; the others create theirs and
//                         allreduce once. <how>: an exit code, or "kill" (SIGKILL)
//     exit-between:<how>  3 allreduces, then rank 1 ends (an exit code: returning from main, so its
//                         communicator says goodbye; "kill": SIGKILL) while the others call a 4th
//     late-join:<ms>      rank 1 sleeps <ms> before it creates its communicator; then one allreduce
//     exit-before-subgroup:<how>  one allreduce, then rank 1 ends while the others build a subgroup of
//                         every rank
//     corrupt-ring:<how>  3 allreduces, then rank 0 scribbles over its flight recorder ring's header and
//                         entries, as a worker with corrupt memory would, and every rank exits 3. <how>:
//                         "zero" (capacity 0) or "huge" (capacity and entry count far past the ring)
//
// Errors print "ERROR <class>: <message>" on stderr and exit with 3.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "store/tcp_store.h"
#include "trace/flight_ring.h"

using namespace cohort;

namespace {

// This process's mapping of the flight recorder ring the launcher handed it (its memfd is named
// "cohort-flight-recorder-rank<N>"), found in /proc/self/maps; nullptr when there is none.
trace::RingHeader* launcher_ring() {
  std::FILE* maps = std::fopen("/proc/self/maps", "r");
  if (!maps) return nullptr;
  char line[512];
  void* found = nullptr;
  while (!found && std::fgets(line, sizeof line, maps))
    if (std::strstr(line, "cohort-flight-recorder-rank"))
      found = reinterpret_cast<void*>(std::strtoull(line, nullptr, 16));
  std::fclose(maps);
  return static_cast<trace::RingHeader*>(found);
}

const char* error_class(const std::exception& e) {
  if (dynamic_cast<const PeerLostError*>(&e)) return "PeerLostError";
  if (dynamic_cast<const TimeoutError*>(&e)) return "TimeoutError";
  if (dynamic_cast<const MismatchError*>(&e)) return "MismatchError";
  if (dynamic_cast<const AbortedError*>(&e)) return "AbortedError";
  if (dynamic_cast<const InvalidArgument*>(&e)) return "InvalidArgument";
  if (dynamic_cast<const ConfigError*>(&e)) return "ConfigError";
  return "Error";
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void bench(Communicator& comm) {
  const size_t sizes[] = {8, 1024, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20};
  std::vector<float> buf((64 << 20) / 4, 0.0f);
  if (comm.rank() == 0) std::printf("%12s %12s %10s %10s\n", "bytes", "time_us", "algbw", "busbw");
  for (size_t bytes : sizes) {
    size_t count = std::max<size_t>(1, bytes / 4);
    for (int i = 0; i < 5; ++i) comm.allreduce(buf.data(), buf.data(), count, DataType::kFloat32, ReduceOp::kSum);
    // Iterations: about 0.5 s worth, agreed by every rank (rank 0 decides).
    double t0 = now_s();
    comm.allreduce(buf.data(), buf.data(), count, DataType::kFloat32, ReduceOp::kSum);
    double one = now_s() - t0;
    double iters_d = std::max(3.0, std::min(200000.0, 0.5 / std::max(one, 1e-7)));
    double agreed = iters_d;
    comm.broadcast(&agreed, 1, DataType::kFloat64, 0);
    int iters = int(agreed);
    std::vector<double> trials;
    for (int trial = 0; trial < 3; ++trial) {
      comm.barrier();
      double s = now_s();
      for (int i = 0; i < iters; ++i)
        comm.allreduce(buf.data(), buf.data(), count, DataType::kFloat32, ReduceOp::kSum);
      double t = (now_s() - s) / iters;
      comm.allreduce(&t, &t, 1, DataType::kFloat64, ReduceOp::kMax);
      trials.push_back(t);
    }
    std::sort(trials.begin(), trials.end());
    double t = trials[1];
    double algbw = double(count * 4) / t / 1e9;
    double busbw = algbw * 2.0 * (comm.size() - 1) / comm.size();
    if (comm.rank() == 0) std::printf("%12zu %12.2f %10.3f %10.3f\n", count * 4, t * 1e6, algbw, busbw);
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: comm_worker <once|loop|mismatch|skip|stop|bench> <store file> <rank> <size> [bytes]\n");
    return 2;
  }
  std::string mode = argv[1];
  int rank = std::atoi(argv[3]), size = std::atoi(argv[4]);
  size_t bytes = argc > 5 ? std::strtoull(argv[5], nullptr, 10) : 4096;
  // "<mode>:<how>" (exit-early, exit-between, late-join)
  std::string how;
  if (auto colon = mode.find(':'); colon != std::string::npos) {
    how = mode.substr(colon + 1);
    mode.resize(colon);
  }
  // Ends this process as `how` says: SIGKILL, or the exit code (returned from main by the caller).
  auto end_now = [&]() -> int {
    if (how == "kill") raise(SIGKILL);
    return std::atoi(how.c_str());
  };
  if (std::string(argv[2]) == "env" && (mode == "exit-early" || mode == "late-join")) {
    // The rank comes from the launcher's environment before any communicator exists.
    const char* r = std::getenv("RANK");
    if (r && std::atoi(r) == 1) {
      if (mode == "exit-early") return end_now();
      std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(how.c_str())));
    }
  }
  try {
    std::shared_ptr<Communicator> comm;
    if (std::string(argv[2]) == "env") {
      comm = Communicator::from_env();  // the launcher's / torchrun's / MPI's variables
    } else {
      comm = Communicator::create(make_file_store(argv[2]), rank, size);
    }
    rank = comm->rank();  // from the environment in "env" mode
    if (mode == "bench") {
      bench(*comm);
      return 0;
    }
    std::vector<float> buf(std::max<size_t>(1, bytes / 4), 1.0f);
    if (mode == "once") {
      comm->allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum);
      std::printf("rank %d of %d: sum %g\n", comm->rank(), comm->size(), double(buf[0]));
      return 0;
    }
    if (mode == "mismatch") {
      size_t count = rank == 1 ? buf.size() / 2 : buf.size();
      comm->allreduce(buf.data(), buf.data(), count, DataType::kFloat32, ReduceOp::kSum);
      std::printf("no error\n");
      return 0;
    }
    if (mode == "two-roots") {
      comm->broadcast(buf.data(), 4, DataType::kFloat32, rank);
      std::printf("rank %d: broadcast returned\n", rank);
      std::fflush(stdout);
      return 0;  // `comm` ends here
    }
    if (mode == "skip") {
      for (int i = 1; i <= 10; ++i)
        if (!(rank == 1 && i == 5)) comm->allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum);
      std::printf("rank %d done\n", rank);
      return 0;
    }
    if (mode == "timed") {
      // Every rank stops at the same operation: rank 0's clock decides, every 256 allreduces.
      double end = now_s() + 3.0;
      for (int32_t stop = 0; !stop;) {
        for (int i = 0; i < 256; ++i)
          comm->allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum);
        stop = now_s() >= end;
        comm->broadcast(&stop, 1, DataType::kInt32, 0);
      }
      return 0;
    }
    if (mode == "exit-early" || mode == "late-join") {
      comm->allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum);
      std::printf("rank %d: sum %g\n", rank, double(buf[0]));
      return 0;
    }
    if (mode == "exit-between") {
      for (int i = 1; i <= 3; ++i)
        comm->allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum);
      if (rank == 1) return end_now();  // `comm` goes out of scope: an orderly goodbye
      comm->allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum);
      std::printf("rank %d: 4 allreduces, no error\n", rank);
      return 0;
    }
    if (mode == "exit-before-subgroup") {
      comm->allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum);
      if (rank == 1) return end_now();
      std::vector<int> everyone;
      for (int r = 0; r < comm->size(); ++r) everyone.push_back(r);
      auto sub = comm->subgroup(everyone);
      sub->allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum);
      std::printf("rank %d: subgroup built, no error\n", rank);
      return 0;
    }
    if (mode == "corrupt-ring") {
      for (int i = 1; i <= 3; ++i)
        comm->allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum);
      if (rank == 0) {
        trace::RingHeader* h = launcher_ring();
        if (!h) {
          std::fprintf(stderr, "ERROR Error: no flight recorder ring mapped (COHORT_FLIGHT_RECORDER_FD?)\n");
          return 4;
        }
        // What a worker with corrupt memory may leave: any header field, any entry (the first one's
        // operation and state out of range). The entries this ring really has stay readable.
        const uint32_t capacity = h->capacity;
        auto* entries = reinterpret_cast<trace::RingEntry*>(reinterpret_cast<char*>(h) + sizeof(trace::RingHeader));
        std::memset(reinterpret_cast<char*>(&entries[0]) + 4, 0xee, sizeof(trace::RingEntry) - 4);
        h->capacity = how == "zero" ? 0 : 0xffffffffu;
        h->next.store(how == "zero" ? 5 : (uint64_t(1) << 40), std::memory_order_release);
        h->rank = -77;
        h->world = 1 << 30;
        std::memset(h->host, 0xff, sizeof h->host);
        h->pid.store(-5);
        std::printf("rank 0 corrupted its ring of %u entries\n", capacity);
        std::fflush(stdout);
      }
      return 3;
    }
    if (mode == "stop") {
      for (int i = 1;; ++i) {
        comm->allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum);
        if (rank == 1 && i == 6) raise(SIGSTOP);
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    comm->allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum);
    std::printf("ready\n");
    std::fflush(stdout);
    for (;;) comm->allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kMax);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ERROR %s: %s\n", error_class(e), e.what());
    return 3;
  }
}
