// The process group (torch 1.x) / backend (torch 2.x) that torch.distributed calls: ProcessGroupCohort.
//
// Every operation is validated on the calling thread (bad dtype, device, shape: RuntimeError at once),
// then queued to one worker thread per process group that runs the blocking communicator call. One
// thread keeps operations in the order they were issued, which the communicator requires (same order on
// every rank), and lets DDP overlap backward with communication. The Work handle completes (and its
// Future with the output tensors) when the worker is done; failures complete it with the
// communicator's exception, which Python sees as RuntimeError carrying cohort's message.
//
// The class's methods live by concept:
//   cohort_torch_group.cc             life, the queue, the worker thread, the per-operation watchdog,
//                                     and the creator torch calls (create_process_group)
//   cohort_torch_collectives.cc       the collectives and their checks
//   cohort_torch_p2p.cc               send, recv, recv from any source
//   cohort_torch_monitored_barrier.cc monitored_barrier
//   cohort_torch_cuda.cc              CUDA tensors: to torch's NCCL backend, or staged through host memory
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cohort/communicator.h"
#include "cohort_torch_common.h"
#include "cohort_torch_shared_storage.h"
#include "cohort_torch_work.h"

namespace cohort_torch {


// First line of each collective of the backend: CUDA tensors leave the CPU path here (torch 2.x;
// torch 1.x from Debian has no CUDA, and check_tensor refuses non-CPU tensors in one line).
#if TORCH_VERSION_MAJOR >= 2
#define COHORT_ROUTE_CUDA(type, all, outputs, call)                                                  \
  if (auto routed_ = route_cuda(                                                                      \
          type, all, outputs, [&](BaseGroup& nccl_) { return nccl_.call; }, [&] { return this->call; })) \
  return *routed_
#else
#define COHORT_ROUTE_CUDA(type, all, outputs, call)
#endif

class ProcessGroupCohort : public BaseGroup {
 public:
  // `cuda_backend`: torch's own NCCL backend over the same store, for CUDA tensors (torch 2.x with
  // CUDA and NCCL; null otherwise, and CUDA tensors are staged through host memory).
  ProcessGroupCohort(std::shared_ptr<cohort::Communicator> comm, int rank, int size,
                     c10::intrusive_ptr<BaseGroup> cuda_backend = {}, std::string cuda_note = "");
  ~ProcessGroupCohort() override;

  const std::string getBackendName() const override { return "cohort"; }

  // Sequence numbers: torch's ProcessGroupWrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL; torch 2.x wraps any
  // backend in it) checks before each collective that every rank is at the same one, by this number.
  // As gloo: every rank starts at 0 and counts the collectives it issues (point-to-point operations,
  // which the two ends need not issue alike, are not counted).
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return collectives_issued_.load(); }

  // ---- reductions (cohort_torch_collectives.cc) ----
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> sparse_allreduce(const at::Tensor& tensor, const c10d::AllreduceOptions& opts);
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  static constexpr int64_t kSparseMaxDims = 13;

  // ---- data movement (cohort_torch_collectives.cc) ----
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& output_lists,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // ---- point to point (cohort_torch_p2p.cc) ----
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  // ---- cohort_torch_monitored_barrier.cc ----
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;

 private:
  void check_root(int64_t root, const char* op) const;
  void check_peer(int peer, const char* op) const;
  void check_list(const std::vector<at::Tensor>& list, const at::Tensor& like,
                  const char* op) const;
  std::vector<size_t> split_counts(const at::Tensor& t, const std::vector<int64_t>& splits,
                                   const char* which) const;
  static std::vector<size_t> displacements(const std::vector<size_t>& counts);

  // The tensors of one call, by reference: route_cuda may swap them for host copies and back.
  struct Args {
    std::vector<at::Tensor*> tensors;
    Args& one(at::Tensor& t) {
      tensors.push_back(&t);
      return *this;
    }
    Args& list(std::vector<at::Tensor>& l) {
      for (auto& t : l) tensors.push_back(&t);
      return *this;
    }
    Args& lists(std::vector<std::vector<at::Tensor>>& ls) {
      for (auto& l : ls) list(l);
      return *this;
    }
    bool any_cuda() const {
      return std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor* t) { return t->defined() && t->is_cuda(); });
    }
  };

  // CUDA tensors go to torch's NCCL backend when there is one, or are staged through host memory
  // (route_cuda_call, cohort_torch_cuda.cc). nullopt for a call without CUDA tensors (the CPU path runs).
  // A template so that the CPU path pays for nothing but the look at its tensors (no std::function is made).
  template <typename Delegate, typename OnHost>
  std::optional<c10::intrusive_ptr<c10d::Work>> route_cuda(c10d::OpType type, Args all, Args outputs,
                                                           Delegate&& delegate, OnHost&& on_host) {
    if (!all.any_cuda()) return std::nullopt;
    return route_cuda_call(type, std::move(all), std::move(outputs), delegate, on_host);
  }
  c10::intrusive_ptr<c10d::Work> route_cuda_call(
      c10d::OpType type, Args all, Args outputs,
      const std::function<c10::intrusive_ptr<c10d::Work>(BaseGroup&)>& delegate,
      const std::function<c10::intrusive_ptr<c10d::Work>()>& on_host);

  // Posts a send or receive (cohort_torch_p2p.cc).
  template <typename Post>
  c10::intrusive_ptr<c10d::Work> post_p2p(c10d::OpType type, std::vector<at::Tensor> outputs, int source_rank,
                                          Post&& post, std::function<void()> on_success);

  // monitored_barrier's messages: a tag no script is likely to use (torch's tags are ints; this is
  // INT32_MIN + 0x4D42, "MB").
  static constexpr uint32_t kMonitoredBarrierTag = 0x80004D42u;
  // Rank 0's answer to the others: kBarrierPassed, or the barrier failed: the first rank it did not
  // hear from in time (> 0), or -1 where it failed otherwise (an error of the communicator).
  static constexpr int64_t kBarrierPassed = 0;
  struct MonitoredBarrierState {
    explicit MonitoredBarrierState(int size) : tokens(static_cast<size_t>(size), 0) {}
    std::vector<int64_t> tokens;  // what arrives: rank 0 from rank r in tokens[r]; rank r's verdict in tokens[1]
    int64_t verdict = kBarrierPassed;  // rank 0: what it sends every other rank
    std::vector<std::shared_ptr<cohort::Work>> works;
  };
  // Keeps a barrier's buffers for as long as the communicator may still write into them.
  void keep(std::shared_ptr<MonitoredBarrierState> state);

  // ---- the queue, the worker thread and the watchdog (cohort_torch_group.cc) ----
  struct Pending {
    c10::intrusive_ptr<CohortWork> work;
    std::function<void(CohortWork&)> run;
    c10d::OpType type = c10d::OpType::UNKNOWN;
    Millis timeout{-1};  // the operation's own timeout (opts.timeout); negative: the group's
  };

  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, std::vector<at::Tensor> outputs,
                                         std::function<void()> run, int source_rank = -1);
  c10::intrusive_ptr<c10d::Work> enqueue(Millis timeout, c10d::OpType type, std::vector<at::Tensor> outputs,
                                         std::function<void()> run, int source_rank = -1);
  c10::intrusive_ptr<c10d::Work> enqueue_run(Millis timeout, c10d::OpType type, std::vector<at::Tensor> outputs,
                                             std::function<void(CohortWork&)> run, int source_rank = -1);
  void watchdog_loop();
  size_t in_flight_count();
  bool poll_in_flight();
  void release_finished();
  void worker_loop();

  // Declared before comm_ so that it is destroyed after it: the communicator may write into these.
  std::vector<std::shared_ptr<MonitoredBarrierState>> kept_barriers_;
  std::shared_ptr<cohort::Communicator> comm_;
  SharedStorage shared_storage_;  // used by the worker thread only
  c10::intrusive_ptr<BaseGroup> cuda_backend_;  // torch's NCCL backend for CUDA tensors, or null
  std::string cuda_note_;                       // why CUDA tensors are staged (no NCCL backend)
  std::atomic<bool> warned_staging_{false};     // the staging warning is given once per group
  std::atomic<uint64_t> collectives_issued_{0};  // getSequenceNumberForGroup()
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> queue_;
  std::vector<c10::intrusive_ptr<CohortWork>> in_flight_;  // posted sends and receives not yet completed
  std::vector<c10::intrusive_ptr<CohortWork>> finished_;   // completed, not yet freed (release_finished)
  bool busy_ = false;
  bool stopping_ = false;
  std::thread worker_;
  // Watchdog state (under mu_): the running operation and its own deadline, if it has one.
  std::condition_variable cv_watch_;
  uint64_t running_seq_ = 0;
  c10d::OpType running_type_ = c10d::OpType::UNKNOWN;
  Millis running_timeout_{-1};
  std::optional<std::chrono::steady_clock::time_point> running_deadline_;
  std::thread watchdog_;
};

// torch calls creator(store, rank, size, timeout) from init_process_group / new_group.
c10::intrusive_ptr<ProcessGroupCohort> create_process_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, Millis timeout);

}  // namespace cohort_torch
