// DeviceCommunicator's staged path: device buffers copied to pinned host memory, the host
// communicator's operation run there, the result copied back, all in the caller's stream order.
// Taken when NCCL cannot serve every rank (docs/gpu.md, "Which path").
#include <fmt/core.h>

#include <algorithm>

#include "cohort/error.h"
#include "common/deadline.h"
#include "common/log.h"
#include "gpu/device_communicator.h"

namespace cohort::gpu::impl {

// Staged path: `in_bytes` of `in` copied to pinned host memory, `host_op(host_in, host_out)` run
// by the host communicator, `out_bytes` copied back to `out`. When in == out the op runs in place.
void DeviceCommunicator::staged_op(const void* in, size_t in_bytes, void* out, size_t out_bytes,
                                   const HostOp& host_op) {
  std::lock_guard<std::mutex> lock(staging_mu_);
  const bool in_place = in && in == out;
  const size_t in_room = in_place ? 0 : (in_bytes + 255) / 256 * 256;
  ensure_staging(in_room + std::max(out_bytes, in_place ? in_bytes : 0));
  char* host_in = static_cast<char*>(staging_);
  char* host_out = in_place ? host_in : host_in + in_room;
  DeviceGuard guard(device_);
  {
    std::lock_guard<std::mutex> order(enqueue_mu_);
    check_cuda(order_after_caller_locked(), "ordering the staging copy after the caller's stream");
  }
  if (in && in_bytes) {
    check_cuda(cuda().MemcpyAsync(host_in, in, in_bytes, kCudaMemcpyDefault, stream_), "staging copy to host");
    wait_stream("staging copy to host");
  }
  host_op(in_bytes ? host_in : nullptr, host_out);
  if (out && out_bytes) {
    check_cuda(cuda().MemcpyAsync(out, host_out, out_bytes, kCudaMemcpyDefault, stream_), "staging copy to GPU");
    wait_stream("staging copy to GPU");
  }
}

void DeviceCommunicator::ensure_staging(size_t bytes) {
  if (bytes <= staging_bytes_) return;
  if (staging_) cuda().FreeHost(staging_);
  staging_ = nullptr;
  staging_bytes_ = 0;
  size_t want = std::max<size_t>(bytes, 1 << 20);
  check_cuda(cuda().MallocHost(&staging_, want), fmt::format("cudaMallocHost of {} bytes for staging", want));
  staging_bytes_ = want;
}

std::shared_ptr<Work> DeviceCommunicator::run_now(const std::function<void()>& f) {
  f();
  return std::make_shared<DoneWork>();
}
}  // namespace cohort::gpu::impl
