// The rest of cohort/gpu.h: making a device communicator, what it chose, device memory, the calling
// thread's streams, timing markers, and copies that work on either side of the host/device line.
#include <fmt/core.h>

#include <cstring>
#include <thread>

#include "common/env.h"
#include "cohort/error.h"
#include "common/deadline.h"
#include "common/log.h"
#include "gpu/device_communicator.h"

namespace cohort::gpu {

using impl::DeviceCommunicator;
using impl::DeviceGuard;
using impl::DeviceWork;
using Millis = std::chrono::milliseconds;

namespace {

const env::StringSetting kGpuPath("COHORT_GPU_PATH", "auto",
                                  "GPU buffers: auto (NCCL when every rank has its own GPU and NCCL), nccl, or staged "
                                  "(copied through host memory and cohort's CPU collectives)");

}  // namespace

std::shared_ptr<Communicator> make_device_communicator(std::shared_ptr<Communicator> host, DeviceOptions options) {
  if (!host) throw InvalidArgument("make_device_communicator: host communicator is null");
  Status s = status();
  if (!s.usable()) throw ConfigError(fmt::format("rank {}: GPU communicator: {}", host->rank(), s.why_no_gpu));
  const std::string path_text = kGpuPath.get();
  if (path_text == "nccl") options.path = DevicePath::kNccl;
  else if (path_text == "staged") options.path = DevicePath::kStaged;
  else if (path_text != "auto")
    throw ConfigError(fmt::format("COHORT_GPU_PATH={}: expected auto, nccl or staged", path_text));
  const int device = options.device >= 0 ? options.device : local_device();
  if (device >= s.devices)
    throw ConfigError(fmt::format("rank {}: GPU {} asked for, but this process sees {}", host->rank(), device, s.devices));
  auto comm = std::make_shared<DeviceCommunicator>(std::move(host), device);
  comm->init(options.path);
  return comm;
}

std::string device_path_of(const Communicator& comm) {
  auto* d = dynamic_cast<const DeviceCommunicator*>(&comm);
  if (!d) return "host (not a GPU communicator)";
  return d->path_name() + ": " + d->why();
}

int device_of(const Communicator& comm) {
  auto* d = dynamic_cast<const DeviceCommunicator*>(&comm);
  return d ? d->device() : -1;
}

std::shared_ptr<void> allocate_device(size_t bytes, int device) {
  DeviceGuard guard(device);
  void* p = nullptr;
  check_cuda(cuda().Malloc(&p, std::max<size_t>(bytes, 1)), fmt::format("cudaMalloc of {} bytes on GPU {}", bytes, device));
  return std::shared_ptr<void>(p, [](void* q) { cuda().Free(q); });
}

namespace {

// The GPU a pointer's memory is on; -1 for host memory.
int device_of_pointer(const void* ptr) {
  CudaPointerAttributes a;
  if (!ptr || cuda().PointerGetAttributes(&a, ptr) != kCudaSuccess) {
    cuda().GetLastError();
    return -1;
  }
  return a.type == kCudaMemoryDevice || a.type == kCudaMemoryManaged ? a.device : -1;
}

int device_of_either(const void* a, const void* b) {
  int d = device_of_pointer(a);
  return d >= 0 ? d : device_of_pointer(b);
}

// The calling thread's StreamGuard choices, per device.
thread_local std::vector<std::pair<int, void*>> t_streams;
std::atomic<StreamProvider> g_stream_provider{nullptr};

}  // namespace

void* current_stream(int device) {
  for (auto it = t_streams.rbegin(); it != t_streams.rend(); ++it)
    if (it->first == device) return it->second;
  if (StreamProvider p = g_stream_provider.load()) return p(device);
  return nullptr;
}

void set_stream_provider(StreamProvider provider) { g_stream_provider.store(provider); }

StreamGuard::StreamGuard(int device, void* stream) : device_(device) {
  t_streams.emplace_back(device, stream);
}
StreamGuard::~StreamGuard() {
  for (auto it = t_streams.rbegin(); it != t_streams.rend(); ++it) {
    if (it->first == device_) {
      t_streams.erase(std::next(it).base());
      break;
    }
  }
}

void synchronize(Communicator& comm) {
  if (auto* d = dynamic_cast<DeviceCommunicator*>(&comm)) d->synchronize_all();
}

void enable_timing(Communicator& comm) {
  if (auto* d = dynamic_cast<DeviceCommunicator*>(&comm)) d->enable_timing();
}

bool timing_enabled(const Communicator& comm) {
  auto* d = dynamic_cast<const DeviceCommunicator*>(&comm);
  return d && d->timing();
}

std::shared_ptr<void> record_marker(int device) {
  if (!cuda_runtime().api) return nullptr;
  DeviceGuard guard(device);
  void* event = nullptr;
  check_cuda(cuda().EventCreateWithFlags(&event, kCudaEventDefault), "cudaEventCreateWithFlags");
  std::shared_ptr<void> marker(event, [](void* e) { cuda().EventDestroy(e); });
  check_cuda(cuda().EventRecord(event, current_stream(device)), "cudaEventRecord");
  return marker;
}

bool marker_reached(const std::shared_ptr<void>& marker, Millis wait) {
  if (!marker) return false;
  const Deadline deadline = Deadline::after(wait);
  for (;;) {
    const int rc = cuda().EventQuery(marker.get());
    if (rc == kCudaSuccess) return true;
    if (rc != kCudaErrorNotReady) {
      cuda().GetLastError();
      return false;
    }
    if (deadline.expired()) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

std::optional<GpuInterval> work_interval(Work& work, const std::shared_ptr<void>& marker) {
  auto* w = dynamic_cast<DeviceWork*>(&work);
  if (!w || !marker) return std::nullopt;
  return w->interval(marker.get());
}

void copy_memory(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  const int device = device_of_either(dst, src);
  if (device < 0) {
    std::memcpy(dst, src, bytes);
    return;
  }
  DeviceGuard guard(device);
  void* stream = current_stream(device);
  check_cuda(cuda().MemcpyAsync(dst, src, bytes, kCudaMemcpyDefault, stream), fmt::format("cudaMemcpyAsync of {} bytes", bytes));
  check_cuda(cuda().StreamSynchronize(stream), fmt::format("cudaStreamSynchronize after a copy of {} bytes", bytes));
}

void zero_memory(void* ptr, size_t bytes) {
  if (bytes == 0) return;
  const int device = std::max(device_of_pointer(ptr), 0);
  DeviceGuard guard(device);
  void* stream = current_stream(device);
  check_cuda(cuda().MemsetAsync(ptr, 0, bytes, stream), fmt::format("cudaMemsetAsync of {} bytes", bytes));
  check_cuda(cuda().StreamSynchronize(stream), "cudaStreamSynchronize");
}

void copy_memory_async(void* dst, const void* src, size_t bytes, int device) {
  if (bytes == 0) return;
  DeviceGuard guard(device);
  check_cuda(cuda().MemcpyAsync(dst, src, bytes, kCudaMemcpyDefault, current_stream(device)),
             fmt::format("cudaMemcpyAsync of {} bytes", bytes));
}

void zero_memory_async(void* ptr, size_t bytes, int device) {
  if (bytes == 0) return;
  DeviceGuard guard(device);
  check_cuda(cuda().MemsetAsync(ptr, 0, bytes, current_stream(device)), fmt::format("cudaMemsetAsync of {} bytes", bytes));
}

bool is_device_pointer(const void* ptr) {
  const auto& rt = cuda_runtime();
  if (!rt.api || !ptr) return false;
  CudaPointerAttributes a;
  if (rt.api->PointerGetAttributes(&a, ptr) != kCudaSuccess) {
    rt.api->GetLastError();
    return false;
  }
  return a.type == kCudaMemoryDevice || a.type == kCudaMemoryManaged;
}

}  // namespace cohort::gpu
