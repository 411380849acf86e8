#pragma once
// What the parts of the fake NCCL share (fake_cuda.cc says what the fake is): a communicator (Comm)
// is one rank of a clique, the ranks made from one unique id; its collectives and messages meet in
// the clique. fake_nccl.cc makes and ends communicators, fake_nccl_ops.cc runs their operations on
// the fake CUDA streams, fake_nccl_hooks.cc lets tests break them.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "fake_cuda_internal.h"

#pragma GCC visibility push(hidden)
namespace fake_cuda {

// ncclResult_t's values.
enum {
  kSuccess = 0, kUnhandledCudaError = 1, kSystemError = 2, kInvalidArgument = 4, kInvalidUsage = 5,
  kRemoteError = 6, kInProgress = 7
};

// A send's message. Up to the eager size a send ends once its message is in the peer's mailbox;
// above it the send waits until the receive has taken it, as NCCL's p2p waits for the matching
// receive (the eager part stands for NCCL's connection buffers).
struct Message {
  std::vector<char> bytes;
  bool taken = false;  // under the clique's mu
};

// One rank's part in a collective: what it sends and where its result goes.
struct Contribution {
  int kind;  // 0 allreduce, 1 broadcast, 2 reduce, 3 allgather, 4 reduce_scatter
  const void* send;  // the fake's views (device memory's readable alias)
  void* recv;
  size_t count;
  int dtype, op, root;
};

// The ranks of one unique id: their collectives meet in `slots` by number, their messages in `mailbox`.
struct Clique {
  std::string id;  // the unique id it was made from (its g_cliques key until everyone joined)
  int n = 0;
  int joined = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, std::vector<Contribution>> slots;  // collective number -> per-rank contribution
  std::map<uint64_t, int> arrived, finished;
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<Message>>> mailbox;  // (from, to) -> messages
  std::set<int> exited;  // ranks whose process exited (fake_nccl_exit): their connections are closed
  std::string last_error;
};

// One rank's communicator (the handle NCCL hands out).
struct Comm {
  std::shared_ptr<Clique> clique;
  int rank = 0;
  int device = 0;
  bool blocking = true;          // ncclCommInitRankConfig with blocking = 0: false
  uint64_t next_collective = 0;  // advanced at call time (caller's order)
  // Under clique->mu:
  int error = kSuccess;  // this rank's asynchronous error
  bool aborted = false;  // ncclCommAbort/Destroy on this rank: its own pending work ends, peers are not told
  int in_progress = 0;   // non-blocking: calls NCCL has not finished (ncclCommGetAsyncError: ncclInProgress)
};

// The registries: cliques by unique id until every rank has joined; communicators by handle.
extern std::mutex g_cliques_mu;
extern std::map<std::string, std::shared_ptr<Clique>> g_cliques;
extern std::map<void*, std::shared_ptr<Comm>> g_comms;  // under g_handles_mu
extern std::set<void*> g_dead_comms;                    // aborted or destroyed: any later use is a bug
// The communicator a handle names; a dead or unknown handle aborts the process (misuse).
std::shared_ptr<Comm> comm_of(void* h, const char* what);

// What the test hooks (fake_nccl_hooks.cc) set. fake_nccl_stall: the next calls of a function on a
// device hang (fake_nccl_ops.cc, stall()); the other two slow the set-up and the abort (fake_nccl.cc).
extern std::mutex g_stall_mu;
extern std::map<std::pair<int, std::string>, int> g_stalls;  // (device, function) -> calls still to stall
extern std::atomic<int> g_stalls_ended_by_abort;
extern std::atomic<int> g_init_delay_ms;   // fake_nccl_delay_init
extern std::atomic<int> g_abort_delay_ms;  // fake_nccl_slow_abort

}  // namespace fake_cuda
#pragma GCC visibility pop
