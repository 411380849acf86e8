#pragma once
// What the heap tests of DDP and the sharded optimizer share: a model whose every layer leaves one
// activation of rows x cols floats for backward (tanh(x * w), w a row of 0.9), and the calling thread's
// minor page faults, which say whether a step's memory was resident or faulted in again.
#include <sys/resource.h>
#include <torch/torch.h>

#include <memory>

namespace cohort::torch::test {

inline ::torch::nn::Sequential activations_model(int64_t cols, int layers) {
  struct Scale : ::torch::nn::Module {
    ::torch::Tensor w;
    explicit Scale(int64_t cols) { w = register_parameter("w", ::torch::full({cols}, 0.9)); }
    ::torch::Tensor forward(const ::torch::Tensor& x) { return ::torch::tanh(x * w); }
  };
  ::torch::nn::Sequential model;
  for (int i = 0; i < layers; ++i) model->push_back(std::make_shared<Scale>(cols));
  return model;
}

// Minor page faults of the calling thread so far.
inline long thread_page_faults() {
  rusage r{};
  getrusage(RUSAGE_THREAD, &r);
  return r.ru_minflt;
}

}  // namespace cohort::torch::test
