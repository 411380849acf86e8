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
//
// It is split by idea: this file (the devices, versions and error names), fake_cuda_streams.cc
// (streams, events, host functions), fake_cuda_memory.cc (device and pinned memory, copies),
// fake_nccl.cc (communicators: set-up, abort, errors), fake_nccl_ops.cc (collectives, p2p, groups and
// the stalls that hang them) and fake_nccl_hooks.cc (the test hooks); fake_cuda_internal.h and
// fake_nccl_internal.h are what they share.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fake_cuda_internal.h"

namespace fake_cuda {

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

}  // namespace fake_cuda

using namespace fake_cuda;

extern "C" {

// ---------------- CUDA runtime: the devices, versions and error names ----------------
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

}  // extern "C"
