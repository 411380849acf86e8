// libcohort_fake_cuda.so: a TEST DOUBLE of the CUDA runtime and NCCL C APIs, for machines without a
// GPU (CI). It exports the functions src/gpu/runtime.h loads, with the same signatures, so that
// cohort's GPU code runs unchanged with ranks as threads in one process. It is strict where real CUDA
// and NCCL are, so that code which would misbehave on a GPU fails here:
//
// - "device memory" is remembered with its device so that cudaPointerGetAttributes tells device from
//   host pointers as the real runtime does, and it is mapped PROT_NONE at the address the program
//   gets: host code that touches it crashes, as it would on a GPU. Copies, collectives and "kernels"
//   reach it through a second mapping (fake_cuda_kernel_view, for tests' kernels);
// - each stream is a thread that runs its queued work in order (copies, events, NCCL operations,
//   "kernels" from cudaLaunchHostFunc), so enqueueing returns at once and completion is observed
//   through events, as on a GPU. The legacy default stream (null, cudaStreamLegacy) is a stream of
//   its own per device, with CUDA's implicit synchronisation: its work waits for work queued earlier
//   on the device's blocking streams, and theirs for its; streams made with cudaStreamNonBlocking
//   take no part. cudaMemcpy runs on it and returns when done;
// - cudaStreamWaitEvent really orders: later work on the stream waits for the event's latest
//   recording; timing events carry the time they ran (cudaEventElapsedTime);
// - NCCL communicators of one unique id form a clique; a collective waits on its stream thread until
//   every rank has queued the same operation, computes, and reports a mismatch through
//   ncclCommGetAsyncError. A receive waits for its message; a send above FAKE_NCCL_EAGER_BYTES
//   (default 64 KiB) waits until its receive has taken it, as NCCL's p2p does, so an ungrouped
//   send-then-receive exchange deadlocks here as on a GPU. ncclGroupStart/End really group: the
//   group's calls progress together;
// - ncclCommAbort ends only this rank's work; peers are told nothing and wait for their own deadline
//   (real NCCL promises nothing more). Only a peer's exited process (fake_nccl_exit) is reported to
//   the others, as ncclRemoteError;
// - ncclCommInitRankConfig with blocking = 0 makes a non-blocking communicator: set-up, collectives
//   and ncclGroupEnd return ncclInProgress and finish on a thread of their own (ncclCommGetAsyncError
//   says when), and any call but that query and the abort while one is in progress aborts the
//   process. FAKE_NCCL_VERSION below 21400 stands for an NCCL without it;
// - test hooks (extern "C", at the end): a call that hangs (fake_nccl_stall), a slow set-up
//   (fake_nccl_delay_init), a slow abort (fake_nccl_slow_abort), the number of live communicators, a peer's process exit;
// - a communicator, stream or event used after it was aborted, destroyed or never made aborts the
//   process with a message naming the call (a real use after free crashes, or worse, later).
//
// FAKE_CUDA_DEVICES sets the number of devices (default 8). Only the dtypes int8, uint8, int32,
// int64, float32 and float64 are reduced (others: ncclInvalidArgument); it is enough to test
// cohort's routing, staging, stream order, bootstrap, waits and error paths, not NCCL.
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
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
// Device memory is two mappings of one memfd: the address the program gets is PROT_NONE, so host
// code that reads or writes "GPU memory" directly crashes here as it would on a GPU (where the
// address is not host memory at all); the fake's own copies, memsets, collectives and kernels reach
// the bytes through the second, readable mapping (`view`). Pinned host memory is ordinary memory.
struct Allocation {
  size_t bytes;
  int device;
  int type;           // 1 host (pinned), 2 device
  char* view;         // device memory: the readable alias of the same pages; host: the memory itself
  size_t mapped = 0;  // device memory: the length of both mappings
};
std::mutex g_mem_mu;
std::map<uintptr_t, Allocation> g_allocations;

void* remember(size_t bytes, int device, int type) {
  if (type != 2) {
    void* p = std::calloc(1, bytes ? bytes : 1);
    std::lock_guard<std::mutex> lock(g_mem_mu);
    g_allocations[reinterpret_cast<uintptr_t>(p)] = {bytes, device, type, static_cast<char*>(p)};
    return p;
  }
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t mapped = ((bytes ? bytes : 1) + page - 1) / page * page;
  const int fd = static_cast<int>(syscall(SYS_memfd_create, "fake-cuda-device-memory", 0));
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(mapped)) != 0) {
    std::perror("fake CUDA: memfd for device memory");
    std::abort();
  }
  void* device_address = mmap(nullptr, mapped, PROT_NONE, MAP_SHARED, fd, 0);
  void* view = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (device_address == MAP_FAILED || view == MAP_FAILED) {
    std::perror("fake CUDA: mmap of device memory");
    std::abort();
  }
  std::lock_guard<std::mutex> lock(g_mem_mu);
  g_allocations[reinterpret_cast<uintptr_t>(device_address)] = {bytes, device, type, static_cast<char*>(view), mapped};
  return device_address;
}
void forget(void* p) {
  Allocation a{};
  {
    std::lock_guard<std::mutex> lock(g_mem_mu);
    auto it = g_allocations.find(reinterpret_cast<uintptr_t>(p));
    if (it == g_allocations.end()) return std::free(p);
    a = it->second;
    g_allocations.erase(it);
  }
  if (a.type != 2) return std::free(p);
  munmap(p, a.mapped);
  munmap(a.view, a.mapped);
}

// Where the fake itself reads or writes `p`: the readable alias for device memory, `p` otherwise.
void* view(const void* p) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(g_mem_mu);
  auto it = g_allocations.upper_bound(u);
  if (it == g_allocations.begin()) return const_cast<void*>(p);
  --it;
  if (it->second.type != 2 || u >= it->first + it->second.mapped) return const_cast<void*>(p);
  return it->second.view + (u - it->first);
}

// ---- NCCL cliques ----
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

size_t eager_bytes() {
  const char* v = std::getenv("FAKE_NCCL_EAGER_BYTES");
  return v ? static_cast<size_t>(std::strtoull(v, nullptr, 10)) : 64 * 1024;
}

struct Contribution {
  int kind;  // 0 allreduce, 1 broadcast, 2 reduce, 3 allgather, 4 reduce_scatter
  const void* send;  // the fake's views (device memory's readable alias)
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
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<Message>>> mailbox;  // (from, to) -> messages
  std::set<int> exited;  // ranks whose process exited (fake_nccl_exit): their connections are closed
  std::string last_error;
};

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

// NCCL: on a non-blocking communicator, no call may follow one that returned ncclInProgress until
// ncclCommGetAsyncError no longer says ncclInProgress (only that query, ncclGetLastError and the abort).
void check_not_in_progress(const std::shared_ptr<Comm>& comm, const char* what) {
  std::lock_guard<std::mutex> lock(comm->clique->mu);
  if (comm->in_progress > 0)
    misuse("%s on non-blocking communicator %p while its previous call is still in progress "
           "(ncclCommGetAsyncError said ncclInProgress): NCCL forbids it",
           comm.get(), what);
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

// A peer's process exited (fake_nccl_exit): NCCL's socket transport sees the connection close and
// reports a remote error. Nothing like this happens for a peer that is alive but stopped calling, or
// that aborted its communicator: its peers wait until their own deadline, as with real NCCL.
void peer_exited(const std::shared_ptr<Comm>& comm, int peer) {
  comm->error = kRemoteError;
  comm->clique->last_error = "rank " + std::to_string(peer) + "'s process exited (its connections closed)";
}
int any_exited(const Clique& c) { return c.exited.empty() ? -1 : *c.exited.begin(); }

// Runs on rank `me`'s stream thread: waits for all ranks' collective number `seq`, computes this
// rank's output into a temporary, waits until everybody has read the inputs, then writes it. Ends
// early when this rank's communicator is aborted (results unwritten) or a rank's process exited.
void run_collective(const std::shared_ptr<Comm>& comm, uint64_t seq, Contribution mine) {
  auto& c = *comm->clique;
  std::unique_lock<std::mutex> lock(c.mu);
  auto& slot = c.slots[seq];
  if (slot.empty()) slot.resize(static_cast<size_t>(c.n));
  slot[static_cast<size_t>(comm->rank)] = mine;
  ++c.arrived[seq];
  c.cv.notify_all();
  c.cv.wait(lock, [&] { return comm->aborted || c.arrived[seq] == c.n || any_exited(c) >= 0; });
  if (comm->aborted) return;
  if (c.arrived[seq] != c.n) return peer_exited(comm, any_exited(c));
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
  c.cv.wait(lock, [&] { return comm->aborted || c.finished[seq] == c.n || any_exited(c) >= 0; });
  if (comm->aborted) return;
  if (c.finished[seq] != c.n) return peer_exited(comm, any_exited(c));
  if (!out.empty()) std::memcpy(mine.recv, out.data(), out.size());
}

// One NCCL call as it runs on the GPU, in three steps, so that the calls of one group progress
// together as NCCL's grouped kernels do: `post` (sends put their message out; never waits), `run`
// (receives and collectives, in call order), `finish` (sends above the eager size wait for their
// receive). An ungrouped call is a group of one: an ungrouped large send waits for its receive
// before the next call on its stream starts, which is why a send-then-recv exchange must be grouped.
struct Step {
  Step(std::shared_ptr<Comm> c, void* s) : comm(std::move(c)), stream(s) {}
  std::shared_ptr<Comm> comm;
  void* stream;
  std::function<void()> post, run, finish;
};
thread_local int t_group_depth = 0;
thread_local std::vector<Step> t_group;

// Queues the steps: one task per stream (in call order), with CUDA's stream semantics.
void enqueue_steps(const std::vector<Step>& steps, int device) {
  std::vector<void*> streams;
  for (const auto& s : steps)
    if (std::find(streams.begin(), streams.end(), s.stream) == streams.end()) streams.push_back(s.stream);
  const int saved = t_device;
  t_device = device;  // the legacy stream named by a null stream is the caller's device's
  for (void* stream : streams) {
    std::vector<Step> mine;
    for (const auto& s : steps)
      if (s.stream == stream) mine.push_back(s);
    enqueue(stream, [mine] {
      for (const auto& s : mine) if (s.post) s.post();
      for (const auto& s : mine) if (s.run) s.run();
      for (const auto& s : mine) if (s.finish) s.finish();
    }, "an NCCL group");
  }
  t_device = saved;
}

// fake_nccl_stall: the next call of that function on that device hangs, as a lazy connection to a
// peer that never answers does. Blocking communicator: the call does not return until the
// communicator is aborted (then ncclSystemError) or, so that a broken test cannot hang CI, 20 s
// have passed (ncclSystemError too; fake_nccl_stalls_ended_by_abort tells the two apart).
// Non-blocking: the call returns ncclInProgress, and the communicator stays in progress until aborted.
std::mutex g_stall_mu;
std::map<std::pair<int, std::string>, int> g_stalls;  // (device, function) -> calls still to stall
std::atomic<int> g_stalls_ended_by_abort{0};

bool take_stall(int device, const char* what) {
  std::lock_guard<std::mutex> lock(g_stall_mu);
  auto it = g_stalls.find({device, what});
  if (it == g_stalls.end() || it->second == 0) return false;
  --it->second;
  return true;
}

int stall(const std::shared_ptr<Comm>& comm) {
  auto& c = *comm->clique;
  std::unique_lock<std::mutex> lock(c.mu);
  if (!comm->blocking) {
    ++comm->in_progress;  // never finished: only ncclCommAbort ends it
    return kInProgress;
  }
  if (c.cv.wait_for(lock, std::chrono::seconds(20), [&] { return comm->aborted; })) ++g_stalls_ended_by_abort;
  c.last_error = "a stalled call (fake_nccl_stall) ended";
  return kSystemError;
}

// A non-blocking communicator's call: NCCL returns ncclInProgress and finishes the call (connects,
// queues the kernels) on its own thread; only then does ncclCommGetAsyncError say ncclSuccess. Work
// the caller queues on the stream before that runs before the NCCL kernels, as on a GPU.
int finish_later(std::vector<Step> steps, int device) {
  std::vector<std::shared_ptr<Comm>> comms;
  for (const auto& s : steps)
    if (std::find(comms.begin(), comms.end(), s.comm) == comms.end()) comms.push_back(s.comm);
  for (const auto& comm : comms) {
    std::lock_guard<std::mutex> lock(comm->clique->mu);
    ++comm->in_progress;
  }
  std::thread([steps = std::move(steps), comms, device] {
    std::this_thread::sleep_for(std::chrono::microseconds(300));
    enqueue_steps(steps, device);
    for (const auto& comm : comms) {
      std::lock_guard<std::mutex> lock(comm->clique->mu);
      --comm->in_progress;
      comm->clique->cv.notify_all();
    }
  }).detach();
  return kInProgress;
}

// Every NCCL operation goes through here: the stall hook, the group, or the stream.
int submit(Step step, const char* what) {
  check_not_in_progress(step.comm, what);
  if (take_stall(step.comm->device, what)) return stall(step.comm);
  if (t_group_depth > 0) {
    t_group.push_back(std::move(step));
    return kSuccess;
  }
  const int device = t_device;
  if (!step.comm->blocking) return finish_later({std::move(step)}, device);
  enqueue_steps({std::move(step)}, device);
  return kSuccess;
}

int queue_collective(void* comm_ptr, void* stream, Contribution c, const char* what) {
  auto comm = comm_of(comm_ptr, what);
  if ((c.kind == 0 || c.kind == 2 || c.kind == 4) && !reducible(c.dtype)) return kInvalidArgument;
  c.send = view(c.send);
  c.recv = view(c.recv);
  const uint64_t seq = comm->next_collective++;
  Step step(comm, stream);
  step.run = [comm, seq, c] { run_collective(comm, seq, c); };
  return submit(std::move(step), what);
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
  void* to = view(dst);
  const void* from = view(src);
  enqueue(nullptr, [=] {
    std::memcpy(to, from, bytes);
    done->set_value();
  }, "cudaMemcpy");
  f.wait();
  return 0;
}
int cudaMemcpyAsync(void* dst, const void* src, size_t bytes, int, void* stream) {
  void* to = view(dst);
  const void* from = view(src);
  enqueue(stream, [=] { std::memcpy(to, from, bytes); }, "cudaMemcpyAsync");
  return 0;
}
int cudaMemsetAsync(void* dst, int value, size_t bytes, void* stream) {
  void* to = view(dst);
  enqueue(stream, [=] { std::memset(to, value, bytes); }, "cudaMemsetAsync");
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
std::atomic<int> g_init_delay_ms{0};  // fake_nccl_delay_init

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
std::atomic<int> g_abort_delay_ms{0};  // fake_nccl_slow_abort

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
  auto msg = std::make_shared<Message>();
  const char* from = static_cast<const char*>(view(buf));
  Step step(comm, stream);
  step.post = [comm, msg, from, bytes, peer] {
    msg->bytes.assign(from, from + bytes);
    auto& c = *comm->clique;
    std::lock_guard<std::mutex> lock(c.mu);
    c.mailbox[{comm->rank, peer}].push_back(msg);
    c.cv.notify_all();
  };
  if (bytes > eager_bytes()) {
    step.finish = [comm, msg, peer] {
      auto& c = *comm->clique;
      std::unique_lock<std::mutex> lock(c.mu);
      c.cv.wait(lock, [&] { return comm->aborted || msg->taken || c.exited.count(peer); });
      if (!comm->aborted && !msg->taken) peer_exited(comm, peer);
    };
  }
  return submit(std::move(step), "ncclSend");
}
int ncclRecv(void* buf, size_t n, int t, int peer, void* comm_ptr, void* stream) {
  auto comm = comm_of(comm_ptr, "ncclRecv");
  const size_t bytes = n * dtype_size(t);
  char* to = static_cast<char*>(view(buf));
  Step step(comm, stream);
  step.run = [comm, to, bytes, peer] {
    auto& c = *comm->clique;
    std::unique_lock<std::mutex> lock(c.mu);
    auto& q = c.mailbox[{peer, comm->rank}];
    c.cv.wait(lock, [&] { return comm->aborted || !q.empty() || c.exited.count(peer); });
    if (comm->aborted) return;
    if (q.empty()) return peer_exited(comm, peer);
    auto msg = q.front();
    q.pop_front();
    if (msg->bytes.size() != bytes) {
      comm->error = kInvalidUsage;
      c.last_error = "message size differs from the receive's";
    } else {
      std::memcpy(to, msg->bytes.data(), bytes);
    }
    msg->taken = true;
    c.cv.notify_all();
  };
  return submit(std::move(step), "ncclRecv");
}
int ncclGroupStart() {
  ++t_group_depth;
  return 0;
}
// The group's calls start together: on a blocking communicator they are queued now; on a
// non-blocking one NCCL finishes the group on its own thread (ncclInProgress until then).
int ncclGroupEnd() {
  if (t_group_depth == 0) return kInvalidUsage;
  if (--t_group_depth > 0) return kSuccess;
  std::vector<Step> steps = std::move(t_group);
  t_group.clear();
  if (steps.empty()) return kSuccess;
  for (const auto& s : steps)
    if (take_stall(s.comm->device, "ncclGroupEnd")) return stall(s.comm);
  const bool blocking = std::all_of(steps.begin(), steps.end(), [](const Step& s) { return s.comm->blocking; });
  if (!blocking) return finish_later(std::move(steps), t_device);
  enqueue_steps(steps, t_device);
  return kSuccess;
}

// ---- test hooks (not CUDA or NCCL functions) ----
// The next `count` calls of `function` ("ncclAllReduce", "ncclSend", "ncclGroupEnd", ...) on a
// communicator of `device` hang (see stall()).
void fake_nccl_stall(int device, const char* function, int count) {
  std::lock_guard<std::mutex> lock(g_stall_mu);
  g_stalls[{device, function}] = count;
}
int fake_nccl_stalls_ended_by_abort() { return g_stalls_ended_by_abort.load(); }
// ncclCommAbort calls from now on take `ms` before they act and return, as a real abort does while
// the GPU is busy with work queued before the aborted collective (it frees device memory).
void fake_nccl_slow_abort(int ms) { g_abort_delay_ms = ms; }
// Communicators whose set-up ends from now on take `ms` longer after every rank has joined.
void fake_nccl_delay_init(int ms) { g_init_delay_ms = ms; }
// NCCL communicators alive (made, neither aborted nor destroyed): a leak shows here.
int fake_nccl_live_comms() {
  std::lock_guard<std::mutex> g(g_handles_mu);
  return static_cast<int>(g_comms.size());
}
// The process of the rank whose communicators live on `device` exits: every peer's operation that
// needs it fails with ncclRemoteError, as NCCL's socket transport reports a closed connection. Its
// own pending work ends; its handles stay valid (a test's thread still destroys them).
void fake_nccl_exit(int device) {
  std::vector<std::shared_ptr<Comm>> comms;
  {
    std::lock_guard<std::mutex> g(g_handles_mu);
    for (auto& [h, comm] : g_comms)
      if (comm->device == device) comms.push_back(comm);
  }
  for (const auto& comm : comms) {
    {
      std::lock_guard<std::mutex> lock(comm->clique->mu);
      comm->clique->exited.insert(comm->rank);
      comm->aborted = true;
    }
    comm->clique->cv.notify_all();
  }
}
// The bytes of device memory as a fake "kernel" (cudaLaunchHostFunc) sees them: the program's own
// pointer is not readable from the host.
void* fake_cuda_kernel_view(const void* device_pointer) { return view(device_pointer); }

}  // extern "C"
