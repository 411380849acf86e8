// DeviceCommunicator: cohort::Communicator for CUDA device buffers (NCCL, or staged through host
// memory) that hands host buffers to the host communicator it wraps. docs/gpu.md is the user's view;
// the thread and stream rules are in include/cohort/gpu.h.
#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <thread>

#include "cohort/error.h"
#include "cohort/gpu.h"
#include "common/deadline.h"
#include "common/env.h"
#include "common/log.h"
#include "gpu/runtime.h"

namespace cohort::gpu {
namespace {

using Millis = std::chrono::milliseconds;

const env::StringSetting kGpuPath("COHORT_GPU_PATH", "auto",
                                  "GPU buffers: auto (NCCL when every rank has its own GPU and NCCL), nccl, or staged "
                                  "(copied through host memory and cohort's CPU collectives)");

const env::BoolSetting kGpuTiming("COHORT_GPU_TIMING", false,
                                  "GPU collectives record timed CUDA events (their start and end on the GPU, for "
                                  "the timeline's overlap figures)");

int nccl_dtype(DataType t) {
  switch (t) {
    case DataType::kInt8: return kNcclInt8;
    case DataType::kUInt8: return kNcclUint8;
    case DataType::kInt32: return kNcclInt32;
    case DataType::kInt64: return kNcclInt64;
    case DataType::kFloat16: return kNcclFloat16;
    case DataType::kBFloat16: return kNcclBfloat16;
    case DataType::kFloat32: return kNcclFloat32;
    case DataType::kFloat64: return kNcclFloat64;
  }
  return kNcclFloat32;
}

// cohort numbers min before max; NCCL the other way round.
int nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return kNcclSum;
    case ReduceOp::kProd: return kNcclProd;
    case ReduceOp::kMin: return kNcclMin;
    case ReduceOp::kMax: return kNcclMax;
    case ReduceOp::kAvg: return kNcclAvg;
  }
  return kNcclSum;
}

// Makes `device` current on the calling thread for the guard's lifetime (CUDA's current device is
// per thread, and the caller's choice is restored).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    const CudaApi& c = cuda();
    check_cuda(c.GetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda(c.SetDevice(device), fmt::format("cudaSetDevice({})", device));
    restore_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (restore_) cuda().SetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool restore_ = false;
};

void check_nccl_call(int rc, const char* what) {
  if (rc != kNcclSuccess) throw Error(std::string(what) + ": " + nccl_error_text(rc));
}

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
  ~Inflight() {
    if (end) cuda().EventDestroy(end);
    if (start) cuda().EventDestroy(start);
  }
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
  ~DeviceCommunicator() override {
    stop_watchdog();
    if (void* comm = comm_.exchange(nullptr)) {
      // ncclCommDestroy flushes outstanding work and would wait forever for a peer that is gone:
      // give queued work a bounded time (no more than 10 s) and abort instead when it does not end.
      // A non-blocking communicator is aborted even then: its ncclCommDestroy may answer
      // ncclInProgress, and with the stream drained there is nothing left for it to flush.
      if (blocking_ && stream_drained(std::min<Millis>(options().timeout, std::chrono::seconds(10))))
        nccl_api().CommDestroy(comm);
      else
        nccl_api().CommAbort(comm);
    }
    if (ready_) cuda().EventDestroy(ready_);
    if (staging_) cuda().FreeHost(staging_);
    if (stream_) cuda().StreamDestroy(stream_);
  }

  // Collective: chooses the path, creates the stream and, for NCCL, the NCCL communicator and its
  // watchdog. The stream is non-blocking: it never waits for the legacy default stream, nor that
  // stream for it, so that compute queued after a collective does not wait for it (overlap); each
  // operation waits instead for what the caller's stream had queued when it was called.
  void init(DevicePath wanted) {
    const CudaApi& c = cuda();
    DeviceGuard guard(device_);
    check_cuda(c.StreamCreateWithFlags(&stream_, kCudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    check_cuda(c.EventCreateWithFlags(&ready_, kCudaEventDisableTiming), "cudaEventCreateWithFlags");
    timing_ = kGpuTiming.get();
    path_ = choose_path(wanted);
    if (path_ == DevicePath::kNccl) {
      init_nccl();
      watchdog_ = std::thread([this] { watchdog_loop(); });
    } else {
      log::warn("GPU buffers go through host memory ({}): each operation copies them to the host and back", why_);
    }
    log::debug("device communicator: rank {} on GPU {}, path {} ({})", rank(), device_, path_name(), why_);
  }

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

  // ---- collectives: device buffers here, host buffers to the host communicator ----
  void allreduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) override {
    if (!where("allreduce", count, {send, recv})) return host_->allreduce(send, recv, count, dtype, op);
    check_op(dtype, op);
    const size_t bytes = count * dtype_size(dtype);
    if (staged()) {
      return staged_op(send, bytes, recv, bytes, [&](const void* in, void* out) {
        host_->allreduce(in, out, count, dtype, op);
      });
    }
    run_nccl("allreduce", bytes, [&](void* comm, void* s) {
      return nccl_api().AllReduce(send, recv, count, nccl_dtype(dtype), nccl_op(op), comm, s);
    });
  }

  void reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op, int root) override {
    check_root(root);
    const bool is_root = rank() == root;
    if (!where("reduce", count, {send, is_root ? recv : nullptr})) return host_->reduce(send, recv, count, dtype, op, root);
    check_op(dtype, op);
    const size_t bytes = count * dtype_size(dtype);
    if (staged()) {
      return staged_op(send, bytes, is_root ? recv : nullptr, is_root ? bytes : 0, [&](const void* in, void* out) {
        host_->reduce(in, out, count, dtype, op, root);
      });
    }
    run_nccl("reduce", bytes, [&](void* comm, void* s) {
      return nccl_api().Reduce(send, recv, count, nccl_dtype(dtype), nccl_op(op), root, comm, s);
    });
  }

  void broadcast(void* buf, size_t count, DataType dtype, int root) override {
    check_root(root);
    if (!where("broadcast", count, {buf})) return host_->broadcast(buf, count, dtype, root);
    const size_t bytes = count * dtype_size(dtype);
    if (staged()) {
      // Only the root's data matters on the way in.
      return staged_op(rank() == root ? buf : nullptr, rank() == root ? bytes : 0, buf, bytes,
                       [&](const void*, void* out) { host_->broadcast(out, count, dtype, root); });
    }
    run_nccl("broadcast", bytes, [&](void* comm, void* s) {
      return nccl_api().Broadcast(buf, buf, count, nccl_dtype(dtype), root, comm, s);
    });
  }

  void allgather(const void* send, void* recv, size_t count, DataType dtype) override {
    if (!where("allgather", count, {send, recv})) return host_->allgather(send, recv, count, dtype);
    const size_t bytes = count * dtype_size(dtype);
    const size_t total = bytes * static_cast<size_t>(size());
    if (staged()) {
      // In place, this rank's contribution sits at its block of recv: the whole of recv goes to the host.
      const bool in_place = send == recv;
      return staged_op(send, in_place ? total : bytes, recv, total, [&](const void* in, void* out) {
        host_->allgather(in, out, count, dtype);
      });
    }
    run_nccl("allgather", total, [&](void* comm, void* s) {
      return nccl_api().AllGather(nccl_allgather_input(send, recv, bytes), recv, count, nccl_dtype(dtype), comm, s);
    });
  }

  void allgatherv(const void* send, size_t send_count, void* recv, const std::vector<size_t>& recv_counts,
                  DataType dtype) override {
    size_t total = 0;
    for (size_t n : recv_counts) total += n;
    if (recv_counts.size() != static_cast<size_t>(size()))
      throw InvalidArgument(fmt::format("allgatherv: {} receive counts for {} ranks", recv_counts.size(), size()));
    if (!where("allgatherv", total, {send_count ? send : nullptr, recv}))
      return host_->allgatherv(send, send_count, recv, recv_counts, dtype);
    const size_t es = dtype_size(dtype);
    if (staged()) {
      return staged_op(send, send_count * es, recv, total * es, [&](const void* in, void* out) {
        host_->allgatherv(in, send_count, out, recv_counts, dtype);
      });
    }
    // NCCL has no allgatherv: one broadcast per rank into its slice, in one group (NCCL's own advice).
    run_nccl("allgatherv", total * es, [&](void* comm, void* s) {
      size_t offset = 0;
      for (int r = 0; r < size(); ++r) {
        const void* from = r == rank() ? send : nullptr;
        char* to = static_cast<char*>(recv) + offset * es;
        int rc = nccl_api().Broadcast(r == rank() ? from : to, to, recv_counts[r], nccl_dtype(dtype), r, comm, s);
        if (rc != kNcclSuccess) return rc;
        offset += recv_counts[r];
      }
      return kNcclSuccess;
    }, /*grouped=*/true);
  }

  void gather(const void* send, void* recv, size_t count, DataType dtype, int root) override {
    check_root(root);
    const bool is_root = rank() == root;
    if (!where("gather", count, {send, is_root ? recv : nullptr})) return host_->gather(send, recv, count, dtype, root);
    const size_t bytes = count * dtype_size(dtype);
    if (staged()) {
      return staged_op(send, bytes, is_root ? recv : nullptr, is_root ? bytes * size() : 0,
                       [&](const void* in, void* out) { host_->gather(in, out, count, dtype, root); });
    }
    run_nccl("gather", bytes, [&](void* comm, void* s) {
      if (!is_root) return nccl_api().Send(send, count, nccl_dtype(dtype), root, comm, s);
      for (int r = 0; r < size(); ++r) {
        char* to = static_cast<char*>(recv) + bytes * static_cast<size_t>(r);
        int rc = r == rank() ? copy_on_stream(to, send, bytes, s)
                             : nccl_api().Recv(to, count, nccl_dtype(dtype), r, comm, s);
        if (rc != kNcclSuccess) return rc;
      }
      return kNcclSuccess;
    }, true);
  }

  void scatter(const void* send, void* recv, size_t count, DataType dtype, int root) override {
    check_root(root);
    const bool is_root = rank() == root;
    if (!where("scatter", count, {is_root ? send : nullptr, recv})) return host_->scatter(send, recv, count, dtype, root);
    const size_t bytes = count * dtype_size(dtype);
    if (staged()) {
      return staged_op(is_root ? send : nullptr, is_root ? bytes * size() : 0, recv, bytes,
                       [&](const void* in, void* out) { host_->scatter(in, out, count, dtype, root); });
    }
    run_nccl("scatter", bytes, [&](void* comm, void* s) {
      if (!is_root) return nccl_api().Recv(recv, count, nccl_dtype(dtype), root, comm, s);
      for (int r = 0; r < size(); ++r) {
        const char* from = static_cast<const char*>(send) + bytes * static_cast<size_t>(r);
        int rc = r == rank() ? copy_on_stream(recv, from, bytes, s)
                             : nccl_api().Send(from, count, nccl_dtype(dtype), r, comm, s);
        if (rc != kNcclSuccess) return rc;
      }
      return kNcclSuccess;
    }, true);
  }

  void reduce_scatter(const void* send, void* recv, size_t recv_count, DataType dtype, ReduceOp op) override {
    if (!where("reduce_scatter", recv_count, {send, recv}))
      return host_->reduce_scatter(send, recv, recv_count, dtype, op);
    check_op(dtype, op);
    const size_t bytes = recv_count * dtype_size(dtype);
    if (staged()) {
      return staged_op(send, bytes * size(), recv, bytes, [&](const void* in, void* out) {
        host_->reduce_scatter(in, out, recv_count, dtype, op);
      });
    }
    run_nccl("reduce_scatter", bytes * size(), [&](void* comm, void* s) {
      return nccl_reduce_scatter(send, recv, recv_count, dtype, op, comm, s);
    }, false, in_place_reduce_scatter_copy(send, recv, recv_count, dtype));
  }

  void alltoall(const void* send, void* recv, size_t count, DataType dtype) override {
    const size_t n = static_cast<size_t>(size());
    std::vector<size_t> counts(n, count), displs(n);
    for (size_t r = 0; r < n; ++r) displs[r] = r * count;
    alltoallv(send, counts, displs, recv, counts, displs, dtype);
  }

  void alltoallv(const void* send, const std::vector<size_t>& send_counts, const std::vector<size_t>& send_displs,
                 void* recv, const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_displs,
                 DataType dtype) override {
    const size_t n = static_cast<size_t>(size());
    if (send_counts.size() != n || send_displs.size() != n || recv_counts.size() != n || recv_displs.size() != n)
      throw InvalidArgument(fmt::format("alltoallv: counts and displacements must have one entry per rank ({})", n));
    size_t send_extent = 0, recv_extent = 0;
    for (size_t r = 0; r < n; ++r) {
      send_extent = std::max(send_extent, send_displs[r] + send_counts[r]);
      recv_extent = std::max(recv_extent, recv_displs[r] + recv_counts[r]);
    }
    if (!where("alltoallv", std::max(send_extent, recv_extent), {send_extent ? send : nullptr, recv_extent ? recv : nullptr}))
      return host_->alltoallv(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype);
    const size_t es = dtype_size(dtype);
    const size_t me = static_cast<size_t>(rank());
    if (send_counts[me] != recv_counts[me])
      throw InvalidArgument(fmt::format("alltoallv: rank {} sends itself {} elements but expects {}", rank(),
                                        send_counts[me], recv_counts[me]));
    if (staged()) {
      return staged_op(send, send_extent * es, recv, recv_extent * es, [&](const void* in, void* out) {
        host_->alltoallv(in, send_counts, send_displs, out, recv_counts, recv_displs, dtype);
      });
    }
    run_nccl("alltoallv", (send_extent + recv_extent) * es, [&](void* comm, void* s) {
      for (size_t r = 0; r < n; ++r) {
        const char* from = static_cast<const char*>(send) + send_displs[r] * es;
        char* to = static_cast<char*>(recv) + recv_displs[r] * es;
        int rc = kNcclSuccess;
        if (r == me) {
          rc = copy_on_stream(to, from, send_counts[r] * es, s);
        } else {
          if (send_counts[r]) rc = nccl_api().Send(from, send_counts[r], nccl_dtype(dtype), static_cast<int>(r), comm, s);
          if (rc == kNcclSuccess && recv_counts[r])
            rc = nccl_api().Recv(to, recv_counts[r], nccl_dtype(dtype), static_cast<int>(r), comm, s);
        }
        if (rc != kNcclSuccess) return rc;
      }
      return kNcclSuccess;
    }, true);
  }

  // Waits for this rank's queued device work, then meets the others on the host.
  void barrier() override {
    if (path_ == DevicePath::kNccl) check_failed();
    if (stream_) wait_stream("barrier");
    host_->barrier();
  }

  void send(const void* buf, size_t count, DataType dtype, int peer, uint32_t tag) override {
    if (!where("send", count, {buf})) return host_->send(buf, count, dtype, peer, tag);
    check_p2p(peer, tag);
    const size_t bytes = count * dtype_size(dtype);
    if (staged()) return staged_op(buf, bytes, nullptr, 0, [&](const void* in, void*) { host_->send(in, count, dtype, peer, tag); });
    run_nccl("send", bytes, [&](void* comm, void* s) { return nccl_api().Send(buf, count, nccl_dtype(dtype), peer, comm, s); });
  }

  void recv(void* buf, size_t count, DataType dtype, int peer, uint32_t tag) override {
    if (!where("recv", count, {buf})) return host_->recv(buf, count, dtype, peer, tag);
    check_p2p(peer, tag);
    const size_t bytes = count * dtype_size(dtype);
    if (staged()) return staged_op(nullptr, 0, buf, bytes, [&](const void*, void* out) { host_->recv(out, count, dtype, peer, tag); });
    run_nccl("recv", bytes, [&](void* comm, void* s) { return nccl_api().Recv(buf, count, nccl_dtype(dtype), peer, comm, s); });
  }

  // Host memory: the host communicator's. NCCL has no receive from any source (nor has torch's NCCL
  // backend), and a host-side one could never match a peer's device send.
  int recv_any(void* buf, size_t count, DataType dtype, uint32_t tag) override {
    if (!where("recv", count, {buf})) return host_->recv_any(buf, count, dtype, tag);
    throw InvalidArgument("recv from any source: the buffer is GPU memory, and NCCL has no receive from any source; "
                          "name the sending rank, or receive into host memory");
  }

  // Non-blocking point to point. Host memory: the host communicator's. Device memory through NCCL:
  // queued on the communicator's stream like the other asynchronous operations (so a send queued
  // before the matching receive waits for it there, as ncclSend does); staged: done at once.
  std::shared_ptr<Work> send_async(const void* buf, size_t count, DataType dtype, int peer, uint32_t tag) override {
    if (!where("send", count, {buf})) return host_->send_async(buf, count, dtype, peer, tag);
    check_p2p(peer, tag);
    if (staged()) return run_now([&] { send(buf, count, dtype, peer, tag); });
    return queue_nccl("send", count * dtype_size(dtype), [&](void* comm, void* s) {
      return nccl_api().Send(buf, count, nccl_dtype(dtype), peer, comm, s);
    });
  }
  std::shared_ptr<Work> recv_async(void* buf, size_t count, DataType dtype, int peer, uint32_t tag) override {
    if (!where("recv", count, {buf})) return host_->recv_async(buf, count, dtype, peer, tag);
    check_p2p(peer, tag);
    if (staged()) return run_now([&] { recv(buf, count, dtype, peer, tag); });
    return queue_nccl("recv", count * dtype_size(dtype), [&](void* comm, void* s) {
      return nccl_api().Recv(buf, count, nccl_dtype(dtype), peer, comm, s);
    });
  }

  // ---- asynchronous: NCCL work returns a handle on its event; staged work completes at once ----
  std::shared_ptr<Work> allreduce_async(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) override {
    if (!where("allreduce", count, {send, recv})) return host_->allreduce_async(send, recv, count, dtype, op);
    check_op(dtype, op);
    const size_t bytes = count * dtype_size(dtype);
    if (staged()) return run_now([&] { allreduce(send, recv, count, dtype, op); });
    return queue_nccl("allreduce", bytes, [&](void* comm, void* s) {
      return nccl_api().AllReduce(send, recv, count, nccl_dtype(dtype), nccl_op(op), comm, s);
    });
  }
  std::shared_ptr<Work> broadcast_async(void* buf, size_t count, DataType dtype, int root) override {
    check_root(root);
    if (!where("broadcast", count, {buf})) return host_->broadcast_async(buf, count, dtype, root);
    if (staged()) return run_now([&] { broadcast(buf, count, dtype, root); });
    return queue_nccl("broadcast", count * dtype_size(dtype), [&](void* comm, void* s) {
      return nccl_api().Broadcast(buf, buf, count, nccl_dtype(dtype), root, comm, s);
    });
  }
  std::shared_ptr<Work> allgather_async(const void* send, void* recv, size_t count, DataType dtype) override {
    if (!where("allgather", count, {send, recv})) return host_->allgather_async(send, recv, count, dtype);
    if (staged()) return run_now([&] { allgather(send, recv, count, dtype); });
    return queue_nccl("allgather", count * dtype_size(dtype) * size(), [&](void* comm, void* s) {
      return nccl_api().AllGather(nccl_allgather_input(send, recv, count * dtype_size(dtype)), recv, count,
                                  nccl_dtype(dtype), comm, s);
    });
  }
  std::shared_ptr<Work> reduce_scatter_async(const void* send, void* recv, size_t recv_count, DataType dtype,
                                             ReduceOp op) override {
    if (!where("reduce_scatter", recv_count, {send, recv}))
      return host_->reduce_scatter_async(send, recv, recv_count, dtype, op);
    check_op(dtype, op);
    if (staged()) return run_now([&] { reduce_scatter(send, recv, recv_count, dtype, op); });
    return queue_nccl("reduce_scatter", recv_count * dtype_size(dtype) * size(), [&](void* comm, void* s) {
      return nccl_reduce_scatter(send, recv, recv_count, dtype, op, comm, s);
    }, false, in_place_reduce_scatter_copy(send, recv, recv_count, dtype));
  }
  std::shared_ptr<Work> barrier_async() override {
    if (path_ == DevicePath::kNccl) check_failed();
    if (stream_) wait_stream("barrier");
    return host_->barrier_async();
  }

  // ---- groups: the host communicator splits, then the new group builds its own NCCL communicator ----
  std::shared_ptr<Communicator> split(int color, int key) override {
    auto h = host_->split(color, key);
    if (!h) return nullptr;
    return child(std::move(h));
  }
  std::shared_ptr<Communicator> subgroup(const std::vector<int>& ranks) override {
    auto h = host_->subgroup(ranks);
    if (!h) return nullptr;
    return child(std::move(h));
  }

  void abort(const std::string& reason) override {
    record_failure(reason, std::make_exception_ptr(AbortedError(reason)));
    host_->abort(reason);
  }

  std::shared_ptr<void> allocate_shared(size_t bytes) override { return host_->allocate_shared(bytes); }

  // ---- what DeviceWork calls ----

  // wait(): the caller's current stream waits for the operation's end (no host block). Errors known
  // now (the communicator failed, NCCL reported one, the deadline passed) are thrown here.
  void order_after(const Inflight& op) {
    if (poll(op)) return;  // already over: nothing to wait for
    DeviceGuard guard(device_);
    check_cuda(cuda().StreamWaitEvent(current_stream(device_), op.end, 0),
               fmt::format("cudaStreamWaitEvent (the caller's stream after {})", op.what));
  }

  // synchronize(): blocks until the operation has run, polling so that the deadline and NCCL's
  // asynchronous errors are seen. `timeout` 0: the operation's own deadline.
  void synchronize_op(const Inflight& op, Millis timeout) {
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
  bool poll(const Inflight& op) { return poll(op, Deadline(op.deadline), op.timeout); }
  bool poll(const Inflight& op, const Deadline& deadline, Millis limit) {
    rethrow_failure();  // an aborted communicator's kernels end early, their results unwritten
    const int rc = cuda().EventQuery(op.end);
    if (rc != kCudaSuccess && rc != kCudaErrorNotReady)
      fail<Error>(fmt::format("rank {} (GPU {}): {} failed on the GPU: {}", rank(), device_, op.what, cuda_error_text(rc)));
    // NCCL's asynchronous error is checked even when the event fired: a failed operation may still
    // let its kernel finish, with garbage in the buffer.
    check_async_error(op.what);
    if (rc == kCudaSuccess) return true;
    if (deadline.expired()) fail<TimeoutError>(timeout_message(op.what, limit));
    return false;
  }

  // For gpu::work_interval: milliseconds from `marker` to the operation's start and end.
  std::optional<GpuInterval> interval(const Inflight& op, void* marker) {
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
  void synchronize_all() {
    rethrow_failure();
    if (stream_) wait_stream("synchronize");
  }

  // The failure that ended this communicator, for an operation that had not finished by then.
  std::exception_ptr failure() const {
    std::lock_guard<std::mutex> lock(mu_);
    return failure_error_;
  }

 private:
  // Records the first failure and aborts NCCL, once. True for the first.
  bool record_failure(const std::string& message, std::exception_ptr error) {
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

  // ---- the NCCL handle and its abort ----
  // The abort must never wait for a lock that an NCCL call can hold: a call that hangs (a lazy
  // connection to a dead peer, on a blocking communicator) would lock out the very abort that ends
  // it. So no lock is held across NCCL calls but calls_mu_, shared by every thread inside a call
  // with the handle, and the abort only tries it: it drops the handle (no call starts after that),
  // gives the calls in flight a moment to leave (on a non-blocking communicator each returns at
  // once, so normally none uses the handle while ncclCommAbort frees it), and aborts regardless when
  // one is still inside NCCL after that: that call is hung, and ncclCommAbort is what ends it.
  static constexpr Millis kAbortGrace{100};

  // Runs f(handle) as one thread inside NCCL; false (f not run) once the communicator is aborted.
  template <typename F>
  bool with_comm(F&& f) {
    std::shared_lock<std::shared_timed_mutex> calls(calls_mu_);
    void* comm = comm_.load();
    if (!comm) return false;
    f(comm);
    return true;
  }

  void abort_nccl() {
    void* comm = comm_.exchange(nullptr);
    if (!comm) return;
    const bool alone = calls_mu_.try_lock_for(kAbortGrace);
    if (!alone) log::warn("rank {} (GPU {}): an NCCL call is still running after {} ms; aborting NCCL under it",
                          rank(), device_, kAbortGrace.count());
    nccl_api().CommAbort(comm);
    if (alone) calls_mu_.unlock();
  }

  // A non-blocking communicator's call answered ncclInProgress: NCCL finishes it on its own threads
  // (connecting to peers, queuing the kernels) and no other call may be made meanwhile. Polls its
  // state until it is no longer in progress (returned), the deadline passes (kNcclInProgress) or the
  // communicator is aborted (kAborted). No lock is held between polls: the watchdog can abort.
  static constexpr int kAborted = -2;
  int wait_ready(const Deadline& deadline) {
    for (int spins = 0;; ++spins) {
      int state = kNcclInProgress;
      if (!with_comm([&](void* comm) { nccl_api().CommGetAsyncError(comm, &state); })) return kAborted;
      if (state != kNcclInProgress) return state;
      if (deadline.expired()) return kNcclInProgress;
      if (spins < 200) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  template <typename E>
  [[noreturn]] void fail(const std::string& message) {
    if (record_failure(message, std::make_exception_ptr(E(message)))) host_->abort(message);
    throw E(message);
  }

  void rethrow_failure() {
    std::exception_ptr e = failure();
    if (e) std::rethrow_exception(e);
  }

  void check_failed() {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_) throw AbortedError("the GPU communicator failed earlier: " + failure_);
  }

  // NCCL's asynchronous error, read while the communicator lives; thrown, naming the operation,
  // after NCCL is aborted. ncclInProgress is no error: a call still finishing (non-blocking).
  void check_async_error(const std::string& what) {
    int async = kNcclSuccess;
    std::string text;
    with_comm([&](void* comm) {
      nccl_api().CommGetAsyncError(comm, &async);
      if (async != kNcclSuccess && async != kNcclInProgress) text = nccl_error_text(async, comm);
    });
    if (!text.empty()) fail_async(async, text, what);
  }
  [[noreturn]] void fail_async(int async, const std::string& text, const std::string& what) {
    const std::string msg = fmt::format("rank {} (GPU {}): NCCL reports an error during {}: {}", rank(), device_, what, text);
    // ncclSystemError / ncclRemoteError: a peer or the network failed.
    if (async == 2 || async == 6) fail<PeerLostError>(msg + " (a peer failed, or its network did)");
    fail<Error>(msg);
  }

  std::string timeout_message(const std::string& what, Millis limit) const {
    return fmt::format("rank {} (GPU {}): {} did not finish on the GPU within {} ms; the NCCL communicator was "
                       "aborted (a peer stopped calling, or its GPU hangs)",
                       rank(), device_, what, limit.count());
  }

  // ---- the watchdog (as c10d's ProcessGroupNCCL has): follows every queued operation, also those
  // nobody waits for (blocking calls return once their work is queued in stream order), and aborts
  // the communicator when one fails or passes its deadline, with one line naming rank, GPU and
  // operation. Without it a rank whose peer died would hang in its next host synchronisation.
  void watchdog_loop() {
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
  void follow(std::shared_ptr<Inflight> op) {
    if (!watchdog_.joinable()) return;
    std::lock_guard<std::mutex> lock(watch_mu_);
    inflight_.push_back(std::move(op));
  }
  void stop_watchdog() {
    {
      std::lock_guard<std::mutex> lock(watch_mu_);
      watch_stop_ = true;
    }
    watch_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
  }

  // The communicator's stream waits for what the caller's current stream has queued so far (the
  // kernels that wrote an operation's inputs). One event, re-recorded each time: cudaStreamWaitEvent
  // waits for the recording made before it. Under enqueue_mu_.
  int order_after_caller_locked() {
    const CudaApi& c = cuda();
    int rc = c.EventRecord(ready_, current_stream(device_));
    return rc != kCudaSuccess ? rc : c.StreamWaitEvent(stream_, ready_, 0);
  }

  void check_root(int root) const {
    if (root < 0 || root >= size()) throw InvalidArgument(fmt::format("root {} is not a rank (0..{})", root, size() - 1));
  }
  void check_op(DataType dtype, ReduceOp op) const {
    if (!op_supported(dtype, op))
      throw InvalidArgument(fmt::format("{} is not defined on {}", reduce_op_name(op), dtype_name(dtype)));
  }
  void check_p2p(int peer, uint32_t tag) const {
    if (peer < 0 || peer >= size() || peer == rank())
      throw InvalidArgument(fmt::format("send/recv: peer {} is not another rank (0..{})", peer, size() - 1));
    if (tag != 0 && path_ == DevicePath::kNccl)
      throw InvalidArgument(fmt::format("send/recv of GPU buffers: tag {} given, but NCCL has no tags (sends and "
                                        "receives between two ranks match in the order they are made); use tag 0",
                                        tag));
  }
  bool staged() const { return path_ == DevicePath::kStaged; }

  // True when the buffers are GPU memory (of this communicator's device), false when they are host
  // memory; InvalidArgument when they are mixed or on another GPU. `count` 0 is host (nothing moves).
  bool where(const char* op, size_t count, std::initializer_list<const void*> buffers) {
    if (count == 0) return false;
    int device_buffers = 0, host_buffers = 0;
    for (const void* p : buffers) {
      if (!p) continue;
      CudaPointerAttributes a;
      int rc = cuda().PointerGetAttributes(&a, p);
      if (rc != kCudaSuccess) {
        cuda().GetLastError();  // an unknown host pointer on old runtimes: it is host memory
        ++host_buffers;
        continue;
      }
      if (a.type == kCudaMemoryDevice || a.type == kCudaMemoryManaged) {
        if (a.device != device_)
          throw InvalidArgument(fmt::format("{}: a buffer is on GPU {} but rank {} communicates on GPU {}", op,
                                            a.device, rank(), device_));
        ++device_buffers;
      } else {
        ++host_buffers;
      }
    }
    if (device_buffers && host_buffers)
      throw InvalidArgument(fmt::format("{}: some buffers are in GPU memory and some in host memory; pass all of "
                                        "them on one side",
                                        op));
    if (device_buffers) check_failed();
    return device_buffers > 0;
  }

  // Queues `enqueue(comm, stream)` (between ncclGroupStart/End when grouped) and orders the
  // caller's stream after it: a blocking call in stream order, as ProcessGroupNCCL's.
  template <typename F>
  void run_nccl(const std::string& what, size_t bytes, F&& enqueue, bool grouped = false,
                std::function<int(void*)> then = nullptr) {
    auto work = queue_nccl(what, bytes, std::forward<F>(enqueue), grouped, std::move(then));
    work->wait(Millis(0));
  }

  // cohort's in-place forms (send == recv, include/cohort/communicator.h) in NCCL's terms. NCCL's
  // in-place allgather passes this rank's block of recv as the input, which is where cohort's
  // in-place contribution already is.
  const void* nccl_allgather_input(const void* send, void* recv, size_t block_bytes) const {
    if (send != recv) return send;
    return static_cast<const char*>(recv) + static_cast<size_t>(rank()) * block_bytes;
  }
  // NCCL's in-place reduce-scatter leaves the result in this rank's block of the input; cohort's in
  // the first block: one copy on the same stream moves it (for rank r > 0 the blocks do not overlap).
  // The copy is queue_nccl's `then` step: it must follow NCCL's kernel on the stream, which a
  // non-blocking communicator queues only when the call is no longer in progress.
  int nccl_reduce_scatter(const void* send, void* recv, size_t recv_count, DataType dtype, ReduceOp op, void* comm,
                          void* stream) {
    if (send != recv) return nccl_api().ReduceScatter(send, recv, recv_count, nccl_dtype(dtype), nccl_op(op), comm, stream);
    char* mine = static_cast<char*>(recv) + static_cast<size_t>(rank()) * recv_count * dtype_size(dtype);
    return nccl_api().ReduceScatter(send, mine, recv_count, nccl_dtype(dtype), nccl_op(op), comm, stream);
  }
  std::function<int(void*)> in_place_reduce_scatter_copy(const void* send, void* recv, size_t recv_count,
                                                         DataType dtype) {
    const size_t bytes = recv_count * dtype_size(dtype);
    char* mine = static_cast<char*>(recv) + static_cast<size_t>(rank()) * bytes;
    if (send != recv || mine == recv) return nullptr;
    return [this, recv, mine, bytes](void* stream) { return copy_on_stream(recv, mine, bytes, stream); };
  }

  // Queues `enqueue(comm, stream)` (between ncclGroupStart/End when grouped), then `then(stream)`
  // (CUDA work that must follow NCCL's kernels), and the operation's end event. One enqueuing thread
  // at a time (enqueue_mu_): NCCL's calls on a communicator must not interleave, and a non-blocking
  // communicator takes no call while one is in progress. The watchdog never needs enqueue_mu_.
  template <typename F>
  std::shared_ptr<Work> queue_nccl(const std::string& what_op, size_t bytes, F&& enqueue, bool grouped = false,
                                   const std::function<int(void*)>& then = nullptr) {
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

  std::shared_ptr<Work> run_now(const std::function<void()>& f) {
    f();
    return std::make_shared<DoneWork>();
  }

  int copy_on_stream(void* dst, const void* src, size_t bytes, void* stream) {
    if (bytes == 0) return kNcclSuccess;
    int rc = cuda().MemcpyAsync(dst, src, bytes, kCudaMemcpyDefault, stream);
    return rc == kCudaSuccess ? kNcclSuccess : 1;  // ncclUnhandledCudaError
  }

  // True when everything queued on the stream has run within `limit`; never throws (destructor).
  bool stream_drained(Millis limit) {
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
  void wait_stream(const std::string& what) {
    DeviceGuard guard(device_);
    Inflight marker;
    marker.what = what;
    marker.timeout = options().timeout;
    marker.deadline = std::chrono::steady_clock::now() + marker.timeout;
    check_cuda(cuda().EventCreateWithFlags(&marker.end, kCudaEventDisableTiming), "cudaEventCreateWithFlags");
    check_cuda(cuda().EventRecord(marker.end, stream_), "cudaEventRecord");
    synchronize_op(marker, Millis(0));
  }

  // Staged path: `in_bytes` of `in` copied to pinned host memory, `host_op(host_in, host_out)` run
  // by the host communicator, `out_bytes` copied back to `out`. When in == out the op runs in place.
  template <typename F>
  void staged_op(const void* in, size_t in_bytes, void* out, size_t out_bytes, F&& host_op) {
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

  void ensure_staging(size_t bytes) {
    if (bytes <= staging_bytes_) return;
    if (staging_) cuda().FreeHost(staging_);
    staging_ = nullptr;
    staging_bytes_ = 0;
    size_t want = std::max<size_t>(bytes, 1 << 20);
    check_cuda(cuda().MallocHost(&staging_, want), fmt::format("cudaMallocHost of {} bytes for staging", want));
    staging_bytes_ = want;
  }

  // Every rank: NCCL loaded? which GPU (bus id)? Gathered over the host communicator so that all ranks
  // take the same path, and a rank that cannot use NCCL is named.
  DevicePath choose_path(DevicePath wanted) {
    struct Record {
      char nccl_ok;
      char bus_id[63];
    };
    Record mine{};
    mine.nccl_ok = nccl().api ? 1 : 0;
    cuda().DeviceGetPCIBusId(mine.bus_id, sizeof mine.bus_id - 1, device_);
    std::vector<Record> all(static_cast<size_t>(size()));
    host_->allgather(&mine, all.data(), sizeof(Record), DataType::kUInt8);
    std::string blocker;
    for (int r = 0; r < size() && blocker.empty(); ++r) {
      if (!all[r].nccl_ok)
        blocker = fmt::format("NCCL is not available on rank {} ({})", r,
                              r == rank() ? nccl().why_not : "see that rank's log");
      for (int q = 0; q < r && blocker.empty(); ++q) {
        if (host_of(q) == host_of(r) && std::strncmp(all[q].bus_id, all[r].bus_id, sizeof all[r].bus_id) == 0)
          blocker = fmt::format("ranks {} and {} share GPU {} on {} (NCCL needs a GPU of its own per rank)", q, r,
                                all[r].bus_id, host_of(r));
      }
    }
    if (wanted == DevicePath::kStaged) {
      why_ = "the staged path was asked for (COHORT_GPU_PATH or the program)";
      return DevicePath::kStaged;
    }
    if (blocker.empty()) {
      why_ = fmt::format("NCCL {}, one GPU per rank", nccl_version_text(nccl_version()));
      return DevicePath::kNccl;
    }
    if (wanted == DevicePath::kNccl) throw ConfigError("GPU communicator: NCCL was asked for, but " + blocker);
    why_ = blocker;
    return DevicePath::kStaged;
  }

  static int nccl_version() {
    int v = 0;
    if (nccl().api) nccl().api->GetVersion(&v);
    return v;
  }

  void init_nccl() {
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

  std::string setup_timeout_message() const {
    return fmt::format("rank {} (GPU {}): NCCL communicator set-up did not finish within {} ms (every rank had "
                       "arrived; a peer's NCCL bootstrap or network is stuck)",
                       rank(), device_, options().timeout.count());
  }

  // As c10d does: a non-blocking communicator (NCCL >= 2.14). ncclCommInitRankConfig returns at once
  // with the handle, NCCL sets it up on its own threads, and its state is polled until the
  // communicator's timeout; past that it is aborted, so nothing is left running. Every later call
  // on it returns at once too (ncclInProgress while NCCL connects), which keeps NCCL calls from
  // hanging with cohort's locks held.
  void init_nonblocking(const NcclUniqueId& id) {
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
  void init_blocking(const NcclUniqueId& id) {
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

  std::shared_ptr<Communicator> child(std::shared_ptr<Communicator> h) {
    auto c = std::make_shared<DeviceCommunicator>(std::move(h), device_);
    c->init(path_);
    return c;
  }

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

}  // namespace

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

std::shared_ptr<Communicator> make_device_communicator(std::shared_ptr<Communicator> host, DeviceOptions options) {
  if (!host) throw InvalidArgument("make_device_communicator: host communicator is null");
  Status s = status();
  if (!s.usable()) throw ConfigError(fmt::format("rank {}: GPU communicator: {}", host->rank(), s.why_no_gpu));
  const std::string path_text = kGpuPath.get();
  if (path_text == "nccl") options.path = DevicePath::kNccl;
  else if (path_text == "staged") options.path = DevicePath::kStaged;
  else if (path_text != "auto")
    throw ConfigError(fmt::format("COHORT_GPU_PATH={}: expected auto, nccl or staged", path_text));
  const int device = options.device >= 0 ? options.device : local_device();
  if (device >= s.devices)
    throw ConfigError(fmt::format("rank {}: GPU {} asked for, but this process sees {}", host->rank(), device, s.devices));
  auto comm = std::make_shared<DeviceCommunicator>(std::move(host), device);
  comm->init(options.path);
  return comm;
}

std::string device_path_of(const Communicator& comm) {
  auto* d = dynamic_cast<const DeviceCommunicator*>(&comm);
  if (!d) return "host (not a GPU communicator)";
  return d->path_name() + ": " + d->why();
}

int device_of(const Communicator& comm) {
  auto* d = dynamic_cast<const DeviceCommunicator*>(&comm);
  return d ? d->device() : -1;
}

std::shared_ptr<void> allocate_device(size_t bytes, int device) {
  DeviceGuard guard(device);
  void* p = nullptr;
  check_cuda(cuda().Malloc(&p, std::max<size_t>(bytes, 1)), fmt::format("cudaMalloc of {} bytes on GPU {}", bytes, device));
  return std::shared_ptr<void>(p, [](void* q) { cuda().Free(q); });
}

namespace {

// The GPU a pointer's memory is on; -1 for host memory.
int device_of_pointer(const void* ptr) {
  CudaPointerAttributes a;
  if (!ptr || cuda().PointerGetAttributes(&a, ptr) != kCudaSuccess) {
    cuda().GetLastError();
    return -1;
  }
  return a.type == kCudaMemoryDevice || a.type == kCudaMemoryManaged ? a.device : -1;
}

int device_of_either(const void* a, const void* b) {
  int d = device_of_pointer(a);
  return d >= 0 ? d : device_of_pointer(b);
}

// The calling thread's StreamGuard choices, per device.
thread_local std::vector<std::pair<int, void*>> t_streams;
std::atomic<StreamProvider> g_stream_provider{nullptr};

}  // namespace

void* current_stream(int device) {
  for (auto it = t_streams.rbegin(); it != t_streams.rend(); ++it)
    if (it->first == device) return it->second;
  if (StreamProvider p = g_stream_provider.load()) return p(device);
  return nullptr;
}

void set_stream_provider(StreamProvider provider) { g_stream_provider.store(provider); }

StreamGuard::StreamGuard(int device, void* stream) : device_(device) {
  t_streams.emplace_back(device, stream);
}
StreamGuard::~StreamGuard() {
  for (auto it = t_streams.rbegin(); it != t_streams.rend(); ++it) {
    if (it->first == device_) {
      t_streams.erase(std::next(it).base());
      break;
    }
  }
}

void synchronize(Communicator& comm) {
  if (auto* d = dynamic_cast<DeviceCommunicator*>(&comm)) d->synchronize_all();
}

void enable_timing(Communicator& comm) {
  if (auto* d = dynamic_cast<DeviceCommunicator*>(&comm)) d->enable_timing();
}

bool timing_enabled(const Communicator& comm) {
  auto* d = dynamic_cast<const DeviceCommunicator*>(&comm);
  return d && d->timing();
}

std::shared_ptr<void> record_marker(int device) {
  if (!cuda_runtime().api) return nullptr;
  DeviceGuard guard(device);
  void* event = nullptr;
  check_cuda(cuda().EventCreateWithFlags(&event, kCudaEventDefault), "cudaEventCreateWithFlags");
  std::shared_ptr<void> marker(event, [](void* e) { cuda().EventDestroy(e); });
  check_cuda(cuda().EventRecord(event, current_stream(device)), "cudaEventRecord");
  return marker;
}

bool marker_reached(const std::shared_ptr<void>& marker, Millis wait) {
  if (!marker) return false;
  const Deadline deadline = Deadline::after(wait);
  for (;;) {
    const int rc = cuda().EventQuery(marker.get());
    if (rc == kCudaSuccess) return true;
    if (rc != kCudaErrorNotReady) {
      cuda().GetLastError();
      return false;
    }
    if (deadline.expired()) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

std::optional<GpuInterval> work_interval(Work& work, const std::shared_ptr<void>& marker) {
  auto* w = dynamic_cast<DeviceWork*>(&work);
  if (!w || !marker) return std::nullopt;
  return w->interval(marker.get());
}

void copy_memory(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  const int device = device_of_either(dst, src);
  if (device < 0) {
    std::memcpy(dst, src, bytes);
    return;
  }
  DeviceGuard guard(device);
  void* stream = current_stream(device);
  check_cuda(cuda().MemcpyAsync(dst, src, bytes, kCudaMemcpyDefault, stream), fmt::format("cudaMemcpyAsync of {} bytes", bytes));
  check_cuda(cuda().StreamSynchronize(stream), fmt::format("cudaStreamSynchronize after a copy of {} bytes", bytes));
}

void zero_memory(void* ptr, size_t bytes) {
  if (bytes == 0) return;
  const int device = std::max(device_of_pointer(ptr), 0);
  DeviceGuard guard(device);
  void* stream = current_stream(device);
  check_cuda(cuda().MemsetAsync(ptr, 0, bytes, stream), fmt::format("cudaMemsetAsync of {} bytes", bytes));
  check_cuda(cuda().StreamSynchronize(stream), "cudaStreamSynchronize");
}

void copy_memory_async(void* dst, const void* src, size_t bytes, int device) {
  if (bytes == 0) return;
  DeviceGuard guard(device);
  check_cuda(cuda().MemcpyAsync(dst, src, bytes, kCudaMemcpyDefault, current_stream(device)),
             fmt::format("cudaMemcpyAsync of {} bytes", bytes));
}

void zero_memory_async(void* ptr, size_t bytes, int device) {
  if (bytes == 0) return;
  DeviceGuard guard(device);
  check_cuda(cuda().MemsetAsync(ptr, 0, bytes, current_stream(device)), fmt::format("cudaMemsetAsync of {} bytes", bytes));
}

bool is_device_pointer(const void* ptr) {
  const auto& rt = cuda_runtime();
  if (!rt.api || !ptr) return false;
  CudaPointerAttributes a;
  if (rt.api->PointerGetAttributes(&a, ptr) != kCudaSuccess) {
    rt.api->GetLastError();
    return false;
  }
  return a.type == kCudaMemoryDevice || a.type == kCudaMemoryManaged;
}

}  // namespace cohort::gpu
