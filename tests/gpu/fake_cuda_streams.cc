// The fake CUDA runtime's streams and events (fake_cuda.cc says what the fake is): each stream is a
// thread that runs its queued work in order, with the legacy default stream's implicit
// synchronisation; an event completes when its recording runs on its stream, and
// cudaStreamWaitEvent really orders. Host functions (cudaLaunchHostFunc) are the tests' "kernels".
#include <future>
#include <utility>
#include <vector>

#include "fake_cuda_internal.h"

namespace fake_cuda {

std::mutex g_handles_mu;
std::map<void*, std::shared_ptr<Stream>> g_streams;
std::map<int, std::shared_ptr<Stream>> g_legacy;
std::mutex g_order_mu;
std::map<void*, std::shared_ptr<Event>> g_events;

namespace {
// cudaStreamLegacy and cudaStreamPerThread, as cuda_runtime_api.h defines them.
void* const kStreamLegacy = reinterpret_cast<void*>(0x1);
void* const kStreamPerThread = reinterpret_cast<void*>(0x2);
}  // namespace

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

void enqueue(void* stream, Task t, const char* what) {
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

std::shared_ptr<Event> event_of(void* h, const char* what) {
  std::lock_guard<std::mutex> lock(g_handles_mu);
  auto it = g_events.find(h);
  if (it == g_events.end()) misuse("%s on event %p, which is not a live event (destroyed?)", h, what);
  return it->second;
}

}  // namespace fake_cuda

using namespace fake_cuda;

extern "C" {

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

}  // extern "C"
