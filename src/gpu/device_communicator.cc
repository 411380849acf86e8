// DeviceCommunicator (device_communicator.h): set-up, the path each rank takes (NCCL or staged),
// which side of the host/device line a call's buffers are on, and every operation, each of which
// sends host buffers to the host communicator and device buffers to NCCL (nccl_calls.cc) or
// through host memory (staging.cc).
#include <fmt/core.h>

#include <algorithm>
#include <cstring>

#include "common/env.h"
#include "cohort/error.h"
#include "common/deadline.h"
#include "common/log.h"
#include "gpu/device_communicator.h"

namespace cohort::gpu::impl {

namespace {

const env::BoolSetting kGpuTiming("COHORT_GPU_TIMING", false,
                                  "GPU collectives record timed CUDA events (their start and end on the GPU, for "
                                  "the timeline's overlap figures)");

}  // namespace

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

DeviceGuard::DeviceGuard(int device) {
  const CudaApi& c = cuda();
  check_cuda(c.GetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) check_cuda(c.SetDevice(device), fmt::format("cudaSetDevice({})", device));
  restore_ = previous_ != device;
}

DeviceGuard::~DeviceGuard() {
  if (restore_) cuda().SetDevice(previous_);
}

DeviceCommunicator::~DeviceCommunicator() {
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
void DeviceCommunicator::init(DevicePath wanted) {
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

// ---- collectives: device buffers here, host buffers to the host communicator ----
void DeviceCommunicator::allreduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) {
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

void DeviceCommunicator::reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op, int root) {
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

void DeviceCommunicator::broadcast(void* buf, size_t count, DataType dtype, int root) {
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

void DeviceCommunicator::allgather(const void* send, void* recv, size_t count, DataType dtype) {
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

void DeviceCommunicator::allgatherv(const void* send, size_t send_count, void* recv, const std::vector<size_t>& recv_counts,
                                    DataType dtype) {
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

void DeviceCommunicator::gather(const void* send, void* recv, size_t count, DataType dtype, int root) {
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

void DeviceCommunicator::scatter(const void* send, void* recv, size_t count, DataType dtype, int root) {
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

void DeviceCommunicator::reduce_scatter(const void* send, void* recv, size_t recv_count, DataType dtype, ReduceOp op) {
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

void DeviceCommunicator::alltoall(const void* send, void* recv, size_t count, DataType dtype) {
  const size_t n = static_cast<size_t>(size());
  std::vector<size_t> counts(n, count), displs(n);
  for (size_t r = 0; r < n; ++r) displs[r] = r * count;
  alltoallv(send, counts, displs, recv, counts, displs, dtype);
}

void DeviceCommunicator::alltoallv(const void* send, const std::vector<size_t>& send_counts, const std::vector<size_t>& send_displs,
               void* recv, const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_displs,
                                   DataType dtype) {
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
void DeviceCommunicator::barrier() {
  if (path_ == DevicePath::kNccl) check_failed();
  if (stream_) wait_stream("barrier");
  host_->barrier();
}

void DeviceCommunicator::send(const void* buf, size_t count, DataType dtype, int peer, uint32_t tag) {
  if (!where("send", count, {buf})) return host_->send(buf, count, dtype, peer, tag);
  check_p2p(peer, tag);
  const size_t bytes = count * dtype_size(dtype);
  if (staged()) return staged_op(buf, bytes, nullptr, 0, [&](const void* in, void*) { host_->send(in, count, dtype, peer, tag); });
  run_nccl("send", bytes, [&](void* comm, void* s) { return nccl_api().Send(buf, count, nccl_dtype(dtype), peer, comm, s); });
}

void DeviceCommunicator::recv(void* buf, size_t count, DataType dtype, int peer, uint32_t tag) {
  if (!where("recv", count, {buf})) return host_->recv(buf, count, dtype, peer, tag);
  check_p2p(peer, tag);
  const size_t bytes = count * dtype_size(dtype);
  if (staged()) return staged_op(nullptr, 0, buf, bytes, [&](const void*, void* out) { host_->recv(out, count, dtype, peer, tag); });
  run_nccl("recv", bytes, [&](void* comm, void* s) { return nccl_api().Recv(buf, count, nccl_dtype(dtype), peer, comm, s); });
}

// Host memory: the host communicator's. NCCL has no receive from any source (nor has torch's NCCL
// backend), and a host-side one could never match a peer's device send.
int DeviceCommunicator::recv_any(void* buf, size_t count, DataType dtype, uint32_t tag) {
  if (!where("recv", count, {buf})) return host_->recv_any(buf, count, dtype, tag);
  throw InvalidArgument("recv from any source: the buffer is GPU memory, and NCCL has no receive from any source; "
                        "name the sending rank, or receive into host memory");
}

// Non-blocking point to point. Host memory: the host communicator's. Device memory through NCCL:
// queued on the communicator's stream like the other asynchronous operations (so a send queued
// before the matching receive waits for it there, as ncclSend does); staged: done at once.
std::shared_ptr<Work> DeviceCommunicator::send_async(const void* buf, size_t count, DataType dtype, int peer, uint32_t tag) {
  if (!where("send", count, {buf})) return host_->send_async(buf, count, dtype, peer, tag);
  check_p2p(peer, tag);
  if (staged()) return run_now([&] { send(buf, count, dtype, peer, tag); });
  return queue_nccl("send", count * dtype_size(dtype), [&](void* comm, void* s) {
    return nccl_api().Send(buf, count, nccl_dtype(dtype), peer, comm, s);
  });
}
std::shared_ptr<Work> DeviceCommunicator::recv_async(void* buf, size_t count, DataType dtype, int peer, uint32_t tag) {
  if (!where("recv", count, {buf})) return host_->recv_async(buf, count, dtype, peer, tag);
  check_p2p(peer, tag);
  if (staged()) return run_now([&] { recv(buf, count, dtype, peer, tag); });
  return queue_nccl("recv", count * dtype_size(dtype), [&](void* comm, void* s) {
    return nccl_api().Recv(buf, count, nccl_dtype(dtype), peer, comm, s);
  });
}

// ---- asynchronous: NCCL work returns a handle on its event; staged work completes at once ----
std::shared_ptr<Work> DeviceCommunicator::allreduce_async(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) {
  if (!where("allreduce", count, {send, recv})) return host_->allreduce_async(send, recv, count, dtype, op);
  check_op(dtype, op);
  const size_t bytes = count * dtype_size(dtype);
  if (staged()) return run_now([&] { allreduce(send, recv, count, dtype, op); });
  return queue_nccl("allreduce", bytes, [&](void* comm, void* s) {
    return nccl_api().AllReduce(send, recv, count, nccl_dtype(dtype), nccl_op(op), comm, s);
  });
}
std::shared_ptr<Work> DeviceCommunicator::broadcast_async(void* buf, size_t count, DataType dtype, int root) {
  check_root(root);
  if (!where("broadcast", count, {buf})) return host_->broadcast_async(buf, count, dtype, root);
  if (staged()) return run_now([&] { broadcast(buf, count, dtype, root); });
  return queue_nccl("broadcast", count * dtype_size(dtype), [&](void* comm, void* s) {
    return nccl_api().Broadcast(buf, buf, count, nccl_dtype(dtype), root, comm, s);
  });
}
std::shared_ptr<Work> DeviceCommunicator::allgather_async(const void* send, void* recv, size_t count, DataType dtype) {
  if (!where("allgather", count, {send, recv})) return host_->allgather_async(send, recv, count, dtype);
  if (staged()) return run_now([&] { allgather(send, recv, count, dtype); });
  return queue_nccl("allgather", count * dtype_size(dtype) * size(), [&](void* comm, void* s) {
    return nccl_api().AllGather(nccl_allgather_input(send, recv, count * dtype_size(dtype)), recv, count,
                                nccl_dtype(dtype), comm, s);
  });
}
std::shared_ptr<Work> DeviceCommunicator::reduce_scatter_async(const void* send, void* recv, size_t recv_count, DataType dtype,
                                                               ReduceOp op) {
  if (!where("reduce_scatter", recv_count, {send, recv}))
    return host_->reduce_scatter_async(send, recv, recv_count, dtype, op);
  check_op(dtype, op);
  if (staged()) return run_now([&] { reduce_scatter(send, recv, recv_count, dtype, op); });
  return queue_nccl("reduce_scatter", recv_count * dtype_size(dtype) * size(), [&](void* comm, void* s) {
    return nccl_reduce_scatter(send, recv, recv_count, dtype, op, comm, s);
  }, false, in_place_reduce_scatter_copy(send, recv, recv_count, dtype));
}
std::shared_ptr<Work> DeviceCommunicator::barrier_async() {
  if (path_ == DevicePath::kNccl) check_failed();
  if (stream_) wait_stream("barrier");
  return host_->barrier_async();
}

// ---- groups: the host communicator splits, then the new group builds its own NCCL communicator ----
std::shared_ptr<Communicator> DeviceCommunicator::split(int color, int key) {
  auto h = host_->split(color, key);
  if (!h) return nullptr;
  return child(std::move(h));
}
std::shared_ptr<Communicator> DeviceCommunicator::subgroup(const std::vector<int>& ranks) {
  auto h = host_->subgroup(ranks);
  if (!h) return nullptr;
  return child(std::move(h));
}

void DeviceCommunicator::abort(const std::string& reason) {
  record_failure(reason, std::make_exception_ptr(AbortedError(reason)));
  host_->abort(reason);
}


void DeviceCommunicator::check_root(int root) const {
  if (root < 0 || root >= size()) throw InvalidArgument(fmt::format("root {} is not a rank (0..{})", root, size() - 1));
}
void DeviceCommunicator::check_op(DataType dtype, ReduceOp op) const {
  if (!op_supported(dtype, op))
    throw InvalidArgument(fmt::format("{} is not defined on {}", reduce_op_name(op), dtype_name(dtype)));
}
void DeviceCommunicator::check_p2p(int peer, uint32_t tag) const {
  if (peer < 0 || peer >= size() || peer == rank())
    throw InvalidArgument(fmt::format("send/recv: peer {} is not another rank (0..{})", peer, size() - 1));
  if (tag != 0 && path_ == DevicePath::kNccl)
    throw InvalidArgument(fmt::format("send/recv of GPU buffers: tag {} given, but NCCL has no tags (sends and "
                                      "receives between two ranks match in the order they are made); use tag 0",
                                      tag));
}

// True when the buffers are GPU memory (of this communicator's device), false when they are host
// memory; InvalidArgument when they are mixed or on another GPU. `count` 0 is host (nothing moves).
bool DeviceCommunicator::where(const char* op, size_t count, std::initializer_list<const void*> buffers) {
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

// Every rank: NCCL loaded? which GPU (bus id)? Gathered over the host communicator so that all ranks
// take the same path, and a rank that cannot use NCCL is named.
DevicePath DeviceCommunicator::choose_path(DevicePath wanted) {
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

std::shared_ptr<Communicator> DeviceCommunicator::child(std::shared_ptr<Communicator> h) {
  auto c = std::make_shared<DeviceCommunicator>(std::move(h), device_);
  c->init(path_);
  return c;
}
}  // namespace cohort::gpu::impl
