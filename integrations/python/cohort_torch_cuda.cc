// CUDA tensors in the PyTorch backend: cohort_torch_cuda.h says what happens to them.

#include "cohort_torch_cuda.h"

#include <fmt/format.h>

#include <vector>

#include "cohort_torch_group.h"

namespace cohort_torch {

// CUDA tensors go to torch's NCCL backend when there is one (it orders them on CUDA streams like
// ProcessGroupNCCL does for any script); otherwise they are staged: copied to the host, run through
// cohort's collectives, copied back, and the returned Work is already complete. route_cuda
// (cohort_torch_group.h) calls this for a call with CUDA tensors. Whether a call was routed is not
// read from the Work it returns: a backend may hand back no Work for an operation it had nothing to
// do for, and such a call must not fall through to the CPU path with CUDA tensors.
c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::route_cuda_call(
    c10d::OpType type, Args all, Args outputs,
    const std::function<c10::intrusive_ptr<c10d::Work>(BaseGroup&)>& delegate,
    const std::function<c10::intrusive_ptr<c10d::Work>()>& on_host) {
  if (cuda_backend_) {
    c10::intrusive_ptr<c10d::Work> work = delegate(*cuda_backend_);
    if (work) return work;
    std::vector<at::Tensor> results;
    for (at::Tensor* out : outputs.tensors) results.push_back(*out);
    auto done = c10::make_intrusive<CohortWork>(rank_, type, std::move(results));
    done->complete(nullptr);
    return done;
  }
  if (!warned_staging_.exchange(true))
    TORCH_WARN("cohort backend: CUDA tensors are copied to host memory for each collective (", cuda_note_,
               "); pass backend=\"cpu:cohort,cuda:nccl\" where torch has NCCL");
  std::vector<at::Tensor> originals;
  for (at::Tensor* t : all.tensors) {
    originals.push_back(*t);
    if (t->defined() && t->is_cuda()) *t = t->to(at::kCPU).contiguous();
  }
  struct Restore {
    Args& all;
    std::vector<at::Tensor>& originals;
    ~Restore() {
      for (size_t i = 0; i < all.tensors.size(); ++i) *all.tensors[i] = originals[i];
    }
  } restore{all, originals};
  auto work = on_host();
  work->wait();
  std::vector<at::Tensor> results;
  for (at::Tensor* out : outputs.tensors) {
    for (size_t i = 0; i < all.tensors.size(); ++i) {
      if (all.tensors[i] != out) continue;
      if (originals[i].defined() && originals[i].is_cuda()) originals[i].copy_(*out);
      results.push_back(originals[i]);
    }
  }
  auto done = c10::make_intrusive<CohortWork>(rank_, type, std::move(results));
  done->complete(nullptr);
  return done;
}

#if TORCH_VERSION_MAJOR >= 2
// For CUDA tensors, torch's own NCCL backend over the same store (keys under "cohort_nccl/"), when
// this torch has CUDA, sees a GPU and was built with NCCL. Building it talks to nobody: NCCL's
// communicator is made at the first CUDA collective, by every rank alike. Otherwise: null, and why.
// NCCL needs a GPU of its own per rank: when this host's ranks outnumber its GPUs (two ranks on a
// one-GPU machine), CUDA tensors are staged instead.
std::pair<c10::intrusive_ptr<BaseGroup>, std::string> make_cuda_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                                        int rank, int size, int local_size,
                                                                        Millis timeout) {
  py::gil_scoped_acquire gil;
  try {
    py::module_ torch_cuda = py::module_::import("torch.cuda");
    py::module_ dist = py::module_::import("torch.distributed");
    if (!torch_cuda.attr("is_available")().cast<bool>()) return {{}, "this torch sees no GPU"};
    if (!dist.attr("is_nccl_available")().cast<bool>()) return {{}, "this torch was built without NCCL"};
    const int gpus = torch_cuda.attr("device_count")().cast<int>();
    if (local_size > gpus)
      return {{}, fmt::format("{} ranks on this host share {} GPU{}; NCCL needs one per rank", local_size, gpus,
                              gpus == 1 ? "" : "s")};
    py::object prefixed = dist.attr("PrefixStore")("cohort_nccl/", py::cast(store));
    py::object nccl_class = dist.attr("ProcessGroupNCCL");
    py::object options = nccl_class.attr("Options")();
    options.attr("_timeout") = timeout;
    py::object backend = nccl_class(prefixed, rank, size, options);
    return {backend.cast<c10::intrusive_ptr<BaseGroup>>(), ""};
  } catch (const std::exception& e) {
    // A broken CUDA set-up must not break CPU training: CUDA tensors are staged, with the reason.
    return {{}, std::string("torch's NCCL backend could not be made: ") + e.what()};
  }
}
#endif

}  // namespace cohort_torch
