// The fake CUDA runtime's memory (fake_cuda.cc says what the fake is): device memory that host code
// cannot touch, pinned host memory, the copies and memsets that run on streams, and the pointer
// attributes that tell one from the other.
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <vector>

#include "fake_cuda_internal.h"

namespace fake_cuda {
namespace {

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

}  // namespace

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

}  // namespace fake_cuda

using namespace fake_cuda;

extern "C" {

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

}  // extern "C"
