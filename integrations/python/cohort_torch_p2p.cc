// The backend's point-to-point operations: send and recv, posted to the communicator on the calling
// thread, and recv from any source, queued like a collective.

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "cohort/error.h"
#include "cohort_torch_group.h"
#include "cohort_torch_tensors.h"

namespace cohort_torch {

// Posts a send or receive (`post` returns the communicator's Work) and hands out a torch Work that
// completes with it; `on_success` runs first (a staged receive's copy back; it also keeps the staged
// tensors alive until the transfer ends).
template <typename Post>
c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::post_p2p(c10d::OpType type, std::vector<at::Tensor> outputs,
                                                            int source_rank, Post&& post,
                                                            std::function<void()> on_success) {
  release_finished();
  auto work = c10::make_intrusive<CohortWork>(rank_, type, std::move(outputs), source_rank);
  std::shared_ptr<cohort::Work> p2p;
  {
    // Posting waits for the drive lock, which a collective running on the worker thread holds: let
    // go of the GIL meanwhile, the worker may need it to complete that collective's Future.
    std::optional<py::gil_scoped_release> no_gil;
    if (Py_IsInitialized() && PyGILState_Check()) no_gil.emplace();
    {
      std::lock_guard<std::mutex> lock(mu_);
      TORCH_CHECK(!stopping_, "cohort backend: the process group is being destroyed");
    }
    try {
      p2p = post();
    } catch (const cohort::Error& e) {
      TORCH_CHECK(false, "cohort backend: ", c10d::opTypeToString(type), ": ", e.what());
    }
  }
  work->set_p2p(std::move(p2p), std::move(on_success));
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.push_back(work);
  }
  cv_.notify_one();
  return work;
}

// monitored_barrier's messages: a tag no script is likely to use (torch's tags are ints; this is

// Sends and receives are posted to the communicator at once, on the calling thread, in call order
// (which is what matches the messages of a (peer, tag) stream), and run beside the queued
// collectives: a rank may post a receive, then a send, and wait for both, as with gloo. A Work's
// wait() drives its transfer; the worker thread completes the ones nobody waits on.
c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::send(std::vector<at::Tensor>& tensors, int dst,
                                                        int tag) {
  COHORT_ROUTE_CUDA(c10d::OpType::SEND, Args().list(tensors), Args(), send(tensors, dst, tag));
  check_single(tensors, "send");
  check_peer(dst, "send");
  const auto dtype = to_cohort_dtype(tensors[0], "send");
  Staged t(tensors[0]);
  return post_p2p(c10d::OpType::SEND, tensors, -1, [&] {
    return comm_->send_async(t.data(), t.count(), dtype, dst, static_cast<uint32_t>(tag));
  }, [t] {});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::recv(std::vector<at::Tensor>& tensors, int src,
                                                        int tag) {
  COHORT_ROUTE_CUDA(c10d::OpType::RECV, Args().list(tensors), Args().list(tensors), recv(tensors, src, tag));
  check_single(tensors, "recv");
  check_peer(src, "recv");
  const auto dtype = to_cohort_dtype(tensors[0], "recv");
  Staged t(tensors[0]);
  return post_p2p(c10d::OpType::RECV, tensors, src, [&] {
    return comm_->recv_async(t.data(), t.count(), dtype, src, static_cast<uint32_t>(tag));
  }, [t] { t.copy_back(); });
}

// recv() without src: the next message with `tag` from whichever rank's comes first; the Work's
// _source_rank() names it (cohort::Communicator::recv_any).
c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  COHORT_ROUTE_CUDA(c10d::OpType::RECVANYSOURCE, Args().list(tensors), Args().list(tensors),
                    recvAnysource(tensors, tag));
  check_single(tensors, "recv");
  const auto dtype = to_cohort_dtype(tensors[0], "recv");
  Staged t(tensors[0]);
  return enqueue_run(c10d::kUnsetTimeout, c10d::OpType::RECVANYSOURCE, tensors, [this, t, dtype, tag](CohortWork& work) {
    work.set_source_rank(comm_->recv_any(t.data(), t.count(), dtype, static_cast<uint32_t>(tag)));
    t.copy_back();
  });
}

void ProcessGroupCohort::check_peer(int peer, const char* op) const {
  TORCH_CHECK(peer >= 0 && peer < size_ && peer != rank_, "cohort backend: ", op,
              ": peer rank ", peer, " must be another rank of the group of ", size_);
}

}  // namespace cohort_torch
