// The fake's test hooks (extern "C", not CUDA or NCCL functions; fake_cuda.cc says what the fake is):
// faults a test injects (a call that hangs, a slow set-up, a slow abort, a peer's process exit), the
// number of live communicators (a leak shows there) and device memory as a fake kernel sees it.
#include <vector>

#include "fake_nccl_internal.h"

using namespace fake_cuda;

extern "C" {

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
