#include "gpu/runtime.h"

#include <dlfcn.h>
#include <fmt/core.h>

#include <cstdlib>
#include <mutex>
#include <vector>

#include "cohort/error.h"
#include "common/env.h"
#include "common/strings.h"

namespace cohort::gpu {
namespace {

const env::StringSetting kCudaRuntimePath("COHORT_CUDA_RUNTIME", "",
                                          "path of libcudart.so to load for GPU buffers (default: searched)");
const env::StringSetting kNcclPath("COHORT_NCCL_LIBRARY", "", "path of libnccl.so to load (default: searched)");

// Folders tried after the loader's own search.
std::vector<std::string> library_dirs() {
  std::vector<std::string> dirs;
  if (const char* home = std::getenv("CUDA_HOME"); home && *home) dirs.push_back(std::string(home) + "/lib64");
  if (const char* home = std::getenv("CUDA_PATH"); home && *home) dirs.push_back(std::string(home) + "/lib64");
  dirs.push_back("/usr/local/cuda/lib64");
#ifdef COHORT_CUDA_LIB_DIR
  dirs.push_back(COHORT_CUDA_LIB_DIR);  // where CMake found CUDA when cohort was built
#endif
  return dirs;
}

// dlopen of the first name that loads: an explicit path alone, else each name already loaded,
// then each name through the loader, then each name in each folder.
void* open_first(const std::string& explicit_path, const std::vector<std::string>& names, std::string& path,
                 std::string& why_not) {
  std::vector<std::string> failures;
  auto try_open = [&](const std::string& candidate, int flags) -> void* {
    dlerror();
    void* h = dlopen(candidate.c_str(), flags);
    if (h) {
      path = candidate;
      return h;
    }
    if (!(flags & RTLD_NOLOAD)) {
      const char* e = dlerror();
      failures.push_back(e ? e : candidate + ": not loadable");
    }
    return nullptr;
  };
  if (!explicit_path.empty()) {
    if (void* h = try_open(explicit_path, RTLD_NOW | RTLD_LOCAL)) return h;
    why_not = failures.empty() ? explicit_path + ": not loadable" : failures.back();
    return nullptr;
  }
  for (const auto& n : names)
    if (void* h = try_open(n, RTLD_NOW | RTLD_NOLOAD)) return h;
  for (const auto& n : names)
    if (void* h = try_open(n, RTLD_NOW | RTLD_LOCAL)) return h;
  std::vector<std::string> tried_dirs;
  for (const auto& d : library_dirs()) {
    tried_dirs.push_back(d);
    for (const auto& n : names)
      if (void* h = try_open(d + "/" + n, RTLD_NOW | RTLD_LOCAL)) return h;
  }
  why_not = fmt::format("tried {} on the loader's path and in {}", str::join(names, ", "), str::join(tried_dirs, ", "));
  return nullptr;
}

template <typename F>
bool bind(void* handle, const char* symbol, F& slot, std::vector<std::string>& missing, bool optional = false) {
  slot = reinterpret_cast<F>(dlsym(handle, symbol));
  if (!slot && !optional) missing.push_back(symbol);
  return slot != nullptr;
}

Loaded<CudaApi> load_cuda() {
  Loaded<CudaApi> out;
  static CudaApi api{};
  void* h = open_first(kCudaRuntimePath.get(),
                       {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"}, out.path,
                       out.why_not);
  if (!h) return out;
  std::vector<std::string> missing;
  bind(h, "cudaGetDeviceCount", api.GetDeviceCount, missing);
  bind(h, "cudaSetDevice", api.SetDevice, missing);
  bind(h, "cudaGetDevice", api.GetDevice, missing);
  bind(h, "cudaMalloc", api.Malloc, missing);
  bind(h, "cudaFree", api.Free, missing);
  bind(h, "cudaMallocHost", api.MallocHost, missing);
  bind(h, "cudaFreeHost", api.FreeHost, missing);
  bind(h, "cudaMemcpy", api.Memcpy, missing);
  bind(h, "cudaMemcpyAsync", api.MemcpyAsync, missing);
  bind(h, "cudaMemsetAsync", api.MemsetAsync, missing);
  bind(h, "cudaStreamCreateWithFlags", api.StreamCreateWithFlags, missing);
  bind(h, "cudaStreamDestroy", api.StreamDestroy, missing);
  bind(h, "cudaStreamSynchronize", api.StreamSynchronize, missing);
  bind(h, "cudaStreamQuery", api.StreamQuery, missing);
  bind(h, "cudaStreamWaitEvent", api.StreamWaitEvent, missing);
  bind(h, "cudaEventCreateWithFlags", api.EventCreateWithFlags, missing);
  bind(h, "cudaEventRecord", api.EventRecord, missing);
  bind(h, "cudaEventQuery", api.EventQuery, missing);
  bind(h, "cudaEventElapsedTime", api.EventElapsedTime, missing);
  bind(h, "cudaEventDestroy", api.EventDestroy, missing);
  bind(h, "cudaPointerGetAttributes", api.PointerGetAttributes, missing);
  bind(h, "cudaDeviceGetPCIBusId", api.DeviceGetPCIBusId, missing);
  bind(h, "cudaDriverGetVersion", api.DriverGetVersion, missing);
  bind(h, "cudaRuntimeGetVersion", api.RuntimeGetVersion, missing);
  bind(h, "cudaGetLastError", api.GetLastError, missing);
  bind(h, "cudaGetErrorName", api.GetErrorName, missing);
  bind(h, "cudaGetErrorString", api.GetErrorString, missing);
  if (!missing.empty()) {
    out.why_not = fmt::format("{} lacks {}", out.path, str::join(missing, ", "));
    return out;
  }
  out.api = &api;
  return out;
}

Loaded<NcclApi> load_nccl() {
  Loaded<NcclApi> out;
  static NcclApi api{};
  void* h = open_first(kNcclPath.get(), {"libnccl.so.2", "libnccl.so"}, out.path, out.why_not);
  if (!h) return out;
  std::vector<std::string> missing;
  bind(h, "ncclGetVersion", api.GetVersion, missing);
  bind(h, "ncclGetUniqueId", api.GetUniqueId, missing);
  bind(h, "ncclCommInitRank", api.CommInitRank, missing);
  bind(h, "ncclCommInitRankConfig", api.CommInitRankConfig, missing, /*optional=*/true);
  bind(h, "ncclCommInitAll", api.CommInitAll, missing);
  bind(h, "ncclCommDestroy", api.CommDestroy, missing);
  bind(h, "ncclCommAbort", api.CommAbort, missing);
  bind(h, "ncclCommGetAsyncError", api.CommGetAsyncError, missing);
  bind(h, "ncclGetErrorString", api.GetErrorString, missing);
  bind(h, "ncclGetLastError", api.GetLastError, missing, /*optional=*/true);
  bind(h, "ncclAllReduce", api.AllReduce, missing);
  bind(h, "ncclBroadcast", api.Broadcast, missing);
  bind(h, "ncclReduce", api.Reduce, missing);
  bind(h, "ncclAllGather", api.AllGather, missing);
  bind(h, "ncclReduceScatter", api.ReduceScatter, missing);
  bind(h, "ncclSend", api.Send, missing);
  bind(h, "ncclRecv", api.Recv, missing);
  bind(h, "ncclGroupStart", api.GroupStart, missing);
  bind(h, "ncclGroupEnd", api.GroupEnd, missing);
  if (!missing.empty()) {
    out.why_not = fmt::format("{} lacks {} (cohort needs NCCL 2.10 or newer)", out.path, str::join(missing, ", "));
    return out;
  }
  // bfloat16 and ncclAvg came with NCCL 2.10: refuse older ones rather than fail per call.
  int version = 0;
  if (api.GetVersion(&version) != kNcclSuccess || version < 21000) {
    out.why_not = fmt::format("{} is NCCL {}; cohort needs 2.10 or newer", out.path, nccl_version_text(version));
    return out;
  }
  out.api = &api;
  return out;
}

}  // namespace

const Loaded<CudaApi>& cuda_runtime() {
  static const Loaded<CudaApi> loaded = load_cuda();
  return loaded;
}

const Loaded<NcclApi>& nccl() {
  static const Loaded<NcclApi> loaded = load_nccl();
  return loaded;
}

const CudaApi& cuda() {
  const auto& l = cuda_runtime();
  if (!l.api) throw ConfigError("no CUDA runtime: " + l.why_not + " (set COHORT_CUDA_RUNTIME to libcudart.so's path)");
  return *l.api;
}

const NcclApi& nccl_api() {
  const auto& l = nccl();
  if (!l.api) throw ConfigError("NCCL not found: " + l.why_not + " (set COHORT_NCCL_LIBRARY to libnccl.so's path)");
  return *l.api;
}

std::string cuda_error_text(int error) {
  const auto& l = cuda_runtime();
  if (!l.api) return fmt::format("CUDA error {}", error);
  const char* name = l.api->GetErrorName(error);
  const char* text = l.api->GetErrorString(error);
  return fmt::format("{} ({})", name ? name : "cudaError?", text ? text : "?");
}

void check_cuda(int error, const std::string& what) {
  if (error == kCudaSuccess) return;
  if (const CudaApi* api = cuda_runtime().api) api->GetLastError();  // clear it for the next call
  throw Error(what + ": " + cuda_error_text(error));
}

std::string nccl_error_text(int result, void* comm) {
  const auto& l = nccl();
  if (!l.api) return fmt::format("NCCL error {}", result);
  std::string s = l.api->GetErrorString(result);
  if (comm && l.api->GetLastError) {
    const char* last = l.api->GetLastError(comm);
    if (last && *last) s += fmt::format(" (NCCL: {})", last);
  }
  return s;
}

std::string cuda_version_text(int v) { return fmt::format("{}.{}", v / 1000, (v % 1000) / 10); }

std::string nccl_version_text(int v) {
  if (v >= 20900) return fmt::format("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100);
  return fmt::format("{}.{}.{}", v / 1000, (v % 1000) / 100, v % 100);
}

}  // namespace cohort::gpu
