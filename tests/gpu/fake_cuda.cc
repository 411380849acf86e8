// libcohort_fake_cuda.so: a TEST DOUBLE of the CUDA runtime and NCCL C APIs, for machines without a
// GPU (CI). It exports the functions src/gpu/runtime.h loads, with the same signatures, so that
// cohort's GPU code runs unchanged with ranks as threads in one process:
//
// - "device memory" is host memory from malloc, remembered with its device so that
//   cudaPointerGetAttributes tells device from host pointers as the real runtime does;
// - each stream is a thread that runs its queued work in order (copies, events, NCCL operations),
//   so enqueueing returns at once and completion is observed through events, as on a GPU;
// - NCCL communicators of one unique id form a clique; a collective waits on its stream thread until
//   every rank has queued the same operation, computes, and reports a mismatch or an abort through
//   ncclCommGetAsyncError. Sends never block (a mailbox per pair), receives wait for the message.
//
// FAKE_CUDA_DEVICES sets the number of devices (default 8). Only the dtypes int8, uint8, int32,
// int64, float32 and float64 are reduced (others: ncclInvalidArgument); it is enough to test
// cohort's routing, staging, bootstrap, waits and error paths, not NCCL.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

using Task = std::function<void()>;

// ---- streams: one thread each, running tasks in order ----
struct Stream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Task> tasks;
  bool stopping = false;
  std::thread thread;
  Stream() {
    thread = std::thread([this] {
      for (;;) {
        Task t;
        {
          std::unique_lock<std::mutex> lock(mu);
          cv.wait(lock, [&] { return stopping || !tasks.empty(); });
          if (tasks.empty()) return;
          t = std::move(tasks.front());
          tasks.pop_front();
        }
        t();
      }
    });
  }
  ~Stream() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stopping = true;
    }
    cv.notify_all();
    thread.join();
  }
  void push(Task t) {
    {
      std::lock_guard<std::mutex> lock(mu);
      tasks.push_back(std::move(t));
    }
    cv.notify_all();
  }
};

// The legacy default stream (null): work on it runs at once on the caller's thread.
void enqueue(void* stream, Task t) {
  if (!stream) return t();
  static_cast<Stream*>(stream)->push(std::move(t));
}

struct Event {
  std::mutex mu;
  bool ready = true;  // an event never recorded counts as complete, as in CUDA
};

// Handles are the objects' addresses; the registries own them, and queued work holds its own
// reference, so a handle destroyed with work pending (as CUDA and NCCL allow) outlives that work.
std::mutex g_handles_mu;
std::map<void*, std::shared_ptr<Event>> g_events;
std::shared_ptr<Event> event_of(void* h) {
  std::lock_guard<std::mutex> lock(g_handles_mu);
  auto it = g_events.find(h);
  return it == g_events.end() ? nullptr : it->second;
}

// ---- memory ----
struct Allocation {
  size_t bytes;
  int device;
  int type;  // 1 host (pinned), 2 device
};
std::mutex g_mem_mu;
std::map<uintptr_t, Allocation> g_allocations;

int device_count() {
  const char* v = std::getenv("FAKE_CUDA_DEVICES");
  return v ? std::atoi(v) : 8;
}
thread_local int t_device = 0;

void* remember(size_t bytes, int device, int type) {
  void* p = std::calloc(1, bytes ? bytes : 1);
  std::lock_guard<std::mutex> lock(g_mem_mu);
  g_allocations[reinterpret_cast<uintptr_t>(p)] = {bytes, device, type};
  return p;
}
void forget(void* p) {
  {
    std::lock_guard<std::mutex> lock(g_mem_mu);
    g_allocations.erase(reinterpret_cast<uintptr_t>(p));
  }
  std::free(p);
}

// ---- NCCL cliques ----
enum { kSuccess = 0, kUnhandledCudaError = 1, kInvalidArgument = 4, kInvalidUsage = 5, kRemoteError = 6 };

struct Contribution {
  int kind;  // 0 allreduce, 1 broadcast, 2 reduce, 3 allgather, 4 reduce_scatter
  const void* send;
  void* recv;
  size_t count;
  int dtype, op, root;
};

struct Clique {
  std::string id;  // the unique id it was made from (its g_cliques key until everyone joined)
  int n = 0;
  int joined = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, std::vector<Contribution>> slots;  // collective number -> per-rank contribution
  std::map<uint64_t, int> arrived, finished;
  std::map<std::pair<int, int>, std::deque<std::vector<char>>> mailbox;  // (from, to) -> messages
  bool aborted = false;
  int error = kSuccess;
  std::string last_error;
};

struct Comm {
  std::shared_ptr<Clique> clique;
  int rank = 0;
  int device = 0;
  uint64_t next_collective = 0;  // advanced at enqueue time (caller's order)
  int error = kSuccess;          // this rank's asynchronous error
};

std::mutex g_cliques_mu;
std::map<std::string, std::shared_ptr<Clique>> g_cliques;
std::map<void*, std::shared_ptr<Comm>> g_comms;  // under g_handles_mu
std::shared_ptr<Comm> comm_of(void* h) {
  std::lock_guard<std::mutex> lock(g_handles_mu);
  auto it = g_comms.find(h);
  return it == g_comms.end() ? nullptr : it->second;
}

size_t dtype_size(int t) {
  switch (t) {
    case 0: case 1: return 1;
    case 2: case 3: return 4;
    case 4: case 5: return 8;
    case 6: case 9: return 2;
    case 7: return 4;
    case 8: return 8;
  }
  return 0;
}
bool reducible(int t) { return t == 0 || t == 1 || t == 2 || t == 4 || t == 7 || t == 8; }

template <typename T>
void fold(T* acc, const T* in, size_t n, int op) {
  for (size_t i = 0; i < n; ++i) {
    switch (op) {
      case 0: case 4: acc[i] = static_cast<T>(acc[i] + in[i]); break;
      case 1: acc[i] = static_cast<T>(acc[i] * in[i]); break;
      case 2: acc[i] = acc[i] > in[i] ? acc[i] : in[i]; break;
      case 3: acc[i] = acc[i] < in[i] ? acc[i] : in[i]; break;
    }
  }
}
template <typename T>
void divide(T* acc, size_t n, int by) {
  for (size_t i = 0; i < n; ++i) acc[i] = static_cast<T>(acc[i] / by);
}

// acc op= in, for `n` elements of `dtype`.
void reduce_into(void* acc, const void* in, size_t n, int dtype, int op) {
  switch (dtype) {
    case 0: fold(static_cast<int8_t*>(acc), static_cast<const int8_t*>(in), n, op); break;
    case 1: fold(static_cast<uint8_t*>(acc), static_cast<const uint8_t*>(in), n, op); break;
    case 2: fold(static_cast<int32_t*>(acc), static_cast<const int32_t*>(in), n, op); break;
    case 4: fold(static_cast<int64_t*>(acc), static_cast<const int64_t*>(in), n, op); break;
    case 7: fold(static_cast<float*>(acc), static_cast<const float*>(in), n, op); break;
    case 8: fold(static_cast<double*>(acc), static_cast<const double*>(in), n, op); break;
  }
}
void average(void* acc, size_t n, int dtype, int by) {
  if (dtype == 7) divide(static_cast<float*>(acc), n, by);
  if (dtype == 8) divide(static_cast<double*>(acc), n, by);
}

// An operation cut short because the clique was aborted or a peer destroyed its communicator: what
// NCCL reports when a peer vanishes from the network.
void peer_gone(const std::shared_ptr<Comm>& comm) {
  comm->error = kRemoteError;
  comm->clique->last_error = "a peer's communicator was aborted or destroyed";
}

// Runs on rank `me`'s stream thread: waits for all ranks' collective number `seq`, computes this
// rank's output into a temporary, waits until everybody has read the inputs, then writes it.
void run_collective(const std::shared_ptr<Comm>& comm, uint64_t seq, Contribution mine) {
  auto& c = *comm->clique;
  std::unique_lock<std::mutex> lock(c.mu);
  auto& slot = c.slots[seq];
  if (slot.empty()) slot.resize(static_cast<size_t>(c.n));
  slot[static_cast<size_t>(comm->rank)] = mine;
  ++c.arrived[seq];
  c.cv.notify_all();
  c.cv.wait(lock, [&] { return c.aborted || c.arrived[seq] == c.n; });
  if (c.arrived[seq] != c.n) return peer_gone(comm);
  for (const auto& other : slot) {
    if (other.kind != mine.kind || other.count != mine.count || other.dtype != mine.dtype || other.op != mine.op ||
        other.root != mine.root) {
      comm->error = kInvalidUsage;
      c.last_error = "ranks called different collectives at the same point";
      break;
    }
  }
  std::vector<char> out;
  if (comm->error == kSuccess) {
    const size_t es = dtype_size(mine.dtype), n = mine.count;
    switch (mine.kind) {
      case 0:  // allreduce
      case 2:  // reduce
        out.assign(static_cast<const char*>(slot[0].send), static_cast<const char*>(slot[0].send) + n * es);
        for (int r = 1; r < c.n; ++r) reduce_into(out.data(), slot[r].send, n, mine.dtype, mine.op);
        if (mine.op == 4) average(out.data(), n, mine.dtype, c.n);
        if (mine.kind == 2 && comm->rank != mine.root) out.clear();
        break;
      case 1:  // broadcast
        out.assign(static_cast<const char*>(slot[mine.root].send),
                   static_cast<const char*>(slot[mine.root].send) + n * es);
        break;
      case 3:  // allgather
        for (int r = 0; r < c.n; ++r)
          out.insert(out.end(), static_cast<const char*>(slot[r].send), static_cast<const char*>(slot[r].send) + n * es);
        break;
      case 4: {  // reduce_scatter: block `rank` of every input
        const size_t off = static_cast<size_t>(comm->rank) * n * es;
        out.assign(static_cast<const char*>(slot[0].send) + off, static_cast<const char*>(slot[0].send) + off + n * es);
        for (int r = 1; r < c.n; ++r)
          reduce_into(out.data(), static_cast<const char*>(slot[r].send) + off, n, mine.dtype, mine.op);
        if (mine.op == 4) average(out.data(), n, mine.dtype, c.n);
        break;
      }
    }
  }
  ++c.finished[seq];
  c.cv.notify_all();
  c.cv.wait(lock, [&] { return c.aborted || c.finished[seq] == c.n; });
  if (c.finished[seq] != c.n) return peer_gone(comm);
  if (!out.empty()) std::memcpy(mine.recv, out.data(), out.size());
}

int queue_collective(void* comm_ptr, void* stream, Contribution c) {
  auto comm = comm_of(comm_ptr);
  if (!comm) return kInvalidArgument;
  if ((c.kind == 0 || c.kind == 2 || c.kind == 4) && !reducible(c.dtype)) return kInvalidArgument;
  const uint64_t seq = comm->next_collective++;
  enqueue(stream, [comm, seq, c] { run_collective(comm, seq, c); });
  return kSuccess;
}

}  // namespace

extern "C" {

// ---------------- CUDA runtime ----------------
int cudaGetDeviceCount(int* count) {
  *count = device_count();
  return 0;
}
int cudaSetDevice(int device) {
  if (device < 0 || device >= device_count()) return 101;  // cudaErrorInvalidDevice
  t_device = device;
  return 0;
}
int cudaGetDevice(int* device) {
  *device = t_device;
  return 0;
}
int cudaMalloc(void** p, size_t bytes) {
  *p = remember(bytes, t_device, 2);
  return 0;
}
int cudaFree(void* p) {
  if (p) forget(p);
  return 0;
}
int cudaMallocHost(void** p, size_t bytes) {
  *p = remember(bytes, t_device, 1);
  return 0;
}
int cudaFreeHost(void* p) {
  if (p) forget(p);
  return 0;
}
int cudaMemcpy(void* dst, const void* src, size_t bytes, int) {
  std::memcpy(dst, src, bytes);
  return 0;
}
int cudaMemcpyAsync(void* dst, const void* src, size_t bytes, int, void* stream) {
  enqueue(stream, [=] { std::memcpy(dst, src, bytes); });
  return 0;
}
int cudaMemsetAsync(void* dst, int value, size_t bytes, void* stream) {
  enqueue(stream, [=] { std::memset(dst, value, bytes); });
  return 0;
}
int cudaStreamCreateWithFlags(void** stream, unsigned) {
  *stream = new Stream();
  return 0;
}
int cudaStreamDestroy(void* stream) {
  delete static_cast<Stream*>(stream);
  return 0;
}
int cudaStreamSynchronize(void* stream) {
  if (!stream) return 0;
  auto done = std::make_shared<std::promise<void>>();
  auto f = done->get_future();
  enqueue(stream, [done] { done->set_value(); });
  f.wait();
  return 0;
}
int cudaStreamQuery(void* stream) {
  if (!stream) return 0;
  auto* s = static_cast<Stream*>(stream);
  std::lock_guard<std::mutex> lock(s->mu);
  return s->tasks.empty() ? 0 : 600;
}
int cudaStreamWaitEvent(void*, void*, unsigned) { return 0; }
int cudaEventCreateWithFlags(void** event, unsigned) {
  auto e = std::make_shared<Event>();
  std::lock_guard<std::mutex> lock(g_handles_mu);
  *event = e.get();
  g_events[e.get()] = std::move(e);
  return 0;
}
int cudaEventRecord(void* event, void* stream) {
  auto e = event_of(event);
  if (!e) return 400;  // cudaErrorInvalidResourceHandle
  {
    std::lock_guard<std::mutex> lock(e->mu);
    e->ready = false;
  }
  enqueue(stream, [e] {
    std::lock_guard<std::mutex> lock(e->mu);
    e->ready = true;
  });
  return 0;
}
int cudaEventQuery(void* event) {
  auto e = event_of(event);
  if (!e) return 400;
  std::lock_guard<std::mutex> lock(e->mu);
  return e->ready ? 0 : 600;
}
int cudaEventDestroy(void* event) {
  std::lock_guard<std::mutex> lock(g_handles_mu);
  g_events.erase(event);  // a recording still queued keeps its own reference
  return 0;
}
struct Attributes {
  int type;
  int device;
  void* device_pointer;
  void* host_pointer;
};
int cudaPointerGetAttributes(Attributes* a, const void* ptr) {
  std::memset(a, 0, sizeof *a);
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(g_mem_mu);
  auto it = g_allocations.upper_bound(p);
  if (it != g_allocations.begin()) {
    --it;
    if (p < it->first + std::max<size_t>(it->second.bytes, 1)) {
      a->type = it->second.type;
      a->device = it->second.device;
      a->device_pointer = it->second.type == 2 ? const_cast<void*>(ptr) : nullptr;
      a->host_pointer = it->second.type == 1 ? const_cast<void*>(ptr) : nullptr;
    }
  }
  return 0;
}
int cudaDeviceGetPCIBusId(char* bus, int len, int device) {
  std::snprintf(bus, static_cast<size_t>(len), "0000:%02x:00.0", device + 1);
  return 0;
}
int cudaDriverGetVersion(int* v) {
  *v = 13000;
  return 0;
}
int cudaRuntimeGetVersion(int* v) {
  *v = 13000;
  return 0;
}
int cudaGetLastError() { return 0; }
const char* cudaGetErrorName(int e) { return e == 0 ? "cudaSuccess" : e == 600 ? "cudaErrorNotReady" : "cudaErrorFake"; }
const char* cudaGetErrorString(int e) { return e == 0 ? "no error" : "fake CUDA error"; }

// ---------------- NCCL ----------------
struct UniqueId {
  char internal[128];
};

int ncclGetVersion(int* v) {
  *v = 22809;
  return 0;
}
int ncclGetUniqueId(UniqueId* id) {
  static std::atomic<uint64_t> counter{1};
  std::memset(id->internal, 0, sizeof id->internal);
  std::snprintf(id->internal, sizeof id->internal, "fake-%llu",
                static_cast<unsigned long long>(counter.fetch_add(1) + 1000 * static_cast<uint64_t>(getpid())));
  return 0;
}
int ncclCommInitRank(void** out, int nranks, UniqueId id, int rank) {
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
  if (clique->n != nranks || rank < 0 || rank >= nranks) return kInvalidArgument;
  std::unique_lock<std::mutex> lock(clique->mu);
  ++clique->joined;
  clique->cv.notify_all();
  // NCCL waits for every rank; the fake gives up after a minute so a broken test cannot hang CI.
  if (!clique->cv.wait_for(lock, std::chrono::seconds(60), [&] { return clique->joined == clique->n; }))
    return kRemoteError;
  lock.unlock();
  {
    std::lock_guard<std::mutex> g(g_cliques_mu);
    g_cliques.erase(clique->id);  // everyone is in: the id is spent
  }
  auto comm = std::make_shared<Comm>();
  comm->clique = clique;
  comm->rank = rank;
  comm->device = t_device;
  std::lock_guard<std::mutex> g(g_handles_mu);
  *out = comm.get();
  g_comms[comm.get()] = std::move(comm);
  return 0;
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
int ncclCommAbort(void* comm_ptr) {
  auto comm = comm_of(comm_ptr);
  if (!comm) return kInvalidArgument;
  {
    std::lock_guard<std::mutex> lock(comm->clique->mu);
    comm->clique->aborted = true;
  }
  comm->clique->cv.notify_all();
  std::lock_guard<std::mutex> g(g_handles_mu);
  g_comms.erase(comm_ptr);  // queued work keeps its own reference
  return 0;
}
int ncclCommDestroy(void* comm_ptr) {
  // Peers of an aborted clique would wait forever: treat destroy like abort for the waiting ones.
  return ncclCommAbort(comm_ptr);
}
int ncclCommGetAsyncError(void* comm_ptr, int* error) {
  auto comm = comm_of(comm_ptr);
  if (!comm) return kInvalidArgument;
  std::lock_guard<std::mutex> lock(comm->clique->mu);
  *error = comm->error;
  return 0;
}
const char* ncclGetErrorString(int r) {
  switch (r) {
    case 0: return "no error";
    case 4: return "invalid argument";
    case 5: return "invalid usage";
    case 6: return "remote process exited or there was a network error";
  }
  return "fake NCCL error";
}
const char* ncclGetLastError(void* comm_ptr) {
  auto comm = comm_of(comm_ptr);
  if (!comm) return "";
  static thread_local std::string last;
  std::lock_guard<std::mutex> lock(comm->clique->mu);
  last = comm->clique->last_error;
  return last.c_str();
}
int ncclAllReduce(const void* s, void* r, size_t n, int t, int op, void* comm, void* stream) {
  return queue_collective(comm, stream, {0, s, r, n, t, op, -1});
}
int ncclBroadcast(const void* s, void* r, size_t n, int t, int root, void* comm, void* stream) {
  return queue_collective(comm, stream, {1, s, r, n, t, -1, root});
}
int ncclReduce(const void* s, void* r, size_t n, int t, int op, int root, void* comm, void* stream) {
  return queue_collective(comm, stream, {2, s, r, n, t, op, root});
}
int ncclAllGather(const void* s, void* r, size_t n, int t, void* comm, void* stream) {
  return queue_collective(comm, stream, {3, s, r, n, t, -1, -1});
}
int ncclReduceScatter(const void* s, void* r, size_t n, int t, int op, void* comm, void* stream) {
  return queue_collective(comm, stream, {4, s, r, n, t, op, -1});
}
int ncclSend(const void* buf, size_t n, int t, int peer, void* comm_ptr, void* stream) {
  auto comm = comm_of(comm_ptr);
  if (!comm) return kInvalidArgument;
  const size_t bytes = n * dtype_size(t);
  enqueue(stream, [comm, buf, bytes, peer] {
    auto& c = *comm->clique;
    std::vector<char> msg(static_cast<const char*>(buf), static_cast<const char*>(buf) + bytes);
    std::lock_guard<std::mutex> lock(c.mu);
    c.mailbox[{comm->rank, peer}].push_back(std::move(msg));
    c.cv.notify_all();
  });
  return 0;
}
int ncclRecv(void* buf, size_t n, int t, int peer, void* comm_ptr, void* stream) {
  auto comm = comm_of(comm_ptr);
  if (!comm) return kInvalidArgument;
  const size_t bytes = n * dtype_size(t);
  enqueue(stream, [comm, buf, bytes, peer] {
    auto& c = *comm->clique;
    std::unique_lock<std::mutex> lock(c.mu);
    auto& q = c.mailbox[{peer, comm->rank}];
    c.cv.wait(lock, [&] { return c.aborted || !q.empty(); });
    if (q.empty()) return peer_gone(comm);
    if (q.front().size() != bytes) {
      comm->error = kInvalidUsage;
      c.last_error = "message size differs from the receive's";
    } else {
      std::memcpy(buf, q.front().data(), bytes);
    }
    q.pop_front();
  });
  return 0;
}
int ncclGroupStart() { return 0; }
int ncclGroupEnd() { return 0; }

}  // extern "C"
