// libcohort_fake_cuda.so: a TEST DOUBLE of the CUDA runtime and NCCL C APIs, for machines without a
// GPU (CI). It exports the functions src/gpu/runtime.h loads, with the same signatures, so that
// cohort's GPU code runs unchanged with ranks as threads in one process. It is strict where real CUDA
// and NCCL are, so that code which would misbehave on a GPU fails here:
//
// - "device memory" is host memory from malloc, remembered with its device so that
//   cudaPointerGetAttributes tells device from host pointers as the real runtime does;
// - each stream is a thread that runs its queued work in order (copies, events, NCCL operations,
//   "kernels" from cudaLaunchHostFunc), so enqueueing returns at once and completion is observed
//   through events, as on a GPU. The legacy default stream (null, cudaStreamLegacy) is a stream of
//   its own per device, with CUDA's implicit synchronisation: its work waits for work queued earlier
//   on the device's blocking streams, and theirs for its; streams made with cudaStreamNonBlocking
//   take no part. cudaMemcpy runs on it and returns when done;
// - cudaStreamWaitEvent really orders: later work on the stream waits for the event's latest
//   recording; timing events carry the time they ran (cudaEventElapsedTime);
// - NCCL communicators of one unique id form a clique; a collective waits on its stream thread until
//   every rank has queued the same operation, computes, and reports a mismatch or an abort through
//   ncclCommGetAsyncError. Sends never block (a mailbox per pair), receives wait for the message;
// - a communicator, stream or event used after it was aborted, destroyed or never made aborts the
//   process with a message naming the call (a real use after free crashes, or worse, later).
//
// FAKE_CUDA_DEVICES sets the number of devices (default 8). Only the dtypes int8, uint8, int32,
// int64, float32 and float64 are reduced (others: ncclInvalidArgument); it is enough to test
// cohort's routing, staging, stream order, bootstrap, waits and error paths, not NCCL.
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
#include <set>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

using Task = std::function<void()>;

[[noreturn]] void misuse(const char* fmt, const void* handle, const char* what) {
  std::fprintf(stderr, "fake CUDA/NCCL: ");
  std::fprintf(stderr, fmt, what, handle);
  std::fprintf(stderr, "\n");
  std::fflush(stderr);
  std::abort();
}

int device_count() {
  const char* v = std::getenv("FAKE_CUDA_DEVICES");
  return v ? std::atoi(v) : 8;
}
thread_local int t_device = 0;

// ---- streams: one thread each, running tasks in order ----
// A task may first wait for other streams (the legacy default stream's implicit synchronisation)
// or for an event (cudaStreamWaitEvent); `completed` counts the tasks that have run, so "everything
// queued on stream S before now" is "S.completed reaches S.enqueued as read now".
struct Stream {
  const int device;
  const bool blocking;  // created without cudaStreamNonBlocking (or the legacy stream itself)
  const bool legacy;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Task> tasks;
  uint64_t enqueued = 0;   // under g_order_mu
  uint64_t completed = 0;  // under mu
  bool stopping = false;
  std::thread thread;
  Stream(int device, bool blocking, bool legacy) : device(device), blocking(blocking), legacy(legacy) {
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
        std::lock_guard<std::mutex> lock(mu);
        ++completed;
        cv.notify_all();
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
  void wait_completed(uint64_t n) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return completed >= n; });
  }
};

// Handles are the objects' addresses; the registries own them, and queued work holds its own
// reference, so a handle destroyed with work pending (as CUDA and NCCL allow) outlives that work.
// A destroyed handle used again is a test failure: the process aborts with a message, as a real
// use after free would, at best, crash.
std::mutex g_handles_mu;
std::map<void*, std::shared_ptr<Stream>> g_streams;
std::map<int, std::shared_ptr<Stream>> g_legacy;  // per device, made on first use

// cudaStreamLegacy and cudaStreamPerThread, as cuda_runtime_api.h defines them.
void* const kStreamLegacy = reinterpret_cast<void*>(0x1);
void* const kStreamPerThread = reinterpret_cast<void*>(0x2);

std::shared_ptr<Stream> stream_of(void* h, const char* what) {
  std::lock_guard<std::mutex> lock(g_handles_mu);
  if (!h || h == kStreamLegacy || h == kStreamPerThread) {
    auto& s = g_legacy[t_device];
    if (!s) s = std::make_shared<Stream>(t_device, true, true);
    return s;
  }
  auto it = g_streams.find(h);
  if (it == g_streams.end()) misuse("%s on stream %p, which is not a live stream (destroyed?)", h, what);
  return it->second;
}

// Serialises enqueueing, so that "queued before" is one order across streams.
std::mutex g_order_mu;

// Queues `t` on `stream` with CUDA's implicit synchronisation of the legacy default stream: work on
// it waits for all work queued earlier on the device's blocking streams, and work on a blocking
// stream waits for work queued earlier on the legacy stream. Non-blocking streams do neither.
void enqueue(void* stream, Task t, const char* what = "enqueue") {
  auto s = stream_of(stream, what);
  std::vector<std::pair<std::shared_ptr<Stream>, uint64_t>> before;
  std::lock_guard<std::mutex> order(g_order_mu);
  {
    std::lock_guard<std::mutex> lock(g_handles_mu);
    if (s->legacy) {
      for (auto& [h, other] : g_streams)
        if (other->blocking && other->device == s->device && other->enqueued) before.emplace_back(other, other->enqueued);
    } else if (s->blocking) {
      auto it = g_legacy.find(s->device);
      if (it != g_legacy.end() && it->second->enqueued) before.emplace_back(it->second, it->second->enqueued);
    }
  }
  ++s->enqueued;
  if (before.empty()) return s->push(std::move(t));
  s->push([before = std::move(before), t = std::move(t)] {
    for (auto& [other, n] : before) other->wait_completed(n);
    t();
  });
}

struct Event {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;   // cudaEventRecord calls
  uint64_t completed = 0;  // of those, the latest that has run on its stream
  bool timing = true;
  std::chrono::steady_clock::time_point when{};
};

std::map<void*, std::shared_ptr<Event>> g_events;
std::shared_ptr<Event> event_of(void* h, const char* what) {
  std::lock_guard<std::mutex> lock(g_handles_mu);
  auto it = g_events.find(h);
  if (it == g_events.end()) misuse("%s on event %p, which is not a live event (destroyed?)", h, what);
  return it->second;
}

// ---- memory ----
struct Allocation {
  size_t bytes;
  int device;
  int type;  // 1 host (pinned), 2 device
};
std::mutex g_mem_mu;
std::map<uintptr_t, Allocation> g_allocations;

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
std::set<void*> g_dead_comms;                    // aborted or destroyed: any later use is a bug
std::shared_ptr<Comm> comm_of(void* h, const char* what) {
  std::lock_guard<std::mutex> lock(g_handles_mu);
  auto it = g_comms.find(h);
  if (it != g_comms.end()) return it->second;
  if (g_dead_comms.count(h))
    misuse("%s on communicator %p after ncclCommAbort/ncclCommDestroy freed it (a use after free)", h, what);
  misuse("%s on %p, which is not an NCCL communicator", h, what);
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

int queue_collective(void* comm_ptr, void* stream, Contribution c, const char* what) {
  auto comm = comm_of(comm_ptr, what);
  if (!comm) return kInvalidArgument;
  if ((c.kind == 0 || c.kind == 2 || c.kind == 4) && !reducible(c.dtype)) return kInvalidArgument;
  const uint64_t seq = comm->next_collective++;
  enqueue(stream, [comm, seq, c] { run_collective(comm, seq, c); }, what);
  return kSuccess;
}

}  // namespace

extern "C" {

// ---------------- CUDA runtime ----------------
// FAKE_CUDA_NO_DRIVER=1: a host with the CUDA runtime but no NVIDIA driver, as the real runtime
// reports it (driver version 0, cudaErrorInsufficientDriver); =old: a driver older than the runtime.
const char* no_driver() { return std::getenv("FAKE_CUDA_NO_DRIVER"); }
int cudaGetDeviceCount(int* count) {
  if (no_driver()) {
    *count = 0;
    return 35;  // cudaErrorInsufficientDriver
  }
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
// Like the real one, cudaFree waits for the device's streams: work queued on them may still use the
// memory (a program that frees memory with work in flight is right on a GPU).
static void drain_device_of(void* p) {
  int device = -1;
  {
    std::lock_guard<std::mutex> lock(g_mem_mu);
    auto it = g_allocations.find(reinterpret_cast<uintptr_t>(p));
    if (it != g_allocations.end()) device = it->second.device;
  }
  std::vector<std::pair<std::shared_ptr<Stream>, uint64_t>> streams;
  {
    std::lock_guard<std::mutex> order(g_order_mu);
    std::lock_guard<std::mutex> lock(g_handles_mu);
    for (auto& [h, s] : g_streams)
      if (s->device == device) streams.emplace_back(s, s->enqueued);
    auto it = g_legacy.find(device);
    if (it != g_legacy.end()) streams.emplace_back(it->second, it->second->enqueued);
  }
  for (auto& [s, n] : streams) s->wait_completed(n);
}
int cudaFree(void* p) {
  if (!p) return 0;
  drain_device_of(p);
  forget(p);
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
// cudaMemcpy: on the legacy default stream of the current device, returning when done.
int cudaMemcpy(void* dst, const void* src, size_t bytes, int) {
  auto done = std::make_shared<std::promise<void>>();
  auto f = done->get_future();
  enqueue(nullptr, [=] {
    std::memcpy(dst, src, bytes);
    done->set_value();
  }, "cudaMemcpy");
  f.wait();
  return 0;
}
int cudaMemcpyAsync(void* dst, const void* src, size_t bytes, int, void* stream) {
  enqueue(stream, [=] { std::memcpy(dst, src, bytes); }, "cudaMemcpyAsync");
  return 0;
}
int cudaMemsetAsync(void* dst, int value, size_t bytes, void* stream) {
  enqueue(stream, [=] { std::memset(dst, value, bytes); }, "cudaMemsetAsync");
  return 0;
}
// flags: cudaStreamDefault (0, blocking) or cudaStreamNonBlocking (1).
int cudaStreamCreateWithFlags(void** stream, unsigned flags) {
  if (flags > 1) return 1;  // cudaErrorInvalidValue
  auto s = std::make_shared<Stream>(t_device, (flags & 1) == 0, false);
  std::lock_guard<std::mutex> lock(g_handles_mu);
  *stream = s.get();
  g_streams[s.get()] = std::move(s);
  return 0;
}
int cudaStreamDestroy(void* stream) {
  std::shared_ptr<Stream> s;
  {
    std::lock_guard<std::mutex> lock(g_handles_mu);
    auto it = g_streams.find(stream);
    if (it == g_streams.end()) misuse("%s on stream %p, which is not a live stream (destroyed twice?)", stream, "cudaStreamDestroy");
    s = std::move(it->second);
    g_streams.erase(it);
  }
  // Queued work still runs (as CUDA does); the thread ends with the last reference.
  return 0;
}
int cudaStreamSynchronize(void* stream) {
  auto done = std::make_shared<std::promise<void>>();
  auto f = done->get_future();
  enqueue(stream, [done] { done->set_value(); }, "cudaStreamSynchronize");
  f.wait();
  return 0;
}
int cudaStreamQuery(void* stream) {
  auto s = stream_of(stream, "cudaStreamQuery");
  std::lock_guard<std::mutex> order(g_order_mu);
  std::lock_guard<std::mutex> lock(s->mu);
  return s->completed >= s->enqueued ? 0 : 600;
}
// Work queued on `stream` after this call waits until the event's latest recording has run.
int cudaStreamWaitEvent(void* stream, void* event, unsigned) {
  auto e = event_of(event, "cudaStreamWaitEvent");
  uint64_t target;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    target = e->recorded;
  }
  if (target == 0) return 0;  // never recorded: nothing to wait for, as in CUDA
  enqueue(stream, [e, target] {
    std::unique_lock<std::mutex> lock(e->mu);
    e->cv.wait(lock, [&] { return e->completed >= target; });
  }, "cudaStreamWaitEvent");
  return 0;
}
// Test helper with the real function's signature: a "kernel" that runs `fn(data)` in stream order.
int cudaLaunchHostFunc(void* stream, void (*fn)(void*), void* data) {
  enqueue(stream, [fn, data] { fn(data); }, "cudaLaunchHostFunc");
  return 0;
}
int cudaEventCreateWithFlags(void** event, unsigned flags) {
  auto e = std::make_shared<Event>();
  e->timing = (flags & 0x02) == 0;
  std::lock_guard<std::mutex> lock(g_handles_mu);
  *event = e.get();
  g_events[e.get()] = std::move(e);
  return 0;
}
int cudaEventRecord(void* event, void* stream) {
  auto e = event_of(event, "cudaEventRecord");
  uint64_t gen;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    gen = ++e->recorded;
  }
  enqueue(stream, [e, gen] {
    std::lock_guard<std::mutex> lock(e->mu);
    if (gen > e->completed) {
      e->completed = gen;
      e->when = std::chrono::steady_clock::now();
    }
    e->cv.notify_all();
  }, "cudaEventRecord");
  return 0;
}
int cudaEventQuery(void* event) {
  auto e = event_of(event, "cudaEventQuery");
  std::lock_guard<std::mutex> lock(e->mu);
  return e->completed >= e->recorded ? 0 : 600;
}
int cudaEventElapsedTime(float* ms, void* start, void* end) {
  auto a = event_of(start, "cudaEventElapsedTime"), b = event_of(end, "cudaEventElapsedTime");
  std::scoped_lock lock(a->mu, b->mu);
  if (!a->timing || !b->timing) return 6;                                     // cudaErrorInvalidResourceHandle
  if (!a->recorded || !b->recorded) return 400;                               // cudaErrorInvalidResourceHandle
  if (a->completed < a->recorded || b->completed < b->recorded) return 600;  // cudaErrorNotReady
  *ms = std::chrono::duration<float, std::milli>(b->when - a->when).count();
  return 0;
}
int cudaEventDestroy(void* event) {
  std::lock_guard<std::mutex> lock(g_handles_mu);
  if (!g_events.erase(event)) misuse("%s on event %p, which is not a live event (destroyed twice?)", event, "cudaEventDestroy");
  return 0;  // a recording still queued keeps its own reference
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
  *v = !no_driver() ? 13000 : std::string(no_driver()) == "old" ? 12020 : 0;
  return 0;
}
int cudaRuntimeGetVersion(int* v) {
  *v = 13000;
  return 0;
}
int cudaGetLastError() { return 0; }
const char* cudaGetErrorName(int e) {
  return e == 0 ? "cudaSuccess" : e == 600 ? "cudaErrorNotReady" : e == 35 ? "cudaErrorInsufficientDriver" : "cudaErrorFake";
}
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
}  // extern "C"
namespace {
// Frees the handle: any later call with it aborts the test (see comm_of).
int abort_comm(void* comm_ptr, const char* what) {
  auto comm = comm_of(comm_ptr, what);
  {
    std::lock_guard<std::mutex> lock(comm->clique->mu);
    comm->clique->aborted = true;
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
// Peers of an aborted clique would wait forever: destroy is treated like abort for the waiting ones.
int ncclCommDestroy(void* comm_ptr) { return abort_comm(comm_ptr, "ncclCommDestroy"); }
int ncclCommGetAsyncError(void* comm_ptr, int* error) {
  auto comm = comm_of(comm_ptr, "ncclCommGetAsyncError");
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
  if (!comm_ptr) return "";
  auto comm = comm_of(comm_ptr, "ncclGetLastError");
  static thread_local std::string last;
  std::lock_guard<std::mutex> lock(comm->clique->mu);
  last = comm->clique->last_error;
  return last.c_str();
}
int ncclAllReduce(const void* s, void* r, size_t n, int t, int op, void* comm, void* stream) {
  return queue_collective(comm, stream, {0, s, r, n, t, op, -1}, "ncclAllReduce");
}
int ncclBroadcast(const void* s, void* r, size_t n, int t, int root, void* comm, void* stream) {
  return queue_collective(comm, stream, {1, s, r, n, t, -1, root}, "ncclBroadcast");
}
int ncclReduce(const void* s, void* r, size_t n, int t, int op, int root, void* comm, void* stream) {
  return queue_collective(comm, stream, {2, s, r, n, t, op, root}, "ncclReduce");
}
int ncclAllGather(const void* s, void* r, size_t n, int t, void* comm, void* stream) {
  return queue_collective(comm, stream, {3, s, r, n, t, -1, -1}, "ncclAllGather");
}
int ncclReduceScatter(const void* s, void* r, size_t n, int t, int op, void* comm, void* stream) {
  return queue_collective(comm, stream, {4, s, r, n, t, op, -1}, "ncclReduceScatter");
}
int ncclSend(const void* buf, size_t n, int t, int peer, void* comm_ptr, void* stream) {
  auto comm = comm_of(comm_ptr, "ncclSend");
  const size_t bytes = n * dtype_size(t);
  enqueue(stream, [comm, buf, bytes, peer] {
    auto& c = *comm->clique;
    std::vector<char> msg(static_cast<const char*>(buf), static_cast<const char*>(buf) + bytes);
    std::lock_guard<std::mutex> lock(c.mu);
    c.mailbox[{comm->rank, peer}].push_back(std::move(msg));
    c.cv.notify_all();
  }, "ncclSend");
  return 0;
}
int ncclRecv(void* buf, size_t n, int t, int peer, void* comm_ptr, void* stream) {
  auto comm = comm_of(comm_ptr, "ncclRecv");
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
  }, "ncclRecv");
  return 0;
}
int ncclGroupStart() { return 0; }
int ncclGroupEnd() { return 0; }

}  // extern "C"
