#pragma once
// DeviceCommunicator: cohort::Communicator for CUDA device buffers (NCCL, or staged through host
// memory) that hands host buffers to the host communicator it wraps. docs/gpu.md is the user's view;
// the thread and stream rules are in include/cohort/gpu.h. Private to src/gpu: programs reach it
// through make_device_communicator and the functions of cohort/gpu.h.
//
// One class, one file per part of its work:
//   device_communicator.cc  set-up, the path choice, which side a buffer is on, the operations
//   nccl_calls.cc           the NCCL handle: creating it, queuing work on it, aborting it
//   inflight.cc             operations in flight: their handles, the watchdog, the first failure
//   staging.cc              the staged path (device buffers copied through pinned host memory)
//   device_status.cc        what this host has (status, the doctor's local check, the local GPU)
//   device_api.cc           the rest of cohort/gpu.h: streams, markers, device memory
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "cohort/communicator.h"
#include "cohort/gpu.h"
#include "common/deadline.h"
#include "gpu/runtime.h"

namespace cohort::gpu::impl {

using Millis = std::chrono::milliseconds;

int nccl_dtype(DataType t);
int nccl_op(ReduceOp op);  // cohort numbers min before max; NCCL the other way round
void check_nccl_call(int rc, const char* what);

// Makes `device` current on the calling thread for the guard's lifetime (CUDA's current device is
// per thread, and the caller's choice is restored).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool restore_ = false;
};

// The handle of an operation that completed before it was returned (host buffers, the staged path).
class DoneWork final : public Work {
 public:
  void wait(Millis) override {}
  bool test() override { return true; }
  std::exception_ptr exception() override { return nullptr; }
};

class DeviceCommunicator;

// One operation queued on the communicator's stream, shared by its Work (if the caller kept one) and
// the watchdog, which follows it until its end event has fired. Owns the events.
struct Inflight {
  void* end = nullptr;    // recorded on the communicator's stream after the operation
  void* start = nullptr;  // recorded before it, when GPU timing is on
  std::string what;       // "allreduce of 1024 bytes"
  std::chrono::milliseconds timeout{0};
  std::chrono::steady_clock::time_point deadline;
  Inflight() = default;
  Inflight(const Inflight&) = delete;
  Inflight& operator=(const Inflight&) = delete;
  ~Inflight();
};

// The caller's handle on an operation. wait() orders the caller's current stream after it (no host
// block), synchronize() blocks the host until it ends, test() polls; all three see NCCL's
// asynchronous errors and the operation's deadline (include/cohort/gpu.h).
class DeviceWork final : public Work {
 public:
  DeviceWork(std::shared_ptr<DeviceCommunicator> owner, std::shared_ptr<Inflight> op)
      : owner_(std::move(owner)), op_(std::move(op)) {}
  void wait(Millis timeout) override;
  void synchronize(Millis timeout) override;
  bool test() override;
  std::exception_ptr exception() override;
  std::optional<GpuInterval> interval(void* marker);

 private:
  std::shared_ptr<DeviceCommunicator> owner_;
  std::shared_ptr<Inflight> op_;
  std::mutex mu_;
  bool done_ = false;
  std::exception_ptr error_;
};

class DeviceCommunicator final : public Communicator, public std::enable_shared_from_this<DeviceCommunicator> {
 public:
  DeviceCommunicator(std::shared_ptr<Communicator> host, int device) : host_(std::move(host)), device_(device) {}
  ~DeviceCommunicator() override;

  // Collective: chooses the path, creates the stream and, for NCCL, the NCCL communicator and its
  // watchdog (device_communicator.cc).
  void init(DevicePath wanted);

  void enable_timing() { timing_ = true; }
  bool timing() const { return timing_; }
  std::string path_name() const { return path_ == DevicePath::kNccl ? "nccl" : "staged"; }
  const std::string& why() const { return why_; }
  DevicePath path() const { return path_; }
  int device() const { return device_; }

  // ---- Communicator: identity (the host communicator's) ----
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  int local_rank() const override { return host_->local_rank(); }
  int local_size() const override { return host_->local_size(); }
  std::string host_of(int r) const override { return host_->host_of(r); }
  const CommOptions& options() const override { return host_->options(); }

  // ---- collectives: device buffers here, host buffers to the host communicator (device_communicator.cc) ----
  void allreduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) override;
  void reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op, int root) override;
  void broadcast(void* buf, size_t count, DataType dtype, int root) override;
  void allgather(const void* send, void* recv, size_t count, DataType dtype) override;
  void allgatherv(const void* send, size_t send_count, void* recv, const std::vector<size_t>& recv_counts,
                  DataType dtype) override;
  void gather(const void* send, void* recv, size_t count, DataType dtype, int root) override;
  void scatter(const void* send, void* recv, size_t count, DataType dtype, int root) override;
  void reduce_scatter(const void* send, void* recv, size_t recv_count, DataType dtype, ReduceOp op) override;
  void alltoall(const void* send, void* recv, size_t count, DataType dtype) override;
  void alltoallv(const void* send, const std::vector<size_t>& send_counts, const std::vector<size_t>& send_displs,
                 void* recv, const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_displs,
                 DataType dtype) override;
  void barrier() override;
  void send(const void* buf, size_t count, DataType dtype, int peer, uint32_t tag) override;
  void recv(void* buf, size_t count, DataType dtype, int peer, uint32_t tag) override;
  int recv_any(void* buf, size_t count, DataType dtype, uint32_t tag) override;
  std::shared_ptr<Work> send_async(const void* buf, size_t count, DataType dtype, int peer, uint32_t tag) override;
  std::shared_ptr<Work> recv_async(void* buf, size_t count, DataType dtype, int peer, uint32_t tag) override;

  // ---- asynchronous: NCCL work returns a handle on its event; staged work completes at once ----
  std::shared_ptr<Work> allreduce_async(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) override;
  std::shared_ptr<Work> broadcast_async(void* buf, size_t count, DataType dtype, int root) override;
  std::shared_ptr<Work> allgather_async(const void* send, void* recv, size_t count, DataType dtype) override;
  std::shared_ptr<Work> reduce_scatter_async(const void* send, void* recv, size_t recv_count, DataType dtype,
                                             ReduceOp op) override;
  std::shared_ptr<Work> barrier_async() override;

  // ---- groups: the host communicator splits, then the new group builds its own NCCL communicator ----
  std::shared_ptr<Communicator> split(int color, int key) override;
  std::shared_ptr<Communicator> subgroup(const std::vector<int>& ranks) override;

  void abort(const std::string& reason) override;
  std::shared_ptr<void> allocate_shared(size_t bytes) override { return host_->allocate_shared(bytes); }

  // ---- what DeviceWork and the functions of cohort/gpu.h call (inflight.cc) ----
  void order_after(const Inflight& op);
  void synchronize_op(const Inflight& op, Millis timeout);
  bool poll(const Inflight& op) { return poll(op, Deadline(op.deadline), op.timeout); }
  bool poll(const Inflight& op, const Deadline& deadline, Millis limit);
  std::optional<GpuInterval> interval(const Inflight& op, void* marker);
  void synchronize_all();
  std::exception_ptr failure() const;

 private:
  // ---- failure (inflight.cc) ----
  bool record_failure(const std::string& message, std::exception_ptr error);
  template <typename E>
  [[noreturn]] void fail(const std::string& message) {
    if (record_failure(message, std::make_exception_ptr(E(message)))) host_->abort(message);
    throw E(message);
  }
  void rethrow_failure();
  void check_failed();
  void check_async_error(const std::string& what);
  [[noreturn]] void fail_async(int async, const std::string& text, const std::string& what);
  std::string timeout_message(const std::string& what, Millis limit) const;

  // ---- the watchdog (inflight.cc) ----
  void watchdog_loop();
  void follow(std::shared_ptr<Inflight> op);
  void stop_watchdog();

  // ---- the NCCL handle and its abort (nccl_calls.cc) ----
  // The abort must never wait for a lock that an NCCL call can hold: a call that hangs (a lazy
  // connection to a dead peer, on a blocking communicator) would lock out the very abort that ends
  // it. So no lock is held across NCCL calls but calls_mu_, shared by every thread inside a call
  // with the handle, and the abort only tries it: it drops the handle (no call starts after that),
  // gives the calls in flight a moment to leave (on a non-blocking communicator each returns at
  // once, so normally none uses the handle while ncclCommAbort frees it), and aborts regardless when
  // one is still inside NCCL after that: that call is hung, and ncclCommAbort is what ends it.
  static constexpr Millis kAbortGrace{100};
  // ncclCommAbort itself can block for as long as the GPU is busy: it frees the communicator's device
  // memory, and freeing waits for the device. A collective stuck behind other work on the GPU (a hung
  // kernel, a host function) holds it there: on an H200 with NCCL 2.28 the deadline passed at 3 s and
  // the abort returned at 60 s, when the stream it waited for ran again. So the abort runs on a thread
  // of its own, and the failing call waits for it at most kAbortWait before it throws its error; the
  // communicator is unusable from the moment the handle is dropped, so nothing needs the abort done.
  static constexpr Millis kAbortWait{500};
  // Runs f(handle) as one thread inside NCCL; false (f not run) once the communicator is aborted.
  template <typename F>
  bool with_comm(F&& f) {
    std::shared_lock<std::shared_timed_mutex> calls(calls_mu_);
    void* comm = comm_.load();
    if (!comm) return false;
    f(comm);
    return true;
  }
  void abort_nccl();
  static constexpr int kAborted = -2;
  int wait_ready(const Deadline& deadline);
  static int nccl_version();
  void init_nccl();
  std::string setup_timeout_message() const;
  void init_nonblocking(const NcclUniqueId& id);
  void init_blocking(const NcclUniqueId& id);
  using Enqueue = std::function<int(void* comm, void* stream)>;
  using Then = std::function<int(void* stream)>;
  void run_nccl(const std::string& what, size_t bytes, const Enqueue& enqueue, bool grouped = false,
                const Then& then = nullptr);
  std::shared_ptr<Work> queue_nccl(const std::string& what_op, size_t bytes, const Enqueue& enqueue,
                                   bool grouped = false, const Then& then = nullptr);
  int order_after_caller_locked();
  int copy_on_stream(void* dst, const void* src, size_t bytes, void* stream);
  bool stream_drained(Millis limit);
  void wait_stream(const std::string& what);
  const void* nccl_allgather_input(const void* send, void* recv, size_t block_bytes) const;
  int nccl_reduce_scatter(const void* send, void* recv, size_t recv_count, DataType dtype, ReduceOp op, void* comm,
                          void* stream);
  Then in_place_reduce_scatter_copy(const void* send, void* recv, size_t recv_count, DataType dtype);

  // ---- the staged path (staging.cc) ----
  using HostOp = std::function<void(const void* host_in, void* host_out)>;
  void staged_op(const void* in, size_t in_bytes, void* out, size_t out_bytes, const HostOp& host_op);
  void ensure_staging(size_t bytes);
  std::shared_ptr<Work> run_now(const std::function<void()>& f);

  // ---- checks and the path (device_communicator.cc) ----
  void check_root(int root) const;
  void check_op(DataType dtype, ReduceOp op) const;
  void check_p2p(int peer, uint32_t tag) const;
  bool staged() const { return path_ == DevicePath::kStaged; }
  bool where(const char* op, size_t count, std::initializer_list<const void*> buffers);
  DevicePath choose_path(DevicePath wanted);
  std::shared_ptr<Communicator> child(std::shared_ptr<Communicator> h);

  std::shared_ptr<Communicator> host_;
  const int device_;
  DevicePath path_ = DevicePath::kStaged;
  std::string why_;
  void* stream_ = nullptr;  // non-blocking, on device_
  void* ready_ = nullptr;   // re-recorded on the caller's stream before each operation
  std::atomic<bool> timing_{false};  // operations record timed start and end events (COHORT_GPU_TIMING, enable_timing)
  mutable std::mutex mu_;   // the failure state below; no NCCL call is made under it
  std::mutex enqueue_mu_;   // one thread queuing work at a time (queue_nccl, staged_op): NCCL's call order, ready_
  std::shared_timed_mutex calls_mu_;  // shared by each NCCL call with comm_, tried by its abort (abort_nccl)
  std::atomic<void*> comm_{nullptr};  // ncclComm_t (NCCL path); null once aborted or destroyed
  bool blocking_ = true;    // the communicator is blocking (an NCCL without ncclCommInitRankConfig)
  bool failed_ = false;
  std::string failure_;
  std::exception_ptr failure_error_;  // the first failure, as thrown
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  bool watch_stop_ = false;
  std::deque<std::shared_ptr<Inflight>> inflight_;  // queued NCCL operations not yet seen to end, oldest first
  std::thread watchdog_;
  std::mutex staging_mu_;
  void* staging_ = nullptr;
  size_t staging_bytes_ = 0;
};

}  // namespace cohort::gpu::impl
