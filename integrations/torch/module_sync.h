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

// The communicator a model on `device` reduces through. The CPU: `comm` as it is. cuda:N: a host
// communicator (what Communicator::from_env gives) wrapped by gpu::make_device_communicator on GPU N
// (collective), or `comm` itself when it already is one on GPU N; one on another GPU throws, naming
// both. For a GPU it also makes cohort's GPU collectives follow torch's current CUDA stream
// (use_torch_streams). `who` ("DDP", "FSDP") starts the error message.
std::shared_ptr<Communicator> communicator_for_device(std::shared_ptr<Communicator> comm, const ::torch::Device& device,
                                                      const char* who);

}  // namespace cohort::torch
