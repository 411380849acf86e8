"""Horovod's PyTorch API (`import horovod.torch as hvd`) over cohort's communicator (docs/horovod.md).

The collectives and basics live in mpi_ops; the training helpers (broadcast_parameters,
DistributedOptimizer, Compression, SyncBatchNorm, ...) in the sibling modules that add their names below.
"""
from cohort.horovod.torch.mpi_ops import (  # noqa: F401
    Adasum, Average, HorovodInternalError, HostsUpdatedInterrupt, Max, Min, ProcessSet, Product, Sum,
    add_process_set, allgather, allgather_async, allreduce, allreduce_, allreduce_async,
    allreduce_async_, alltoall, alltoall_async, barrier, broadcast, broadcast_, broadcast_async,
    broadcast_async_, ccl_built, cross_rank, cross_size, cuda_built, ddl_built, global_process_set,
    gloo_built, gloo_enabled, grouped_allgather, grouped_allgather_async, grouped_allreduce,
    grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
    grouped_reducescatter_async, init, is_homogeneous, is_initialized, join, local_rank, local_size,
    mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, poll, rank, reducescatter,
    reducescatter_async, remove_process_set, rocm_built, shutdown, size, sparse_allreduce_async,
    start_timeline, stop_timeline, synchronize)
from cohort.horovod.torch.compression import Compression  # noqa: F401
from cohort.horovod.torch.functions import (  # noqa: F401
    allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters)
from cohort.horovod.torch.optimizer import DistributedOptimizer  # noqa: F401
from cohort.horovod.torch.sync_batch_norm import SyncBatchNorm  # noqa: F401
from cohort.horovod.torch import elastic  # noqa: F401,E402  (hvd.elastic: run, TorchState; docs/horovod.md)
