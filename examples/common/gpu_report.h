#pragma once
// What the DDP examples print about the GPU, beside their samples/s and communication wait.
//
// On a GPU, finish() waits in stream order and the host does not block, so the "communication wait"
// line says nothing about overlap there. With timing on (`cohort run --timeline`, or
// COHORT_GPU_TIMING=1) the buckets' allreduces carry CUDA events, and GradientSync measures on the
// GPU's own clock how much of each ran before backward ended: that is the overlap line.
#include <fmt/format.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "cohort/communicator.h"
#include "cohort/train/grad_sync.h"

namespace examples {

// Before a run is timed: the host runs ahead of the GPU, whose queued work is part of the run.
inline void wait_for_device(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

// Collective (an allreduce over ranks); rank 0 prints. Nothing when no bucket was timed.
inline void print_gpu_overlap(const cohort::train::GradSyncStats& stats, cohort::Communicator& comm, bool lead) {
  double figures[3] = {static_cast<double>(stats.gpu_timed_buckets), stats.gpu_overlap_sum, stats.gpu_allreduce_ms};
  comm.allreduce(figures, figures, 3, cohort::DataType::kFloat64, cohort::ReduceOp::kSum);
  if (!lead || figures[0] == 0) return;
  fmt::print("allreduce overlapping backward (GPU clock): {:.1f}% of each bucket's allreduce on average, over {:.0f} "
             "bucket allreduces of {:.3f} ms each (all ranks)\n",
             100.0 * figures[1] / figures[0], figures[0], figures[2] / figures[0]);
}

}  // namespace examples
