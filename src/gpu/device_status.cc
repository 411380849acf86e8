// What this host has for GPU work (cohort/gpu.h): the CUDA runtime, its GPUs and NCCL (status), the
// doctor's check that NCCL can sum across all local GPUs (check_local_gpus), and the GPU a process
// of the job uses (local_device).
#include <fmt/core.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include "common/env.h"
#include "cohort/error.h"
#include "common/deadline.h"
#include "common/log.h"
#include "gpu/device_communicator.h"

namespace cohort::gpu {

using impl::check_nccl_call;
using Millis = std::chrono::milliseconds;

Status status() {
  Status s;
  const auto& rt = cuda_runtime();
  s.runtime = rt.api != nullptr;
  s.runtime_library = rt.path;
  if (!rt.api) {
    s.why_no_gpu = "no CUDA runtime: " + rt.why_not;
  } else {
    rt.api->RuntimeGetVersion(&s.runtime_version);
    rt.api->DriverGetVersion(&s.driver_version);
    int count = 0;
    int rc = rt.api->GetDeviceCount(&count);
    if (rc != kCudaSuccess) {
      rt.api->GetLastError();
      // The runtime's words for a host without a GPU are about versions (cudaErrorInsufficientDriver
      // also when no driver is installed at all, which the driver version 0 tells apart): say what it is.
      const std::string call = "cudaGetDeviceCount: " + cuda_error_text(rc);
      if (rc == kCudaErrorInsufficientDriver && s.driver_version == 0)
        s.why_no_gpu = "no GPU / no NVIDIA driver on this host (" + call + ")";
      else if (rc == kCudaErrorInsufficientDriver)
        s.why_no_gpu = fmt::format("the NVIDIA driver supports CUDA up to {}, older than the CUDA runtime {} ({}): "
                                   "update the driver, or use a runtime built for it",
                                   cuda_version_text(s.driver_version), cuda_version_text(s.runtime_version), call);
      else if (rc == kCudaErrorNoDevice)
        s.why_no_gpu = "no GPU: the NVIDIA driver is installed but sees no device (" + call + ")";
      else
        s.why_no_gpu = "no GPU: " + call;
    } else if (count == 0) {
      s.why_no_gpu = "no GPU: cudaGetDeviceCount found none";
    }
    s.devices = rc == kCudaSuccess ? count : 0;
  }
  const auto& nc = nccl();
  s.nccl = nc.api != nullptr;
  s.nccl_library = nc.path;
  if (nc.api) nc.api->GetVersion(&s.nccl_version);
  else s.why_no_nccl = nc.why_not;
  return s;
}

LocalGpuCheck check_local_gpus(Millis timeout) {
  LocalGpuCheck out;
  out.status = status();
  if (!out.status.usable()) {
    out.nccl_allreduce = "skipped: " + out.status.why_no_gpu;
    return out;
  }
  const CudaApi& c = cuda();
  const int n = out.status.devices;
  for (int d = 0; d < n; ++d) {
    char bus[64] = {};
    c.DeviceGetPCIBusId(bus, sizeof bus - 1, d);
    out.bus_ids.push_back(bus);
  }
  if (!out.status.nccl) {
    out.nccl_allreduce = "skipped: NCCL not found (" + out.status.why_no_nccl + ")";
    return out;
  }
  const auto t0 = std::chrono::steady_clock::now();
  // Everything on a helper thread: ncclCommInitAll and the kernels have no deadline of their own, and
  // a hung GPU must not hang the doctor. The thread owns its state; a late finish only frees it.
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::string result;
  };
  auto state = std::make_shared<State>();
  std::thread([state, n] {
    std::string result;
    const CudaApi& c = cuda();
    const NcclApi& nc = nccl_api();
    std::vector<void*> comms(static_cast<size_t>(n)), streams(static_cast<size_t>(n)), bufs(static_cast<size_t>(n));
    std::vector<int> devices(static_cast<size_t>(n));
    for (int d = 0; d < n; ++d) devices[d] = d;
    int rc = nc.CommInitAll(comms.data(), n, devices.data());
    if (rc != kNcclSuccess) {
      result = "FAIL: ncclCommInitAll over " + std::to_string(n) + " GPUs: " + nccl_error_text(rc);
    } else {
      try {
        const float one = 1.0f;
        for (int d = 0; d < n; ++d) {
          check_cuda(c.SetDevice(d), fmt::format("cudaSetDevice({})", d));
          check_cuda(c.StreamCreateWithFlags(&streams[d], 0), "cudaStreamCreateWithFlags");
          check_cuda(c.Malloc(&bufs[d], sizeof(float)), "cudaMalloc");
          check_cuda(c.Memcpy(bufs[d], &one, sizeof one, kCudaMemcpyDefault), "cudaMemcpy");
        }
        check_nccl_call(nc.GroupStart(), "ncclGroupStart");
        for (int d = 0; d < n; ++d)
          check_nccl_call(nc.AllReduce(bufs[d], bufs[d], 1, kNcclFloat32, kNcclSum, comms[d], streams[d]), "ncclAllReduce");
        check_nccl_call(nc.GroupEnd(), "ncclGroupEnd");
        for (int d = 0; d < n; ++d) {
          check_cuda(c.SetDevice(d), fmt::format("cudaSetDevice({})", d));
          check_cuda(c.StreamSynchronize(streams[d]), fmt::format("GPU {}: the allreduce", d));
          float v = 0;
          check_cuda(c.Memcpy(&v, bufs[d], sizeof v, kCudaMemcpyDefault), "cudaMemcpy");
          if (v != static_cast<float>(n))
            throw Error(fmt::format("GPU {} holds {} after summing 1.0 over {} GPUs", d, v, n));
        }
      } catch (const std::exception& e) {
        result = std::string("FAIL: ") + e.what();
      }
      for (int d = 0; d < n; ++d) {
        if (comms[d]) nc.CommDestroy(comms[d]);
        if (bufs[d]) c.Free(bufs[d]);
        if (streams[d]) c.StreamDestroy(streams[d]);
      }
    }
    std::lock_guard<std::mutex> lock(state->mu);
    state->done = true;
    state->result = std::move(result);
    state->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(state->mu);
  if (!state->cv.wait_for(lock, timeout, [&] { return state->done; })) {
    out.nccl_allreduce = fmt::format("FAIL: no result within {} ms (a GPU or NCCL hangs)", timeout.count());
    return out;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  out.nccl_allreduce = state->result.empty()
                           ? fmt::format("ok: {} GPU{} summed 1 float each in {:.2f} s", n, n == 1 ? "" : "s", s)
                           : state->result;
  return out;
}

int local_device() {
  Status s = status();
  if (!s.usable()) throw ConfigError(s.why_no_gpu);
  int wanted = 0;
  std::string from = "default";
  if (auto v = env::get_raw("COHORT_LOCAL_GPU")) {
    wanted = static_cast<int>(env::parse_int("COHORT_LOCAL_GPU", *v));
    from = "COHORT_LOCAL_GPU";
  } else if (auto l = env::get_raw("LOCAL_RANK")) {
    wanted = static_cast<int>(env::parse_int("LOCAL_RANK", *l));
    from = "LOCAL_RANK";
  }
  if (wanted < 0) throw ConfigError(fmt::format("{}={}: expected a device number >= 0", from, wanted));
  if (from == "COHORT_LOCAL_GPU" && wanted >= s.devices)
    throw ConfigError(fmt::format("COHORT_LOCAL_GPU={}: this process sees {} GPU{}", wanted, s.devices,
                                  s.devices == 1 ? "" : "s"));
  return wanted % s.devices;
}

}  // namespace cohort::gpu
