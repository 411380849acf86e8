"""Horovod's PyTorch collectives (`horovod.torch.mpi_ops`), served by cohort.

Every operation is one or two `torch.distributed` calls on a process group of cohort's backend
(`cohort_torch`), so a Horovod script's tensors travel through cohort's communicator: shared memory
between the ranks of a host, TCP across hosts. What Horovod does in its C++ background thread
(averaging, pre/post scaling, uneven first dimensions, handles) is done here, around those calls.

Differences from Horovod (docs/horovod.md says more):
* Horovod's coordinator matches operations across ranks by name, so ranks may issue them in different
  orders. cohort matches them by issue order, as torch.distributed does: every rank must issue the
  collectives of a process set in the same order. A name is still checked for duplicates in flight.
* A mismatch that cohort's communicator detects (count, dtype, reduce op or root differ between the
  ranks' calls) raises HorovodInternalError on every rank; like an error in Horovod, the process set
  stays usable: the next operation runs on a fresh communicator built from the same store.
* Adasum is not implemented: op=Adasum raises NotImplementedError.

The implementation is the package `ops`, one module per idea: state (constants, errors, the
process's state), process_sets, basics (init, shutdown, topology, what this build has), handles (poll,
synchronize, failures), tensors (checks, scaling, wire views), one module per collective family
(allreduce, broadcast, allgather, alltoall, reducescatter) and join (barrier and join). This module is
Horovod's import surface over them: `horovod.torch.mpi_ops.X` is the X those modules define.
"""
from .ops.state import (  # noqa: F401
    Adasum, Average, HorovodInternalError, HostsUpdatedInterrupt, Max, Min, Product, Sum, _state)
from .ops.process_sets import (  # noqa: F401
    ProcessSet, add_process_set, global_process_set, remove_process_set)
from .ops.basics import (  # noqa: F401
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init,
    is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
    nccl_built, rank, rocm_built, shutdown, size, start_timeline, stop_timeline)
from .ops.handles import poll, synchronize  # noqa: F401
from .ops.allreduce import (  # noqa: F401
    allreduce, allreduce_, allreduce_async, allreduce_async_, grouped_allreduce, grouped_allreduce_,
    grouped_allreduce_async, grouped_allreduce_async_, sparse_allreduce_async)
from .ops.broadcast import broadcast, broadcast_, broadcast_async, broadcast_async_  # noqa: F401
from .ops.allgather import (  # noqa: F401
    allgather, allgather_async, grouped_allgather, grouped_allgather_async)
from .ops.alltoall import alltoall, alltoall_async  # noqa: F401
from .ops.reducescatter import (  # noqa: F401
    grouped_reducescatter, grouped_reducescatter_async, reducescatter, reducescatter_async)
from .ops.join import barrier, join  # noqa: F401
