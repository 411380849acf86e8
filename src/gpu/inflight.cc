// Operations in flight on a DeviceCommunicator: the handle a caller waits on (DeviceWork), the
// watchdog that follows every queued operation to its end or its deadline, and the first failure,
// which aborts NCCL and the host communicator once and is rethrown to every later caller.
#include <fmt/core.h>

#include <algorithm>
#include <thread>

#include "cohort/error.h"
#include "common/deadline.h"
#include "common/log.h"
#include "gpu/device_communicator.h"

namespace cohort::gpu::impl {

Inflight::~Inflight() {
  if (end) cuda().EventDestroy(end);
  if (start) cuda().EventDestroy(start);
}

// wait(): the caller's current stream waits for the operation's end (no host block). Errors known
// now (the communicator failed, NCCL reported one, the deadline passed) are thrown here.
void DeviceCommunicator::order_after(const Inflight& op) {
  if (poll(op)) return;  // already over: nothing to wait for
  DeviceGuard guard(device_);
  check_cuda(cuda().StreamWaitEvent(current_stream(device_), op.end, 0),
             fmt::format("cudaStreamWaitEvent (the caller's stream after {})", op.what));
}

// synchronize(): blocks until the operation has run, polling so that the deadline and NCCL's
// asynchronous errors are seen. `timeout` 0: the operation's own deadline.
void DeviceCommunicator::synchronize_op(const Inflight& op, Millis timeout) {
  const Millis limit = timeout.count() > 0 ? timeout : op.timeout;
  const Deadline deadline = timeout.count() > 0 ? Deadline::after(timeout) : Deadline(op.deadline);
  for (int spins = 0;; ++spins) {
    if (poll(op, deadline, limit)) return;
    // Spin briefly (a small operation ends in microseconds), then sleep so a long wait costs no core.
    if (spins < 2000) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// True when the operation has run; throws when it failed, NCCL reports an error, the communicator
// failed before it ended, or its deadline has passed (which aborts NCCL, as the watchdog would).
bool DeviceCommunicator::poll(const Inflight& op, const Deadline& deadline, Millis limit) {
  rethrow_failure();  // an aborted communicator's kernels end early, their results unwritten
  const int rc = cuda().EventQuery(op.end);
  if (rc != kCudaSuccess && rc != kCudaErrorNotReady)
    fail<Error>(fmt::format("rank {} (GPU {}): {} failed on the GPU: {}", rank(), device_, op.what, cuda_error_text(rc)));
  // NCCL's asynchronous error is checked even when the event fired: a failed operation may still
  // let its kernel finish, with garbage in the buffer.
  check_async_error(op.what);
  if (rc == kCudaSuccess) {
    // The communicator may have been aborted (the watchdog, another thread) between the check above
    // and the query: an aborted communicator's kernels end early, so the event firing is then no proof
    // that the operation ran. (Seen as an ungrouped, deadlocked exchange that "completed" under load.)
    rethrow_failure();
    return true;
  }
  if (deadline.expired()) fail<TimeoutError>(timeout_message(op.what, limit));
  return false;
}

// For gpu::work_interval: milliseconds from `marker` to the operation's start and end.
std::optional<GpuInterval> DeviceCommunicator::interval(const Inflight& op, void* marker) {
  if (!op.start || !marker) return std::nullopt;
  float to_start = 0, to_end = 0;
  if (cuda().EventElapsedTime(&to_start, marker, op.start) != kCudaSuccess ||
      cuda().EventElapsedTime(&to_end, marker, op.end) != kCudaSuccess) {
    cuda().GetLastError();
    return std::nullopt;
  }
  return GpuInterval{to_start, to_end};
}

// For gpu::synchronize: everything queued on the stream so far has run.
void DeviceCommunicator::synchronize_all() {
  rethrow_failure();
  if (stream_) wait_stream("synchronize");
}

// The failure that ended this communicator, for an operation that had not finished by then.
std::exception_ptr DeviceCommunicator::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_error_;
}

// Records the first failure and aborts NCCL, once. True for the first.
bool DeviceCommunicator::record_failure(const std::string& message, std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_) return false;
    failed_ = true;
    failure_ = message;
    failure_error_ = std::move(error);
  }
  abort_nccl();
  return true;
}

void DeviceCommunicator::rethrow_failure() {
  std::exception_ptr e = failure();
  if (e) std::rethrow_exception(e);
}

void DeviceCommunicator::check_failed() {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) throw AbortedError("the GPU communicator failed earlier: " + failure_);
}

// NCCL's asynchronous error, read while the communicator lives; thrown, naming the operation,
// after NCCL is aborted. ncclInProgress is no error: a call still finishing (non-blocking).
void DeviceCommunicator::check_async_error(const std::string& what) {
  int async = kNcclSuccess;
  std::string text;
  with_comm([&](void* comm) {
    nccl_api().CommGetAsyncError(comm, &async);
    if (async != kNcclSuccess && async != kNcclInProgress) text = nccl_error_text(async, comm);
  });
  if (!text.empty()) fail_async(async, text, what);
}
[[noreturn]] void DeviceCommunicator::fail_async(int async, const std::string& text, const std::string& what) {
  const std::string msg = fmt::format("rank {} (GPU {}): NCCL reports an error during {}: {}", rank(), device_, what, text);
  // ncclSystemError / ncclRemoteError: a peer or the network failed.
  if (async == 2 || async == 6) fail<PeerLostError>(msg + " (a peer failed, or its network did)");
  fail<Error>(msg);
}

std::string DeviceCommunicator::timeout_message(const std::string& what, Millis limit) const {
  return fmt::format("rank {} (GPU {}): {} did not finish on the GPU within {} ms; the NCCL communicator was "
                     "aborted (a peer stopped calling, or its GPU hangs)",
                     rank(), device_, what, limit.count());
}

// ---- the watchdog (as c10d's ProcessGroupNCCL has): follows every queued operation, also those
// nobody waits for (blocking calls return once their work is queued in stream order), and aborts
// the communicator when one fails or passes its deadline, with one line naming rank, GPU and
// operation. Without it a rank whose peer died would hang in its next host synchronisation.
void DeviceCommunicator::watchdog_loop() {
  const Millis period = std::clamp<Millis>(options().timeout / 10, Millis(5), Millis(100));
  std::unique_lock<std::mutex> lock(watch_mu_);
  while (!watch_stop_) {
    watch_cv_.wait_for(lock, period, [&] { return watch_stop_; });
    if (watch_stop_) break;
    std::vector<std::shared_ptr<Inflight>> ops(inflight_.begin(), inflight_.end());
    lock.unlock();
    // One stream runs its operations in order: the first that has not run is the oldest still
    // pending (the earliest deadline), and none after it has run either. So one pass costs as many
    // event queries as operations ended since the last, plus one.
    size_t over = 0;
    try {
      while (over < ops.size() && poll(*ops[over])) ++over;
      check_async_error("an operation in flight");
    } catch (const std::exception& e) {
      log::error("GPU watchdog: {}", e.what());
      lock.lock();
      inflight_.clear();  // the communicator is aborted: nothing left to follow
      continue;
    }
    lock.lock();
    inflight_.erase(inflight_.begin(), inflight_.begin() + static_cast<std::ptrdiff_t>(over));
  }
}
void DeviceCommunicator::follow(std::shared_ptr<Inflight> op) {
  if (!watchdog_.joinable()) return;
  std::lock_guard<std::mutex> lock(watch_mu_);
  inflight_.push_back(std::move(op));
}
void DeviceCommunicator::stop_watchdog() {
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    watch_stop_ = true;
  }
  watch_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
}

void DeviceWork::wait(Millis) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) {
      if (error_) std::rethrow_exception(error_);
      return;
    }
  }
  try {
    owner_->order_after(*op_);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = std::current_exception();
    throw;
  }
}

void DeviceWork::synchronize(Millis timeout) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) {
      if (error_) std::rethrow_exception(error_);
      return;
    }
  }
  try {
    owner_->synchronize_op(*op_, timeout);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = std::current_exception();
    throw;
  }
  std::lock_guard<std::mutex> lock(mu_);
  done_ = true;
}

bool DeviceWork::test() {
  std::lock_guard<std::mutex> lock(mu_);
  if (done_) return true;
  try {
    done_ = owner_->poll(*op_);
  } catch (...) {
    done_ = true;
    error_ = std::current_exception();
  }
  return done_;
}

std::optional<GpuInterval> DeviceWork::interval(void* marker) { return owner_->interval(*op_, marker); }

std::exception_ptr DeviceWork::exception() {
  std::lock_guard<std::mutex> lock(mu_);
  if (error_ || done_) return error_;
  return owner_->failure();
}
}  // namespace cohort::gpu::impl
