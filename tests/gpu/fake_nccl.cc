// The fake NCCL's communicators (fake_cuda.cc says what the fake is): the version and unique ids,
// the set-up (blocking, or non-blocking with ncclInProgress until every rank has joined), the abort
// and destroy that end only this rank's work, and the error queries.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <unistd.h>

#include "fake_nccl_internal.h"

namespace fake_cuda {

std::mutex g_cliques_mu;
std::map<std::string, std::shared_ptr<Clique>> g_cliques;
std::map<void*, std::shared_ptr<Comm>> g_comms;  // under g_handles_mu
std::set<void*> g_dead_comms;                    // aborted or destroyed: any later use is a bug
std::shared_ptr<Comm> comm_of(void* h, const char* what) {
  std::lock_guard<std::mutex> lock(g_handles_mu);
  auto it = g_comms.find(h);
  if (it != g_comms.end()) return it->second;
  if (g_dead_comms.count(h))
    misuse("%s on communicator %p after ncclCommAbort/ncclCommDestroy freed it (a use after free)", h, what);
  misuse("%s on %p, which is not an NCCL communicator", h, what);
}

std::atomic<int> g_init_delay_ms{0};
std::atomic<int> g_abort_delay_ms{0};

}  // namespace fake_cuda

using namespace fake_cuda;

extern "C" {
// ---------------- NCCL ----------------
struct UniqueId {
  char internal[128];
};

// FAKE_NCCL_VERSION: the version reported (default 2.28.9). Below 2.14 the fake is an NCCL without
// ncclCommInitRankConfig as far as cohort can tell (it checks the version), so its communicators are
// blocking.
int ncclGetVersion(int* v) {
  const char* env = std::getenv("FAKE_NCCL_VERSION");
  *v = env ? std::atoi(env) : 22809;
  return 0;
}
int ncclGetUniqueId(UniqueId* id) {
  static std::atomic<uint64_t> counter{1};
  std::memset(id->internal, 0, sizeof id->internal);
  std::snprintf(id->internal, sizeof id->internal, "fake-%llu",
                static_cast<unsigned long long>(counter.fetch_add(1) + 1000 * static_cast<uint64_t>(getpid())));
  return 0;
}
}  // extern "C"
namespace {
// Joins the clique: waits for every rank (NCCL waits forever; the fake gives up after a minute so a
// broken test cannot hang CI), then, with fake_nccl_delay_init, as long again as asked (a slow
// bootstrap). Ends early when the communicator is aborted meanwhile.
int join(const std::shared_ptr<Comm>& comm) {
  auto& c = *comm->clique;
  std::unique_lock<std::mutex> lock(c.mu);
  if (!c.cv.wait_for(lock, std::chrono::seconds(60), [&] { return comm->aborted || c.joined == c.n; }))
    return kRemoteError;
  const auto delay = std::chrono::milliseconds(g_init_delay_ms.load());
  if (c.cv.wait_for(lock, delay, [&] { return comm->aborted; }) || comm->aborted) return kRemoteError;
  lock.unlock();
  std::lock_guard<std::mutex> g(g_cliques_mu);
  g_cliques.erase(c.id);  // everyone is in: the id is spent
  return kSuccess;
}

// The communicator's handle exists from the start (a non-blocking init hands it out at once, and
// ncclCommAbort may end the set-up).
std::shared_ptr<Comm> new_comm(int nranks, const UniqueId& id, int rank, bool blocking, void** out) {
  std::shared_ptr<Clique> clique;
  {
    std::lock_guard<std::mutex> lock(g_cliques_mu);
    auto& c = g_cliques[std::string(id.internal)];
    if (!c) {
      c = std::make_shared<Clique>();
      c->id = id.internal;
      c->n = nranks;
    }
    clique = c;
  }
  if (clique->n != nranks || rank < 0 || rank >= nranks) return nullptr;
  auto comm = std::make_shared<Comm>();
  comm->clique = clique;
  comm->rank = rank;
  comm->device = t_device;
  comm->blocking = blocking;
  {
    std::lock_guard<std::mutex> lock(clique->mu);
    ++clique->joined;
    if (!blocking) comm->in_progress = 1;
    clique->cv.notify_all();
  }
  std::lock_guard<std::mutex> g(g_handles_mu);
  *out = comm.get();
  g_comms[comm.get()] = comm;
  return comm;
}

// ncclConfig_t's first fields (NCCL 2.14's), as NCCL reads them.
struct Config {
  size_t size;
  unsigned magic, version;
  int blocking;
};
}  // namespace
extern "C" {
int ncclCommInitRank(void** out, int nranks, UniqueId id, int rank) {
  *out = nullptr;
  auto comm = new_comm(nranks, id, rank, true, out);
  if (!comm) return kInvalidArgument;
  const int rc = join(comm);
  if (rc != kSuccess) {
    std::lock_guard<std::mutex> g(g_handles_mu);  // a failed init leaves no communicator
    g_comms.erase(comm.get());
    *out = nullptr;
  }
  return rc;
}
int ncclCommInitRankConfig(void** out, int nranks, UniqueId id, int rank, Config* config) {
  *out = nullptr;
  if (config && (config->size < sizeof(Config) || config->magic != 0xcafebeef))
    misuse("%s: config %p was not made with NCCL_CONFIG_INITIALIZER", config, "ncclCommInitRankConfig");
  const bool blocking = !config || config->version < 21400 || config->blocking != 0;
  if (blocking) return ncclCommInitRank(out, nranks, id, rank);
  auto comm = new_comm(nranks, id, rank, false, out);
  if (!comm) return kInvalidArgument;
  std::thread([comm] {
    const int rc = join(comm);
    std::lock_guard<std::mutex> lock(comm->clique->mu);
    if (rc != kSuccess && !comm->aborted) {
      comm->error = rc;
      comm->clique->last_error = "the communicator's set-up failed";
    }
    comm->in_progress = 0;
    comm->clique->cv.notify_all();
  }).detach();
  return kInProgress;
}
int ncclCommInitAll(void** comms, int ndev, const int* devices) {
  auto clique = std::make_shared<Clique>();
  clique->n = clique->joined = ndev;
  std::lock_guard<std::mutex> g(g_handles_mu);
  for (int i = 0; i < ndev; ++i) {
    auto c = std::make_shared<Comm>();
    c->clique = clique;
    c->rank = i;
    c->device = devices ? devices[i] : i;
    comms[i] = c.get();
    g_comms[c.get()] = std::move(c);
  }
  return 0;
}
}  // extern "C"
namespace {
// Frees the handle: any later call with it aborts the test (see comm_of). Only this rank's work
// ends: NCCL tells no peer (they end at their own deadline).

int abort_comm(void* comm_ptr, const char* what) {
  auto comm = comm_of(comm_ptr, what);
  // A real ncclCommAbort frees device memory, which waits for the GPU: slow while it is busy.
  if (int ms = g_abort_delay_ms.load(); ms > 0 && std::string(what) == "ncclCommAbort")
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  {
    std::lock_guard<std::mutex> lock(comm->clique->mu);
    comm->aborted = true;
    comm->in_progress = 0;
  }
  comm->clique->cv.notify_all();
  std::lock_guard<std::mutex> g(g_handles_mu);
  g_comms.erase(comm_ptr);  // queued work keeps its own reference
  g_dead_comms.insert(comm_ptr);
  return 0;
}

}  // namespace
extern "C" {
int ncclCommAbort(void* comm_ptr) { return abort_comm(comm_ptr, "ncclCommAbort"); }
// Destroy would flush the communicator's work first; the fake ends it like an abort (cohort destroys
// only communicators whose stream has drained).
int ncclCommDestroy(void* comm_ptr) { return abort_comm(comm_ptr, "ncclCommDestroy"); }
int ncclCommGetAsyncError(void* comm_ptr, int* error) {
  auto comm = comm_of(comm_ptr, "ncclCommGetAsyncError");
  std::lock_guard<std::mutex> lock(comm->clique->mu);
  *error = comm->error != kSuccess ? comm->error : comm->in_progress > 0 ? kInProgress : kSuccess;
  return 0;
}
const char* ncclGetErrorString(int r) {
  switch (r) {
    case 0: return "no error";
    case 2: return "unhandled system error";
    case 4: return "invalid argument";
    case 5: return "invalid usage";
    case 6: return "remote process exited or there was a network error";
    case 7: return "NCCL operation in progress";
  }
  return "fake NCCL error";
}
const char* ncclGetLastError(void* comm_ptr) {
  if (!comm_ptr) return "";
  auto comm = comm_of(comm_ptr, "ncclGetLastError");
  static thread_local std::string last;
  std::lock_guard<std::mutex> lock(comm->clique->mu);
  last = comm->clique->last_error;
  return last.c_str();
}

}  // extern "C"
