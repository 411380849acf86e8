#pragma once
// GPU buffers: a Communicator that takes CUDA device pointers as well as host pointers.
//
//   auto host = cohort::Communicator::from_env();
//   auto comm = cohort::gpu::make_device_communicator(host);   // collective
//   comm->allreduce(d_grads, d_grads, n, cohort::DataType::kFloat32, cohort::ReduceOp::kAvg);
//
// NCCL moves device buffers (one GPU per rank, the NCCL unique id handed out through the host
// communicator, which met at cohort's store); host buffers keep going through cohort's own
// shared-memory and TCP collectives. When NCCL cannot serve the job (not installed, or ranks share
// a GPU) device buffers are staged: copied to host memory, reduced there, copied back, with one
// warning. The CUDA runtime and NCCL are loaded at run time, so the same build runs on machines
// without either (docs/gpu.md).
//
// Device work runs on the communicator's own CUDA stream, created on the rank's device. The stream
// is a blocking one: it waits for work queued earlier on the legacy default stream (where PyTorch and
// plain CUDA code queue by default) and such work waits for it, so buffers written by earlier kernels
// are ready. Blocking calls return when the operation is complete on the GPU; *_async calls return
// a Work whose wait() does. Every wait is bounded by the communicator's timeout: a stuck NCCL
// operation aborts the NCCL communicator and throws TimeoutError.

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "cohort/communicator.h"

namespace cohort::gpu {

// What this process can use, for messages, `cohort doctor` and test skips. Never throws.
struct Status {
  bool runtime = false;         // libcudart loaded
  std::string runtime_library;  // its path
  int runtime_version = 0;      // cudaRuntimeGetVersion (12040 = 12.4)
  int driver_version = 0;       // cudaDriverGetVersion (0: no driver)
  int devices = 0;              // cudaGetDeviceCount
  bool nccl = false;            // libnccl loaded, 2.10 or newer
  std::string nccl_library;
  int nccl_version = 0;         // ncclGetVersion (22809 = 2.28.9)
  std::string why_no_gpu;       // "" when devices > 0
  std::string why_no_nccl;      // "" when nccl
  // "no CUDA runtime: ..." / "no GPU: cudaGetDeviceCount: cudaErrorNoDevice (...)" / "" when usable.
  bool usable() const { return devices > 0; }
};
Status status();

// `cohort doctor`'s look at this host's GPUs: status, each GPU's PCI bus id, and a tiny NCCL allreduce
// over all local GPUs in this one process (ncclCommInitAll), bounded by `timeout`. Never throws.
struct LocalGpuCheck {
  Status status;
  std::vector<std::string> bus_ids;  // per device
  // "ok: 2 GPUs summed 1 float each in 0.84 s", "FAIL: ..." or "skipped: <why>".
  std::string nccl_allreduce;
};
LocalGpuCheck check_local_gpus(std::chrono::milliseconds timeout);

// The device a worker should use: COHORT_LOCAL_GPU (set by `cohort run --gpus-per-node`), else
// LOCAL_RANK, modulo the devices this process sees.
int local_device();

enum class DevicePath { kAuto, kNccl, kStaged };

struct DeviceOptions {
  int device = -1;                         // -1: local_device()
  DevicePath path = DevicePath::kAuto;     // COHORT_GPU_PATH=auto|nccl|staged overrides
};

// Collective over `host`. Throws ConfigError when no GPU is usable (the line says why), or when
// `path` is kNccl and NCCL cannot serve the job (the line names the rank and the reason).
std::shared_ptr<Communicator> make_device_communicator(std::shared_ptr<Communicator> host,
                                                       DeviceOptions options = {});

// For a communicator from make_device_communicator: "nccl" or "staged", and why that path.
std::string device_path_of(const Communicator& comm);
// The GPU a communicator from make_device_communicator uses; -1 for any other communicator.
int device_of(const Communicator& comm);

// Device memory for tools and tests (cudaMalloc on `device`; freed with the last copy of the pointer).
std::shared_ptr<void> allocate_device(size_t bytes, int device);
// cudaMemcpy with the direction inferred (host <-> device, either way).
void copy_memory(void* dst, const void* src, size_t bytes);
// Sets `bytes` of GPU memory to zero (ordered after, and completed before returning like, cudaMemcpy).
void zero_memory(void* ptr, size_t bytes);
// Whether `ptr` is in GPU memory (device or managed).
bool is_device_pointer(const void* ptr);

}  // namespace cohort::gpu
