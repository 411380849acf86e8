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
// Stream order, as in PyTorch's ProcessGroupNCCL. Device work runs on the communicator's own CUDA
// stream, a non-blocking one created on the rank's device. Each operation first waits for what the
// caller's current stream (current_stream below: torch's current stream where cohort's torch
// integration is linked, else the stream a StreamGuard set, else the legacy default stream) had
// queued when it was called, so buffers written by earlier kernels are ready. Nothing queued on the
// caller's stream afterwards waits for the communication, so compute overlaps it, until the caller
// waits: a blocking call, or Work::wait() of an *_async call, makes the caller's stream wait for the
// operation's end and returns without blocking the host; Work::synchronize() (or gpu::synchronize)
// blocks the host until the operation has run. Buffers must stay allocated until the operation has
// run on the GPU, as with any CUDA work: freed memory reused by later work on the caller's stream is
// safe after a wait(), memory handed to another stream is not (torch: Tensor::record_stream).
//
// Errors and deadlines: every operation has the communicator's timeout. A watchdog thread per NCCL
// communicator follows every queued operation, also those nobody waits for; when one fails, NCCL
// reports an asynchronous error, or an operation passes its deadline, it aborts the NCCL communicator
// (ncclCommAbort ends its kernels, so work queued behind them runs and no stream stays stuck) and the
// host communicator, and logs one line naming the rank, the GPU and the operation. Work::wait(),
// test() and synchronize() check the same and throw it (TimeoutError, PeerLostError or Error); after
// a failure every call throws AbortedError naming the first cause, and no NCCL function is called
// with the aborted communicator again.

#include <chrono>
#include <memory>
#include <optional>
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

// ---- streams ----
// The CUDA stream (a cudaStream_t) that device work of the calling thread on `device` is ordered
// after and before: the one a StreamGuard on this thread set, else the stream provider's answer
// (cohort's torch integration provides torch's current stream), else nullptr, the legacy default
// stream. Never throws.
void* current_stream(int device);
using StreamProvider = void* (*)(int device);
void set_stream_provider(StreamProvider provider);  // nullptr: none

// Makes `stream` the calling thread's current stream on `device` for the guard's lifetime.
class StreamGuard {
 public:
  StreamGuard(int device, void* stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  int device_;
};

// Blocks until everything `comm` has queued on its GPU has run (bounded by its timeout); throws its
// failure. Nothing to do for a host communicator.
void synchronize(Communicator& comm);

// ---- GPU timing (for the timeline's overlap figures) ----
// Operations queued from now on record timed CUDA events (also COHORT_GPU_TIMING=1). No effect on a
// host communicator.
void enable_timing(Communicator& comm);
bool timing_enabled(const Communicator& comm);
// A timed event recorded on current_stream(device) now; null without a CUDA runtime.
std::shared_ptr<void> record_marker(int device);
// Whether the stream has reached `marker`, polling for up to `wait` (0: just look). Never throws.
bool marker_reached(const std::shared_ptr<void>& marker,
                    std::chrono::milliseconds wait = std::chrono::milliseconds(0));
// Milliseconds from `marker` to the start and the end of `work` on the GPU (negative: before the
// marker). nullopt when the work carries no timing (host work, timing off) or has not run yet.
struct GpuInterval {
  double start_ms = 0, end_ms = 0;
};
std::optional<GpuInterval> work_interval(Work& work, const std::shared_ptr<void>& marker);

// Device memory for tools and tests (cudaMalloc on `device`; freed with the last copy of the pointer).
std::shared_ptr<void> allocate_device(size_t bytes, int device);
// Copies with the direction inferred (host <-> device, either way) in stream order on the device
// memory's current stream, and returns when the copy is done (as cudaMemcpy on that stream).
void copy_memory(void* dst, const void* src, size_t bytes);
// Sets `bytes` of GPU memory to zero, likewise.
void zero_memory(void* ptr, size_t bytes);
// The same, queued on current_stream(device) and not waited for.
void copy_memory_async(void* dst, const void* src, size_t bytes, int device);
void zero_memory_async(void* ptr, size_t bytes, int device);
// Whether `ptr` is in GPU memory (device or managed).
bool is_device_pointer(const void* ptr);

}  // namespace cohort::gpu
