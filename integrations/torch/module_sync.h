#pragma once
// What DistributedDataParallel and FullyShardedDataParallel both do to a module's tensors (internal to
// cohort_libtorch; broadcast_module, the public one, is in cohort/torch/ddp.h).
#include <torch/torch.h>

#include "cohort/communicator.h"

namespace cohort::torch {

// Broadcasts the buffers of `module` (batch norm's running statistics) from rank 0, packed by dtype:
// one broadcast of each kind instead of one per buffer. DDPOptions::broadcast_buffers and
// FSDPOptions::broadcast_buffers call it before each forward that records gradients.
void broadcast_buffers(::torch::nn::Module& module, Communicator& comm);

}  // namespace cohort::torch
