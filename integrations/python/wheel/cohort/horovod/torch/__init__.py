"""Horovod's PyTorch API (`import horovod.torch as hvd`) over cohort's communicator (docs/horovod.md).

The collectives and basics live in mpi_ops; the training helpers (broadcast_parameters,
DistributedOptimizer, Compression, SyncBatchNorm, ...) in the sibling modules that add their names below.
"""
from cohort.horovod.torch.mpi_ops import (  # noqa: F401
    Adasum, Average, HorovodInternalError, HostsUpdatedInterrupt, Max, Min, Product, ProcessSet, Sum,
    add_process_set, allgather, allgather_async, allreduce, allreduce_, allreduce_async, allreduce_async_,
    broadcast, broadcast_, broadcast_async, broadcast_async_, ccl_built, cross_rank, cross_size, cuda_built,
    ddl_built, global_process_set, gloo_built, gloo_enabled, init, is_homogeneous, is_initialized, local_rank,
    local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, poll, rank, remove_process_set,
    rocm_built, shutdown, size, start_timeline, stop_timeline, synchronize)
