// DeviceCommunicator's NCCL handle: creating it (non-blocking where NCCL can, with a deadline either
// way), queuing work on the communicator's stream in the caller's stream order, and aborting it from
// any thread without waiting for a call that may hang. The locking rule is in device_communicator.h.
#include <fmt/core.h>

#include <future>
#include <memory>
#include <thread>

#include "cohort/error.h"
#include "common/deadline.h"
#include "common/log.h"
#include "gpu/device_communicator.h"

namespace cohort::gpu::impl {

void check_nccl_call(int rc, const char* what) {
  if (rc != kNcclSuccess) throw Error(std::string(what) + ": " + nccl_error_text(rc));
}

void DeviceCommunicator::abort_nccl() {
  void* comm = comm_.exchange(nullptr);
  if (!comm) return;
  const bool alone = calls_mu_.try_lock_for(kAbortGrace);
  if (!alone) log::warn("rank {} (GPU {}): an NCCL call is still running after {} ms; aborting NCCL under it",
                        rank(), device_, kAbortGrace.count());
  // On its own thread (kAbortWait, device_communicator.h): the thread owns nothing of this object, so
  // it may outlive it; a process that exits meanwhile takes it along.
  auto aborted = std::make_shared<std::promise<void>>();
  std::future<void> done = aborted->get_future();
  std::thread([comm, aborted] {
    nccl_api().CommAbort(comm);
    aborted->set_value();
  }).detach();
  if (done.wait_for(kAbortWait) != std::future_status::ready)
    log::warn("rank {} (GPU {}): ncclCommAbort has not returned after {} ms (the GPU is still busy with work queued "
              "before the collective); going on, the communicator is unusable already",
              rank(), device_, kAbortWait.count());
  if (alone) calls_mu_.unlock();
}

// A non-blocking communicator's call answered ncclInProgress: NCCL finishes it on its own threads
// (connecting to peers, queuing the kernels) and no other call may be made meanwhile. Polls its
// state until it is no longer in progress (returned), the deadline passes (kNcclInProgress) or the
// communicator is aborted (kAborted). No lock is held between polls: the watchdog can abort.
int DeviceCommunicator::wait_ready(const Deadline& deadline) {
  for (int spins = 0;; ++spins) {
    int state = kNcclInProgress;
    if (!with_comm([&](void* comm) { nccl_api().CommGetAsyncError(comm, &state); })) return kAborted;
    if (state != kNcclInProgress) return state;
    if (deadline.expired()) return kNcclInProgress;
    if (spins < 200) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// The communicator's stream waits for what the caller's current stream has queued so far (the
// kernels that wrote an operation's inputs). One event, re-recorded each time: cudaStreamWaitEvent
// waits for the recording made before it. Under enqueue_mu_.
int DeviceCommunicator::order_after_caller_locked() {
  const CudaApi& c = cuda();
  int rc = c.EventRecord(ready_, current_stream(device_));
  return rc != kCudaSuccess ? rc : c.StreamWaitEvent(stream_, ready_, 0);
}

// Queues `enqueue(comm, stream)` (between ncclGroupStart/End when grouped) and orders the
// caller's stream after it: a blocking call in stream order, as ProcessGroupNCCL's.
void DeviceCommunicator::run_nccl(const std::string& what, size_t bytes, const Enqueue& enqueue, bool grouped,
                                  const Then& then) {
  auto work = queue_nccl(what, bytes, enqueue, grouped, then);
  work->wait(Millis(0));
}

// cohort's in-place forms (send == recv, include/cohort/communicator.h) in NCCL's terms. NCCL's
// in-place allgather passes this rank's block of recv as the input, which is where cohort's
// in-place contribution already is.
const void* DeviceCommunicator::nccl_allgather_input(const void* send, void* recv, size_t block_bytes) const {
  if (send != recv) return send;
  return static_cast<const char*>(recv) + static_cast<size_t>(rank()) * block_bytes;
}
// NCCL's in-place reduce-scatter leaves the result in this rank's block of the input; cohort's in
// the first block: one copy on the same stream moves it (for rank r > 0 the blocks do not overlap).
// The copy is queue_nccl's `then` step: it must follow NCCL's kernel on the stream, which a
// non-blocking communicator queues only when the call is no longer in progress.
int DeviceCommunicator::nccl_reduce_scatter(const void* send, void* recv, size_t recv_count, DataType dtype,
                                            ReduceOp op, void* comm, void* stream) {
  if (send != recv) return nccl_api().ReduceScatter(send, recv, recv_count, nccl_dtype(dtype), nccl_op(op), comm, stream);
  char* mine = static_cast<char*>(recv) + static_cast<size_t>(rank()) * recv_count * dtype_size(dtype);
  return nccl_api().ReduceScatter(send, mine, recv_count, nccl_dtype(dtype), nccl_op(op), comm, stream);
}
DeviceCommunicator::Then DeviceCommunicator::in_place_reduce_scatter_copy(const void* send, void* recv,
                                                                          size_t recv_count, DataType dtype) {
  const size_t bytes = recv_count * dtype_size(dtype);
  char* mine = static_cast<char*>(recv) + static_cast<size_t>(rank()) * bytes;
  if (send != recv || mine == recv) return nullptr;
  return [this, recv, mine, bytes](void* stream) { return copy_on_stream(recv, mine, bytes, stream); };
}

// Queues `enqueue(comm, stream)` (between ncclGroupStart/End when grouped), then `then(stream)`
// (CUDA work that must follow NCCL's kernels), and the operation's end event. One enqueuing thread
// at a time (enqueue_mu_): NCCL's calls on a communicator must not interleave, and a non-blocking
// communicator takes no call while one is in progress. The watchdog never needs enqueue_mu_.
std::shared_ptr<Work> DeviceCommunicator::queue_nccl(const std::string& what_op, size_t bytes, const Enqueue& enqueue,
                                                     bool grouped, const Then& then) {
  const NcclApi& n = nccl_api();
  const CudaApi& c = cuda();
  auto op = std::make_shared<Inflight>();
  op->what = fmt::format("{} of {} bytes", what_op, bytes);
  op->timeout = options().timeout;
  DeviceGuard guard(device_);
  check_cuda(c.EventCreateWithFlags(&op->end, timing_ ? kCudaEventDefault : kCudaEventDisableTiming),
             "cudaEventCreateWithFlags");
  if (timing_) check_cuda(c.EventCreateWithFlags(&op->start, kCudaEventDefault), "cudaEventCreateWithFlags");
  constexpr int kCudaFailed = -1;
  int rc = kNcclSuccess;
  {
    std::lock_guard<std::mutex> order(enqueue_mu_);
    check_failed();
    const Deadline ready_by = Deadline::after(op->timeout);
    const bool live = with_comm([&](void* comm) {
      rc = order_after_caller_locked() == kCudaSuccess ? kNcclSuccess : kCudaFailed;
      if (rc == kNcclSuccess && op->start)
        rc = c.EventRecord(op->start, stream_) == kCudaSuccess ? kNcclSuccess : kCudaFailed;
      if (rc == kNcclSuccess && grouped) rc = n.GroupStart();
      int body = kNcclSuccess;
      if (rc == kNcclSuccess) {
        try {
          body = enqueue(comm, stream_);
        } catch (...) {
          if (grouped) n.GroupEnd();
          throw;
        }
      }
      if (grouped && rc == kNcclSuccess) {
        int end = n.GroupEnd();
        rc = body != kNcclSuccess ? body : end;
      } else if (rc == kNcclSuccess) {
        rc = body;
      }
    });
    if (!live) check_failed();  // aborted meanwhile: throws its cause
    if (rc == kNcclInProgress) {
      rc = wait_ready(ready_by);
      if (rc == kAborted) check_failed();
      if (rc == kNcclInProgress)
        fail<TimeoutError>(fmt::format("rank {} (GPU {}): NCCL could not start {} within {} ms; the NCCL "
                                       "communicator was aborted (a peer it must connect to stopped calling, or its "
                                       "network fails)",
                                       rank(), device_, op->what, op->timeout.count()));
      // Anything else is NCCL's asynchronous error (this call's, or an earlier operation's).
      if (rc != kNcclSuccess) {
        std::string text = nccl_error_text(rc);
        with_comm([&](void* comm) { text = nccl_error_text(rc, comm); });
        fail_async(rc, text, op->what);
      }
    }
    if (rc == kNcclSuccess && then) rc = then(stream_) == kCudaSuccess ? kNcclSuccess : kCudaFailed;
    if (rc == kNcclSuccess) rc = c.EventRecord(op->end, stream_) == kCudaSuccess ? kNcclSuccess : kCudaFailed;
  }
  if (rc != kNcclSuccess) {
    check_failed();  // the call failed because the communicator was aborted under it: name the cause
    fail<Error>(fmt::format("rank {} (GPU {}): NCCL could not start {}: {}", rank(), device_, op->what,
                            rc == kCudaFailed ? "a CUDA stream or event call failed" : nccl_error_text(rc)));
  }
  op->deadline = std::chrono::steady_clock::now() + op->timeout;
  follow(op);
  return std::make_shared<DeviceWork>(shared_from_this(), std::move(op));
}

int DeviceCommunicator::copy_on_stream(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return kNcclSuccess;
  int rc = cuda().MemcpyAsync(dst, src, bytes, kCudaMemcpyDefault, stream);
  return rc == kCudaSuccess ? kNcclSuccess : 1;  // ncclUnhandledCudaError
}

// True when everything queued on the stream has run within `limit`; never throws (destructor).
bool DeviceCommunicator::stream_drained(Millis limit) {
  void* event = nullptr;
  const CudaApi& c = cuda();
  if (c.EventCreateWithFlags(&event, kCudaEventDisableTiming) != kCudaSuccess) return false;
  bool done = false;
  if (c.EventRecord(event, stream_) == kCudaSuccess) {
    const Deadline deadline = Deadline::after(limit);
    for (;;) {
      int rc = c.EventQuery(event);
      if (rc == kCudaSuccess) {
        done = true;
        break;
      }
      if (rc != kCudaErrorNotReady || deadline.expired()) break;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  c.EventDestroy(event);
  return done;
}

// Blocks until everything queued on the stream so far has run (bounded like any wait).
void DeviceCommunicator::wait_stream(const std::string& what) {
  DeviceGuard guard(device_);
  Inflight marker;
  marker.what = what;
  marker.timeout = options().timeout;
  marker.deadline = std::chrono::steady_clock::now() + marker.timeout;
  check_cuda(cuda().EventCreateWithFlags(&marker.end, kCudaEventDisableTiming), "cudaEventCreateWithFlags");
  check_cuda(cuda().EventRecord(marker.end, stream_), "cudaEventRecord");
  synchronize_op(marker, Millis(0));
}

int DeviceCommunicator::nccl_version() {
  int v = 0;
  if (nccl().api) nccl().api->GetVersion(&v);
  return v;
}

void DeviceCommunicator::init_nccl() {
  NcclUniqueId id{};
  if (rank() == 0) {
    int rc = nccl_api().GetUniqueId(&id);
    if (rc != kNcclSuccess) throw Error("rank 0: ncclGetUniqueId: " + nccl_error_text(rc));
  }
  // The id travels over the host communicator, which met at cohort's store; its broadcast names a
  // rank that does not come. The barrier makes every rank present before NCCL's own bootstrap.
  host_->broadcast(&id, sizeof id, DataType::kUInt8, 0);
  host_->barrier();
  const NcclApi& n = nccl_api();
  if (n.CommInitRankConfig && nccl_version() >= 21400) init_nonblocking(id);
  else init_blocking(id);
}

std::string DeviceCommunicator::setup_timeout_message() const {
  return fmt::format("rank {} (GPU {}): NCCL communicator set-up did not finish within {} ms (every rank had "
                     "arrived; a peer's NCCL bootstrap or network is stuck)",
                     rank(), device_, options().timeout.count());
}

// As c10d does: a non-blocking communicator (NCCL >= 2.14). ncclCommInitRankConfig returns at once
// with the handle, NCCL sets it up on its own threads, and its state is polled until the
// communicator's timeout; past that it is aborted, so nothing is left running. Every later call
// on it returns at once too (ncclInProgress while NCCL connects), which keeps NCCL calls from
// hanging with cohort's locks held.
void DeviceCommunicator::init_nonblocking(const NcclUniqueId& id) {
  NcclConfig config;
  config.blocking = 0;
  void* comm = nullptr;
  int rc = nccl_api().CommInitRankConfig(&comm, size(), id, rank(), &config);
  blocking_ = false;
  comm_.store(comm);  // from here on abort_nccl owns it
  if (rc == kNcclInProgress) rc = wait_ready(Deadline::after(options().timeout));
  if (rc == kNcclSuccess && comm) return;
  std::string msg = rc == kNcclInProgress ? setup_timeout_message() : "";
  if (msg.empty()) {
    with_comm([&](void* c) { msg = nccl_error_text(rc, c); });
    msg = fmt::format("rank {} (GPU {}): ncclCommInitRankConfig failed: {}", rank(), device_,
                      msg.empty() ? nccl_error_text(rc) : msg);
  }
  abort_nccl();
  host_->abort(msg);
  if (rc == kNcclInProgress) throw TimeoutError(msg);
  throw Error(msg);
}

// An NCCL without ncclCommInitRankConfig: ncclCommInitRank blocks and has no deadline of its own,
// so it runs on a helper thread that is given up (and the error thrown) when the communicator's
// timeout passes. The thread keeps its state: should the set-up still succeed after that, the
// thread aborts the communicator nobody will use (it would hold GPU memory and NCCL's threads).
void DeviceCommunicator::init_blocking(const NcclUniqueId& id) {
  struct InitState {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    bool abandoned = false;  // the caller gave up: a late communicator is the thread's to abort
    int rc = kNcclSuccess;
    void* comm = nullptr;
  };
  auto state = std::make_shared<InitState>();
  const int device = device_, n = size(), r = rank();
  std::thread([state, device, n, r, id] {
    int rc = cuda().SetDevice(device) == kCudaSuccess ? kNcclSuccess : 1;
    void* comm = nullptr;
    if (rc == kNcclSuccess) rc = nccl_api().CommInitRank(&comm, n, id, r);
    std::lock_guard<std::mutex> lock(state->mu);
    if (state->abandoned) {
      if (comm) nccl_api().CommAbort(comm);
      return;
    }
    state->done = true;
    state->rc = rc;
    state->comm = comm;
    state->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(state->mu);
  if (!state->cv.wait_for(lock, options().timeout, [&] { return state->done; })) {
    state->abandoned = true;
    lock.unlock();
    const std::string msg = setup_timeout_message();
    host_->abort(msg);
    throw TimeoutError(msg);
  }
  if (state->rc != kNcclSuccess) {
    const std::string msg = fmt::format("rank {} (GPU {}): ncclCommInitRank failed: {}", r, device,
                                        nccl_error_text(state->rc));
    host_->abort(msg);
    throw Error(msg);
  }
  blocking_ = true;
  comm_.store(state->comm);
}
}  // namespace cohort::gpu::impl
