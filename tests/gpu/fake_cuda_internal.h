#pragma once
// What the parts of libcohort_fake_cuda.so share (fake_cuda.cc says what the fake is): the current
// device, the stream threads that run every queued operation (copies, events, "kernels" and NCCL's
// work alike), the events, the registry of live handles, and device memory's readable alias. The
// NCCL half (fake_nccl_internal.h) queues its work on these same streams.
//
// Hidden from the library's exports: only the CUDA and NCCL C functions (extern "C") are the fake's
// interface; these are its insides.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#pragma GCC visibility push(hidden)
namespace fake_cuda {

using Task = std::function<void()>;

// Aborts the process with "fake CUDA/NCCL: " + fmt (which names `what`, then `handle`): a misuse that
// real CUDA or NCCL would punish later and worse (a use after free, a forbidden call).
[[noreturn]] void misuse(const char* fmt, const void* handle, const char* what);

int device_count();          // FAKE_CUDA_DEVICES, default 8
extern thread_local int t_device;  // cudaSetDevice's, per thread as in CUDA

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
// use after free would, at best, crash. One lock for every registry (streams, events, communicators).
extern std::mutex g_handles_mu;
extern std::map<void*, std::shared_ptr<Stream>> g_streams;
extern std::map<int, std::shared_ptr<Stream>> g_legacy;  // per device, made on first use

// The stream a handle names: null, cudaStreamLegacy and cudaStreamPerThread are the current device's
// legacy default stream.
std::shared_ptr<Stream> stream_of(void* h, const char* what);

// Serialises enqueueing, so that "queued before" is one order across streams.
extern std::mutex g_order_mu;

// Queues `t` on `stream` with CUDA's implicit synchronisation of the legacy default stream: work on
// it waits for all work queued earlier on the device's blocking streams, and work on a blocking
// stream waits for work queued earlier on the legacy stream. Non-blocking streams do neither.
void enqueue(void* stream, Task t, const char* what = "enqueue");

struct Event {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;   // cudaEventRecord calls
  uint64_t completed = 0;  // of those, the latest that has run on its stream
  bool timing = true;
  std::chrono::steady_clock::time_point when{};
};

extern std::map<void*, std::shared_ptr<Event>> g_events;  // under g_handles_mu
std::shared_ptr<Event> event_of(void* h, const char* what);

// ---- memory (fake_cuda_memory.cc) ----
// Where the fake itself reads or writes `p`: the readable alias for device memory, `p` otherwise.
void* view(const void* p);

}  // namespace fake_cuda
#pragma GCC visibility pop
