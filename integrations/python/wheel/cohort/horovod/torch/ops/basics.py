"""Horovod's basics: init() and shutdown(), the topology (rank, size, local and cross ranks) and what
this build has (mpi_built, nccl_built, ...: truthful, cohort's own transports, never Horovod's)."""
import atexit
import datetime
import os
import socket
import zlib

import torch
import torch.distributed as dist

from .handles import synchronize
from .join import _start_join_watcher, _stop_join_watcher
from .process_sets import _build_world_group, add_process_set, global_process_set
from .state import _not_initialized, _state
from .tensors import _all_gather_into


def _env_int(*names):
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"hvd.init(): {name}={value!r} is not an integer") from None
    return None


def _timeout():
    """The deadline of our groups' rendezvous and operations: Horovod's HOROVOD_GLOO_TIMEOUT_SECONDS
    when set, else torch's default (30 min). COHORT_TIMEOUT, which the backend reads itself, overrides
    both for the operations (docs/pytorch.md)."""
    seconds = os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS")
    if not seconds:
        return datetime.timedelta(minutes=30)
    try:
        return datetime.timedelta(seconds=float(seconds))
    except ValueError:
        raise ValueError(f"hvd.init(): HOROVOD_GLOO_TIMEOUT_SECONDS={seconds!r} is not a number of seconds") from None


def _make_store(rank, size):
    """The job's TCPStore at MASTER_ADDR:MASTER_PORT (rank 0 hosts it), as env:// would build it."""
    addr = os.environ.get("MASTER_ADDR")
    port = _env_int("MASTER_PORT")
    if not addr and port is None and os.environ.get("PMIX_RANK") is not None:
        # Plain mpirun / srun --mpi=pmix (Horovod's MPI mode): rank 0's address travels through PMIx.
        import cohort_torch
        addr, port = cohort_torch.pmix_master_address(_state.timeout.total_seconds())
    if not addr or port is None:
        raise ValueError("hvd.init(): RANK and WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not: "
                         "start the script with `cohort run`, `horovodrun` or torchrun")
    kwargs = dict(is_master=rank == 0, timeout=_state.timeout)
    try:
        # torch >= 2.4 asks for libuv, which Debian 13's torch 2.6 lacks (docs/pytorch.md).
        return dist.TCPStore(addr, port, size, use_libuv=os.environ.get("USE_LIBUV", "0") == "1", **kwargs)
    except TypeError:
        return dist.TCPStore(addr, port, size, **kwargs)


def init(comm=None, process_sets=None):
    """Starts Horovod over cohort: joins the job's other ranks and learns the topology.

    The ranks come from the launcher's environment: `cohort run`, `horovodrun` or torchrun's
    (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; HOROVOD_* or Open MPI's
    OMPI_COMM_WORLD_* when those are absent). Without any, the process is a world of one, as
    Horovod's is when started without a launcher. When the script has already built torch's default
    group, hvd uses it if it is a cohort group and otherwise builds a cohort group beside it.
    """
    if comm is not None and not isinstance(comm, (list, tuple)):
        raise ValueError("hvd.init(comm=...): cohort takes no MPI communicator (mpi4py); "
                         "pass a list of ranks or nothing")
    with _state.lock:
        if _state.initialized:
            return
        if not getattr(_state, "shutdown_at_exit", False):
            # As Horovod does: the groups end before the interpreter does. A script that never calls
            # hvd.shutdown() (Horovod's examples) otherwise leaves the backend's worker threads alive into
            # Python's finalization, where one that needs the GIL is ended by pthread_exit and the
            # process aborts ("terminate called without an active exception", seen across hosts).
            atexit.register(shutdown)
            _state.shutdown_at_exit = True
        _state.timeout = _timeout()
        if dist.is_initialized():
            # The script built torch's default group itself: use it (a cohort one) or build one beside it.
            _state.rank, _state.size = dist.get_rank(), dist.get_world_size()
            if dist.get_backend() == "cohort":
                _state.world_group = dist.group.WORLD
            else:
                _state.world_group = dist.new_group(backend="cohort", timeout=_state.timeout)
            _state.owns_default_group = False
        else:
            rank = _env_int("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
            size = _env_int("WORLD_SIZE", "HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE")
            if rank is None or size is None:
                if rank is not None or size is not None:
                    raise ValueError("hvd.init(): only one of RANK and WORLD_SIZE is set")
                rank, size = 0, 1  # a plain `python3 train.py`: a world of one
                _state.store, _state.store_for = dist.HashStore(), None
            else:
                if not 0 <= rank < size:
                    raise ValueError(f"hvd.init(): RANK={rank} is outside WORLD_SIZE={size}")
                where = (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"), rank, size)
                if _state.store is None or _state.store_for != where:
                    # A store per job; a second init() in the same job (after shutdown()) reuses it
                    # under the next generation's prefix, since rank 0 cannot host a second store on
                    # the same port while the others may still reach the first.
                    _state.store, _state.store_for = _make_store(rank, size), where
            _state.rank, _state.size = rank, size
            _build_world_group()
            _state.owns_default_group = True
        _learn_topology()
        _start_join_watcher()
        _state.initialized = True
    global_process_set.process_set_id = 0
    _state.process_sets = {0: global_process_set}
    global_process_set.ranks = list(range(_state.size))
    for ps in process_sets or []:
        add_process_set(ps)


def _learn_topology():
    """local/cross ranks and sizes, as Horovod defines them: local = the ranks on this host; cross =
    the ranks with this process's local rank, one per host. The launcher's LOCAL_RANK/LOCAL_WORLD_SIZE
    say which host a rank is on; without them the host name does. One small allgather at init."""
    local_rank = _env_int("LOCAL_RANK", "HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
    local_size = _env_int("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
    host = zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF
    mine = torch.tensor([-1 if local_rank is None else local_rank,
                         -1 if local_size is None else local_size, host], dtype=torch.int64)
    every = torch.empty(_state.size, 3, dtype=torch.int64)
    _all_gather_into(every, mine, _state.world_group)
    if (every[:, 0] < 0).any() or (every[:, 1] < 0).any():
        # Some rank does not know its local rank: group the ranks by host name, in rank order.
        hosts = every[:, 2].tolist()
        every[:, 0] = torch.tensor([hosts[:r].count(h) for r, h in enumerate(hosts)])
        every[:, 1] = torch.tensor([hosts.count(h) for h in hosts])
    local_ranks = every[:, 0].tolist()
    _state.local_rank = local_ranks[_state.rank]
    _state.local_size = int(every[_state.rank, 1])
    _state.cross_rank = local_ranks[:_state.rank].count(_state.local_rank)
    _state.cross_size = local_ranks.count(_state.local_rank)


def shutdown():
    """Ends Horovod in this process: pending operations are waited for, the groups hvd built are
    destroyed. hvd.init() may be called again afterwards (with a launcher's fresh MASTER_PORT when
    the job is a new one)."""
    with _state.lock:
        if not _state.initialized:
            return
        for handle in list(_state.handles):
            try:
                synchronize(handle)
            except Exception:  # shutting down: a failed operation has already been reported or is moot
                pass
        for ps in list(_state.process_sets.values()):
            if ps is not global_process_set and ps._group is not None:
                dist.destroy_process_group(ps._group)
            ps._invalidate()
        _state.process_sets = {}
        _stop_join_watcher()
        if _state.owns_default_group:
            dist.destroy_process_group()
        elif _state.world_group is not dist.group.WORLD:
            dist.destroy_process_group(_state.world_group)
        _state.world_group = None
        _state.generation += 1  # a later init() builds its groups under a fresh prefix of the same store
        _state.initialized = False


def is_initialized():
    return _state.initialized


def _get(attr):
    if not _state.initialized:
        raise _not_initialized()
    return getattr(_state, attr)


def size():
    """The number of ranks in the job."""
    return _get("size")


def rank():
    """This process's rank in the job, 0..size()-1."""
    return _get("rank")


def local_size():
    """The number of ranks on this host."""
    return _get("local_size")


def local_rank():
    """This process's rank among the ranks on its host."""
    return _get("local_rank")


def cross_size():
    """The number of ranks that share this process's local rank (the hosts, in a uniform job)."""
    return _get("cross_size")


def cross_rank():
    """This process's rank among the ranks that share its local rank (its host's index, uniformly)."""
    return _get("cross_rank")


def is_homogeneous():
    """Whether every host runs the same number of ranks."""
    return _get("size") == _state.local_size * _state.cross_size


# ---------------------------------------------------------------------------------------------
# What this build has (truthful: cohort's own transports, never Horovod's)
# ---------------------------------------------------------------------------------------------
def mpi_built(verbose=False):
    """False: cohort runs without MPI (an `mpirun` launch works through PMIx, not MPI's collectives)."""
    return False


def mpi_enabled():
    return False


def mpi_threads_supported():
    if not _state.initialized:
        raise _not_initialized()
    return False


def gloo_built(verbose=False):
    """False: cohort's own shared-memory/TCP collectives serve every operation, not Gloo."""
    return False


def gloo_enabled():
    return False


def nccl_built(verbose=False):
    """The NCCL version torch's NCCL backend has (cohort hands CUDA tensors to it), or 0 without it."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return 0
    version = torch.cuda.nccl.version()
    if not isinstance(version, tuple):
        return int(version)  # torch 1.x: already NCCL_VERSION_CODE
    # NCCL_VERSION_CODE, as Horovod reports it: major*1000 + minor*100 + patch before NCCL 2.9,
    # major*10000 + minor*100 + patch from 2.9 on.
    major, minor, patch = (list(version) + [0, 0, 0])[:3]
    return (major * 1000 if (major, minor) < (2, 9) else major * 10000) + minor * 100 + patch


def ddl_built(verbose=False):
    return False


def ccl_built(verbose=False):
    return False


def cuda_built(verbose=False):
    """Whether this torch was built with CUDA (cohort stages CUDA tensors or hands them to NCCL)."""
    return torch.version.cuda is not None


def rocm_built(verbose=False):
    return getattr(torch.version, "hip", None) is not None


def start_timeline(file_path, mark_cycles=False):
    """Horovod's timeline is cohort's: `cohort run --timeline FILE` records every rank's operations."""
    raise NotImplementedError("hvd.start_timeline: record a timeline with `cohort run --timeline FILE` "
                              "(or horovodrun's --timeline-filename) instead (docs/horovod.md)")


def stop_timeline():
    raise NotImplementedError("hvd.stop_timeline: see hvd.start_timeline")
