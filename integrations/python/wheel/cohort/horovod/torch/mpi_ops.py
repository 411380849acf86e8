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
"""
import atexit
import collections
import datetime
import itertools
import math
import os
import socket
import threading
import time
import zlib

import torch
import torch.distributed as dist

import cohort_torch  # noqa: F401  (registers the "cohort" backend with torch.distributed)

# Horovod's reduce operation constants (horovod.common.basics; these are their values there).
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5

_TORCH_OP = {Sum: dist.ReduceOp.SUM, Average: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
             Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}
_OP_NAME = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}

# The dtypes cohort's reductions take (docs/pytorch.md, "What works"). Data movement (broadcast,
# allgather, alltoall) takes any dtype: the others travel as their bytes.
_REDUCIBLE = {torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
              torch.float32, torch.float64}


class HorovodInternalError(RuntimeError):
    """An operation failed inside the runtime (Horovod's name: elastic training catches it)."""


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added or removed (Horovod's name; raised by the elastic layer, not here)."""

    def __init__(self, skip_sync=False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class _State:
    """What init() learned and built; one per process."""

    def __init__(self):
        self.lock = threading.Lock()
        self.initialized = False
        self.owns_default_group = False  # init() built torch's default group, so shutdown() destroys it
        self.store = None                # the store our groups are built on (None: the user's default group)
        self.store_for = None            # (MASTER_ADDR, MASTER_PORT, rank, size) it was built for
        self.world_group = None
        self.generation = 0              # groups built after a failed one (each on its own store prefix)
        self.timeout = None
        self.rank = 0
        self.size = 1
        self.local_rank = 0
        self.local_size = 1
        self.cross_rank = 0
        self.cross_size = 1
        self.handles = {}                # handle -> _Pending
        self.names_in_flight = set()
        self.process_sets = {}           # process_set_id -> ProcessSet


_state = _State()
_handle_ids = itertools.count(1)


def _not_initialized():
    return ValueError("Horovod has not been initialized; use hvd.init().")


# ---------------------------------------------------------------------------------------------
# Process sets
# ---------------------------------------------------------------------------------------------
class ProcessSet:
    """A static subset of the ranks (Horovod's process sets), served by a cohort subgroup.

    Built before init() (`hvd.init(process_sets=[...])`) or by add_process_set() after it; every
    rank builds every process set, in the same order (a torch.distributed rule for new groups).
    """

    def __init__(self, ranks_or_comm):
        if not isinstance(ranks_or_comm, (list, tuple, range)):
            raise ValueError("cohort serves process sets given as a list of ranks, not an MPI communicator")
        self.ranks = sorted(int(r) for r in ranks_or_comm)
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"process set ranks {self.ranks} repeat a rank")
        self.process_set_id = None
        self._group = None  # the torch group; None on ranks outside the set and for the global set

    def _invalidate(self):
        self.process_set_id = None
        self._group = None

    def size(self):
        """The number of ranks in this set (None before it is registered)."""
        if self.process_set_id is None:
            return None
        return len(self.ranks)

    def rank(self):
        """This process's rank within the set (None when it is not in it or the set is unregistered)."""
        if self.process_set_id is None or _state.rank not in self.ranks:
            return None
        return self.ranks.index(_state.rank)

    def included(self):
        """Whether this process is in the set (None before the set is registered)."""
        if self.process_set_id is None:
            return None
        return _state.rank in self.ranks

    def __str__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


global_process_set = ProcessSet([])


def _group_of(process_set):
    """The torch group for an operation on `process_set`, after checking that we may use it."""
    if not _state.initialized:
        raise _not_initialized()
    if process_set is global_process_set or process_set is None:
        return _state.world_group
    if process_set.process_set_id is None or process_set.process_set_id not in _state.process_sets:
        raise ValueError(f"{process_set} is not registered: pass it to hvd.init(process_sets=...) "
                         "or hvd.add_process_set()")
    if _state.rank not in process_set.ranks:
        raise ValueError(f"rank {_state.rank} is not in {process_set}: only its ranks may use it")
    return process_set._group


def _set_size(process_set):
    if process_set is global_process_set or process_set is None:
        return _state.size
    return len(process_set.ranks)


def _set_rank(process_set):
    if process_set is global_process_set or process_set is None:
        return _state.rank
    return process_set.ranks.index(_state.rank)


def add_process_set(process_set):
    """Registers a process set on every rank (collective: all ranks call it, in the same order)."""
    if not _state.initialized:
        raise _not_initialized()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set} is already registered")
    bad = [r for r in process_set.ranks if not 0 <= r < _state.size]
    if bad:
        raise ValueError(f"process set ranks {bad} are outside 0..{_state.size - 1}")
    for known in _state.process_sets.values():
        if known.ranks == process_set.ranks:
            raise ValueError(f"a process set with ranks {process_set.ranks} exists: {known}")
    group = _new_group(process_set.ranks)
    process_set.process_set_id = max(_state.process_sets, default=0) + 1
    process_set._group = group if _state.rank in process_set.ranks else None
    _state.process_sets[process_set.process_set_id] = process_set
    return process_set


def remove_process_set(process_set):
    """Unregisters a process set (collective). Returns whether it was registered."""
    if not _state.initialized:
        raise _not_initialized()
    if process_set is global_process_set:
        raise ValueError("the global process set cannot be removed")
    if _state.process_sets.pop(process_set.process_set_id, None) is None:
        return False
    if process_set._group is not None:
        dist.destroy_process_group(process_set._group)
    process_set._invalidate()
    return True


def _new_group(ranks):
    # Every rank calls new_group for every set (torch's rule), members or not.
    return dist.new_group(ranks=ranks, backend="cohort", timeout=_state.timeout)


# ---------------------------------------------------------------------------------------------
# init / shutdown / topology
# ---------------------------------------------------------------------------------------------
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


def _build_world_group():
    """Builds (or rebuilds, after a failure) the group the global process set runs on."""
    store = dist.PrefixStore(f"cohort.horovod/{_state.generation}", _state.store)
    dist.init_process_group("cohort", store=store, rank=_state.rank, world_size=_state.size,
                            timeout=_state.timeout)
    _state.world_group = dist.group.WORLD


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


# ---------------------------------------------------------------------------------------------
# Handles
# ---------------------------------------------------------------------------------------------
class _Pending:
    """An operation in flight: torch's Work, and what turns its buffers into Horovod's result."""

    __slots__ = ("work", "finish", "name", "what", "group")

    def __init__(self, work, finish, name, what, group):
        self.work, self.finish, self.name, self.what, self.group = work, finish, name, what, group


class _FailedWork:
    """Stands for the Work of an operation whose communicator failed under it (see _recover)."""

    def __init__(self, message):
        self.message = message

    def is_completed(self):
        return True

    def wait(self):
        raise HorovodInternalError(self.message)


def _claim_name(name, what):
    if name is None:
        return None
    if name in _state.names_in_flight:
        raise ValueError(f"{what}: an operation named {name!r} is already in flight on this rank; "
                         "synchronize it first or use another name")
    _state.names_in_flight.add(name)
    return name


def _start(what, name, group, launch, finish):
    """Claims the name, launches the operation on `group` (launch() -> torch Work, or None for a
    handle that only gathers others), returns a handle."""
    if not _state.initialized:
        raise _not_initialized()
    _claim_name(name, what)
    try:
        work = _translate_errors(what, group, launch)
    except BaseException:
        _state.names_in_flight.discard(name)
        raise
    handle = next(_handle_ids)
    _state.handles[handle] = _Pending(work, finish, name, what, group)
    return handle


def poll(handle):
    """True when the operation of `handle` has finished (synchronize() then returns at once).

    A False answer first sleeps 50 us with the GIL released: the operation runs on the backend's worker
    thread in this process, and scripts call poll() in a loop (`while not hvd.poll(h): pass`), which
    otherwise takes the processor from that thread, and from the launcher, whenever the ranks outnumber
    the cores (measured: a 15-byte allreduce on 2 simulated hosts x 2 ranks, 38-48 ms per spinning call
    without a pause, 0.15-1.7 ms with one, as in synchronize(); bench/hvd_poll.sh). A yield
    (os.sched_yield) gave the processor straight back to the spinning ranks under load, long enough for a
    launcher to miss its store's answers and stop the job (docs/horovod.md)."""
    pending = _state.handles.get(handle)
    if pending is None:
        raise ValueError(f"hvd.poll: handle {handle} is unknown (already synchronized?)")
    if pending.work is None or pending.work.is_completed():
        return True
    time.sleep(5e-5)
    return False


def synchronize(handle):
    """Waits for the operation of `handle` and returns its result (the output tensor, or Horovod's
    tuple for alltoall with splits). Raises HorovodInternalError when it failed."""
    pending = _state.handles.pop(handle, None)
    if pending is None:
        raise ValueError(f"hvd.synchronize: handle {handle} is unknown (already synchronized?)")
    _state.names_in_flight.discard(pending.name)
    if pending.work is not None:
        _translate_errors(pending.what, pending.group, pending.work.wait)
    return pending.finish()


def _translate_errors(what, group, fn, *args):
    """Runs fn(*args), an operation on `group`; the backend's RuntimeError becomes Horovod's
    HorovodInternalError, and a mismatch on the world group rebuilds it (_recover)."""
    try:
        return fn(*args)
    except HorovodInternalError:
        raise
    except RuntimeError as e:
        message = f"{what} failed: {e}"
        if "mismatched calls" in message:
            if group is _state.world_group:
                _recover(message)
            elif any(ps._group is group for ps in _state.process_sets.values()):
                # Only the set's ranks saw it, and torch builds a group only with every rank of the
                # world taking part, so the set's group cannot be rebuilt here.
                message += " (the process set's group is failed for good; the world's still works)"
            # else: a group that an earlier rebuild replaced (a handle from before it): nothing to rebuild.
        raise HorovodInternalError(message) from e


def _recover(message):
    """After a failed communicator: every rank that saw the failure builds the next generation of the
    world group on the same store (a new key prefix), so the next operation runs, as Horovod's does
    after an error. Only after a mismatch: every rank saw it and is here, whereas after a lost rank a
    rebuild would wait for it (the elastic layer handles that case)."""
    if not _state.owns_default_group or _state.store is None:
        return  # the user's own default group: theirs to rebuild
    for pending in _state.handles.values():
        # Finished operations keep their results; the others' communicator is gone: synchronize() says so.
        if pending.work is not None and not pending.work.is_completed():
            pending.work = _FailedWork(f"{pending.what} failed: its communicator failed under it: {message}")
    dist.destroy_process_group()  # every group, the process sets' too
    _state.generation += 1
    _build_world_group()
    # The process sets live on: each gets a new group, in registration order on every rank.
    for set_id in sorted(_state.process_sets):
        ps = _state.process_sets[set_id]
        if ps is not global_process_set:
            group = _new_group(ps.ranks)
            ps._group = group if _state.rank in ps.ranks else None


# ---------------------------------------------------------------------------------------------
# Scaling and checks
# ---------------------------------------------------------------------------------------------
def _check_tensor(tensor, what):
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise ValueError(f"{what}: sparse tensors are not supported here (use sparse_allreduce_async)")


def _scale(tensor, factor):
    """tensor *= factor in place; integers are scaled in float64 and truncated, as Horovod does."""
    if factor == 1.0:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.mul_(factor)
    else:
        tensor.copy_((tensor.double() * factor).trunc())


def _divide(tensor, divisor):
    """Average's division: true division for floats, floor division for integers (Horovod's)."""
    if divisor == 1:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.div_(divisor)
    else:
        tensor.floor_divide_(divisor)


def _reduce_op(op, average, what):
    """Horovod's (average, op) pair -> one of our op constants; Average when neither is given."""
    if op is not None and average is not None:
        raise ValueError(f"{what}: the op parameter supersedes average; pass one of them")
    if op is None:
        op = Average if average is None or average else Sum
    if op == Adasum:
        raise NotImplementedError(f"{what}: Adasum is not implemented by cohort; use op=hvd.Average or hvd.Sum")
    if op not in _TORCH_OP:
        raise ValueError(f"{what}: unknown reduce op {op!r}")
    return op


def _check_reducible(tensor, what):
    if tensor.dtype not in _REDUCIBLE:
        raise ValueError(f"{what}: dtype {tensor.dtype} cannot be reduced by cohort; supported: "
                         + ", ".join(str(d).replace("torch.", "") for d in sorted(_REDUCIBLE, key=str)))


# ---------------------------------------------------------------------------------------------
# allreduce
# ---------------------------------------------------------------------------------------------
def _torch_op(op, tensor, n):
    """The backend's op for Horovod's `op` on `tensor`, and what to divide the result by afterwards.
    Average on floating dtypes is the backend's AVG, which divides as it reduces (one pass over the
    tensor less than a sum and a division); on integers it is a sum, then Horovod's floor division."""
    if op == Average:
        if tensor.is_floating_point():
            return dist.ReduceOp.AVG, 1
        return dist.ReduceOp.SUM, n
    return _TORCH_OP[op], 1


def _allreduce_start(tensor, output, name, op, prescale_factor, postscale_factor, process_set, what):
    _check_tensor(tensor, what)
    _check_reducible(tensor, what)
    group = _group_of(process_set)
    torch_op, divisor = _torch_op(op, tensor, _set_size(process_set))
    if output is None:
        output = tensor.clone(memory_format=torch.contiguous_format)
    _scale(output, prescale_factor)

    def finish():
        _scale(output, postscale_factor)
        _divide(output, divisor)
        return output

    def launch():
        if group is _state.world_group:
            _note("ar", output.numel(), output.dtype, torch_op)
        return dist.all_reduce(output, torch_op, group=group, async_op=True)

    return _start(what, name, group, launch, finish)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    """Starts an allreduce of `tensor` into a new tensor; returns a handle for poll()/synchronize()."""
    op = _reduce_op(op, average, "allreduce_async")
    return _allreduce_start(tensor, None, name, op, prescale_factor, postscale_factor, process_set,
                            "allreduce_async")


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    """Starts an in-place allreduce of `tensor`; returns a handle for poll()/synchronize()."""
    op = _reduce_op(op, average, "allreduce_async_")
    return _allreduce_start(tensor, tensor, name, op, prescale_factor, postscale_factor, process_set,
                            "allreduce_async_")


def _allreduce_now(tensor, output, name, op, prescale_factor, postscale_factor, process_set, what):
    """The blocking path, without a handle: the per-call cost matters for many small gradients.
    output None: the result goes to a new contiguous tensor."""
    _check_tensor(tensor, what)
    _check_reducible(tensor, what)
    group = _group_of(process_set)
    if name is not None and name in _state.names_in_flight:
        _claim_name(name, what)  # raises the duplicate-name error
    torch_op, divisor = _torch_op(op, tensor, _set_size(process_set))
    if output is None:
        output = tensor.clone(memory_format=torch.contiguous_format)
    _scale(output, prescale_factor)
    if group is _state.world_group:
        _note("ar", output.numel(), output.dtype, torch_op)
    _translate_errors(what, group, dist.all_reduce, output, torch_op, group)
    _scale(output, postscale_factor)
    _divide(output, divisor)
    return output


class _AllreduceGrad(torch.autograd.Function):
    """allreduce as an autograd function: the gradient is allreduced with the same op and factors."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return _allreduce_now(tensor, None, name, op, prescale_factor, postscale_factor, process_set, "allreduce")

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, ps = ctx.args
        return _allreduce_now(grad, None, None, op, pre, post, ps, "allreduce (backward)"), None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Returns the reduction of `tensor` over the ranks (Average by default); `tensor` is unchanged.
    Differentiable. `compression` (hvd.Compression.none/fp16) compresses what travels."""
    op = _reduce_op(op, average, "allreduce")
    ctx = None
    if compression is not None:
        tensor, ctx = compression.compress(tensor)
    if tensor.requires_grad and torch.is_grad_enabled():
        result = _AllreduceGrad.apply(tensor, name, op, prescale_factor, postscale_factor, process_set)
    else:
        result = _allreduce_now(tensor, None, name, op, prescale_factor, postscale_factor, process_set, "allreduce")
    return compression.decompress(result, ctx) if compression is not None else result


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """Reduces `tensor` in place over the ranks (Average by default) and returns it."""
    op = _reduce_op(op, average, "allreduce_")
    return _allreduce_now(tensor, tensor, name, op, prescale_factor, postscale_factor, process_set, "allreduce_")


# ---------------------------------------------------------------------------------------------
# broadcast
# ---------------------------------------------------------------------------------------------
def _check_root(root_rank, process_set, what):
    members = range(_state.size) if process_set in (None, global_process_set) else process_set.ranks
    if root_rank not in members:
        raise ValueError(f"{what}: root_rank {root_rank} is not a rank of the process set ({_set_size(process_set)} ranks)")


def _wire_factor(dtype):
    """How many wire elements one element of `dtype` becomes in _as_wire."""
    if dtype in _REDUCIBLE:
        return 1
    if dtype.is_complex:
        return 2
    return torch.empty((), dtype=dtype).element_size()


def _as_wire(tensor):
    """The tensor cohort moves: itself for the dtypes it knows, else a byte view (bool, int16, complex)."""
    if tensor.dtype in _REDUCIBLE:
        return tensor
    if tensor.is_complex():
        return torch.view_as_real(tensor)
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor.reshape(-1).view(torch.uint8)


def _broadcast_start(tensor, output, root_rank, name, process_set, what):
    _check_tensor(tensor, what)
    group = _group_of(process_set)
    _check_root(root_rank, process_set, what)
    _agree_on_broadcast(tensor, root_rank, group, _set_size(process_set), what)
    if output is not tensor:
        output.copy_(tensor)
    wire = _as_wire(output)

    def launch():
        if group is _state.world_group:
            _note("x", "broadcast")
        return dist.broadcast(wire, root_rank, group=group, async_op=True)

    return _start(what, name, group, launch, lambda: output)


def _agree_on_broadcast(tensor, root_rank, group, n, what):
    """One small allgather of every rank's (root, dtype, shape) before the data moves: a broadcast whose
    ranks name different roots would otherwise pass unnoticed across hosts (each "root" only sends, so
    no rank receives a message whose signature could disagree). Raises the same error on every rank."""
    if n == 1:
        return
    slots = 11
    if tensor.dim() > slots - 3:
        raise ValueError(f"{what}: tensors of more than {slots - 3} dimensions are not supported")
    mine = torch.full((slots,), -1, dtype=torch.int64)
    mine[0] = root_rank
    mine[1] = _DTYPE_CODE.get(tensor.dtype, 99)
    mine[2] = tensor.dim()
    mine[3:3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    every = torch.empty(n, slots, dtype=torch.int64)
    if group is _state.world_group:
        _note("ag", slots)
    _translate_errors(what, group, _all_gather_into, every, mine, group)
    for r in range(1, n):
        if not torch.equal(every[r], every[0]):
            _refuse_if_joined(every, "Broadcast is not supported with Join at this time.", what)
            def text(row):
                return f"root_rank={int(row[0])} with {_describe_row(row[1:])}"
            raise HorovodInternalError(f"{what}: mismatched calls: rank {r} of the process set called it with "
                                       f"{text(every[r])} but its rank 0 with {text(every[0])}")


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts a broadcast of root_rank's `tensor` into a new tensor on every rank; returns a handle."""
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _broadcast_start(tensor, output, root_rank, name, process_set, "broadcast_async")


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts an in-place broadcast of root_rank's `tensor`; returns a handle."""
    if not tensor.is_contiguous():
        raise ValueError("broadcast_async_: the tensor must be contiguous")
    return _broadcast_start(tensor, tensor, root_rank, name, process_set, "broadcast_async_")


class _BroadcastGrad(torch.autograd.Function):
    """broadcast as an autograd function: the root's gradient is the sum of every rank's."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.args = (root_rank, process_set)
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        root_rank, ps = ctx.args
        summed = _allreduce_now(grad, None, None, Sum, 1.0, 1.0, ps, "broadcast (backward)")
        if _state.rank != root_rank:
            summed.zero_()
        return summed, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Returns root_rank's `tensor` on every rank; `tensor` is unchanged. Differentiable."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return _BroadcastGrad.apply(tensor, root_rank, name, process_set)
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrites `tensor` with root_rank's on every rank and returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---------------------------------------------------------------------------------------------
# allgather (first dimensions may differ)
# ---------------------------------------------------------------------------------------------
def _all_gather_into(output, tensor, group, async_op=False):
    fn = getattr(dist, "all_gather_into_tensor", None) or dist._all_gather_base
    return fn(output, tensor, group=group, async_op=async_op)


def _exchange_shapes(tensor, group, n, what):
    """Every rank's shape, through one small allgather; raises the same error on every rank when the
    ranks' tensors differ in dtype, rank (number of dimensions) or any dimension but the first."""
    # [dtype code, ndim, dims...]: every rank sends the same width, so 8 dimensions at most.
    slots = 10
    if tensor.dim() > slots - 2:
        raise ValueError(f"{what}: tensors of more than {slots - 2} dimensions are not supported")
    mine = torch.full((slots,), -1, dtype=torch.int64)
    mine[0] = _DTYPE_CODE.get(tensor.dtype, 99)
    mine[1] = tensor.dim()
    mine[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    every = torch.empty(n, slots, dtype=torch.int64)
    if group is _state.world_group:
        _note("ag", slots)
    _translate_errors(what, group, _all_gather_into, every, mine, group)
    # Compared with the set's first rank, so that every rank names the same pair.
    first = every[0].clone()
    first[2] = -1
    for r in range(1, n):
        row = every[r].clone()
        row[2] = -1
        if not torch.equal(row, first):
            _refuse_if_joined(every, "Allgather is not supported with Join at this time. "
                                     "Specify sparse_to_dense=True if using DistributedOptimizer", what)
            raise HorovodInternalError(
                f"{what}: mismatched tensors: rank {r} of the process set has {_describe_row(every[r])} but its "
                f"rank 0 has {_describe_row(every[0])} (they may differ in the first dimension only)")
    return every


_DTYPE_CODE = {d: i for i, d in enumerate([
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
    torch.float64, torch.bool, torch.bfloat16, torch.complex64, torch.complex128])}
_CODE_DTYPE = {i: d for d, i in _DTYPE_CODE.items()}


def _describe_row(row):
    dtype = str(_CODE_DTYPE.get(int(row[0]), "unknown dtype")).replace("torch.", "")
    return f"{dtype}{row[2:2 + int(row[1])].tolist()}"


def _allgather_start(tensor, name, process_set, what):
    _check_tensor(tensor, what)
    group = _group_of(process_set)
    n = _set_size(process_set)
    source = tensor.contiguous() if tensor.dim() else tensor.reshape(1)
    every = _exchange_shapes(source, group, n, what)
    firsts = every[:, 2].tolist()
    rest = list(source.shape[1:])
    output = source.new_empty([sum(firsts)] + rest)
    if len(set(firsts)) == 1:
        # Equal first dimensions: one allgather straight into the output.
        def launch():
            if group is _state.world_group:
                _note("x", "allgather")
            return _all_gather_into(_as_wire(output), _as_wire(source), group, async_op=True)
        finish = lambda: output  # noqa: E731
    else:
        # Uneven: every rank pads to the longest, the padded blocks are gathered, the padding cut off.
        longest = max(firsts)
        padded = source.new_zeros([longest] + rest)
        padded[:source.shape[0]] = source
        gathered = source.new_empty([n * longest] + rest)
        def launch():
            if group is _state.world_group:
                _note("x", "allgather")
            return _all_gather_into(_as_wire(gathered), _as_wire(padded), group, async_op=True)

        def finish():
            offset = 0
            for r, rows in enumerate(firsts):
                output[offset:offset + rows] = gathered[r * longest:r * longest + rows]
                offset += rows
            return output
    return _start(what, name, group, launch, finish)


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts an allgather: the ranks' tensors concatenated along the first dimension (which may differ
    between ranks); returns a handle."""
    return _allgather_start(tensor, name, process_set, "allgather_async")


class _AllgatherGrad(torch.autograd.Function):
    """allgather as an autograd function: each rank's gradient is its rows of the summed gradient."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.process_set = process_set
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        ps = ctx.process_set
        rows = allgather(torch.tensor([ctx.rows]), process_set=ps).tolist()
        summed = _allreduce_now(grad, None, None, Sum, 1.0, 1.0, ps, "allgather (backward)")
        me = _set_rank(ps)
        start = sum(rows[:me])
        return summed[start:start + rows[me]], None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Returns the ranks' tensors concatenated along the first dimension. Differentiable."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllgatherGrad.apply(tensor, name, process_set)
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Starts an allgather of each tensor of the list; synchronize() returns the list of results."""
    handles = [allgather_async(t, None, process_set) for t in tensors]
    return _start("grouped_allgather_async", name, None, lambda: None,
                  lambda: [synchronize(h) for h in handles])


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """allgather of each tensor of the list; returns the list of results."""
    return synchronize(grouped_allgather_async(tensors, name, process_set))


# ---------------------------------------------------------------------------------------------
# grouped allreduce: one allreduce per dtype over the tensors flattened into one buffer
# ---------------------------------------------------------------------------------------------
def _grouped_allreduce_start(tensors, outputs, name, op, prescale_factor, postscale_factor, process_set, what):
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError(f"{what}: expected a non-empty list of tensors")
    for t in tensors:
        _check_tensor(t, what)
        _check_reducible(t, what)
    group = _group_of(process_set)
    n = _set_size(process_set)
    # One flat buffer per dtype, in first-seen order (the same order on every rank, which the
    # communicator's signatures check through the buffers' counts and dtypes).
    by_dtype = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    buffers = []
    for dtype, indices in by_dtype.items():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        _scale(flat, prescale_factor)
        buffers.append((flat, indices) + _torch_op(op, flat, n))

    def launch():
        if group is _state.world_group:
            for flat, _, torch_op, _ in buffers:
                _note("ar", flat.numel(), flat.dtype, torch_op)
        works = [dist.all_reduce(flat, torch_op, group=group, async_op=True) for flat, _, torch_op, _ in buffers]
        return _AllWork(works)

    def finish():
        for flat, indices, _, divisor in buffers:
            _scale(flat, postscale_factor)
            _divide(flat, divisor)
            offset = 0
            for i in indices:
                n = tensors[i].numel()
                outputs[i].copy_(flat[offset:offset + n].view(tensors[i].shape))
                offset += n
        return list(outputs)

    return _start(what, name, group, launch, finish)


class _AllWork:
    """Several torch Works as one (a grouped operation's handle)."""

    def __init__(self, works):
        self.works = works

    def is_completed(self):
        return all(w.is_completed() for w in self.works)

    def wait(self):
        for w in self.works:
            w.wait()


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Starts the allreduce of a list of tensors as one operation per dtype; returns a handle whose
    synchronize() gives the list of results."""
    op = _reduce_op(op, average, "grouped_allreduce_async")
    outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    return _grouped_allreduce_start(tensors, outputs, name, op, prescale_factor, postscale_factor, process_set,
                                    "grouped_allreduce_async")


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """Starts the in-place allreduce of a list of tensors; returns a handle."""
    op = _reduce_op(op, average, "grouped_allreduce_async_")
    return _grouped_allreduce_start(tensors, list(tensors), name, op, prescale_factor, postscale_factor,
                                    process_set, "grouped_allreduce_async_")


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set):
    """The reductions of a list of tensors (Average by default); the inputs are unchanged."""
    op = _reduce_op(op, average, "grouped_allreduce")
    ctxs = None
    if compression is not None:
        pairs = [compression.compress(t) for t in tensors]
        tensors, ctxs = [p[0] for p in pairs], [p[1] for p in pairs]
    outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    results = synchronize(_grouped_allreduce_start(tensors, outputs, name, op, prescale_factor, postscale_factor,
                                                   process_set, "grouped_allreduce"))
    if compression is not None:
        results = [compression.decompress(r, c) for r, c in zip(results, ctxs)]
    return results


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    """Reduces a list of tensors in place and returns it."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Starts the allreduce of a sparse COO tensor (Sum or Average): every rank's entries gathered and
    coalesced; returns a handle whose synchronize() gives the sparse result."""
    if op not in (Sum, Average):
        raise ValueError("sparse_allreduce_async: only Sum and Average are supported for sparse tensors")
    if not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async: expected a sparse COO tensor")
    group = _group_of(process_set)
    output = tensor.clone()
    n = _set_size(process_set)

    def finish():
        return output / n if op == Average else output

    def launch():
        if group is _state.world_group:
            _note("x", "sparse allreduce")
        return dist.all_reduce(output, dist.ReduceOp.SUM, group=group, async_op=True)

    return _start("sparse_allreduce_async", name, group, launch, finish)


# ---------------------------------------------------------------------------------------------
# alltoall
# ---------------------------------------------------------------------------------------------
def _alltoall_start(tensor, splits, name, process_set, what):
    _check_tensor(tensor, what)
    group = _group_of(process_set)
    n = _set_size(process_set)
    source = tensor.contiguous()
    if source.dim() == 0:
        raise ValueError(f"{what}: the tensor needs at least one dimension")
    rows = source.shape[0]
    if splits is None:
        if rows % n:
            raise ValueError(f"{what}: splits not given, but the first dimension ({rows}) is not a multiple "
                             f"of the number of ranks ({n})")
        send = [rows // n] * n
    else:
        send = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        if len(send) != n:
            raise ValueError(f"{what}: splits has {len(send)} entries; the process set has {n} ranks")
        if any(s < 0 for s in send) or sum(send) > rows:
            raise ValueError(f"{what}: splits {send} must be >= 0 and sum to at most the first dimension ({rows})")
        source = source[:sum(send)]
    # One small alltoall first: rank j learns how many rows each rank sends it, and every rank
    # checks that the others' tensors agree in dtype and in every dimension but the first.
    slots = 10
    if source.dim() > slots - 2:
        raise ValueError(f"{what}: tensors of more than {slots - 2} dimensions are not supported")
    info = torch.full((n, slots), -1, dtype=torch.int64)
    info[:, 0] = torch.tensor(send, dtype=torch.int64)
    info[:, 1] = _DTYPE_CODE.get(source.dtype, 99)
    info[:, 2:2 + source.dim() - 1] = torch.tensor(source.shape[1:], dtype=torch.int64) if source.dim() > 1 else -1
    info[:, 9] = source.dim()
    got = torch.empty_like(info)
    if group is _state.world_group:
        _note("a2a", slots)
    _translate_errors(what, group, dist.all_to_all_single, got, info, None, None, group)
    mine = info[0, 1:]
    for r in range(n):
        if not torch.equal(got[r, 1:], mine):
            _refuse_if_joined(got, "Alltoall is not supported with Join at this time.", what)
            raise HorovodInternalError(
                f"{what}: mismatched tensors: rank {r} of the process set sends {_describe_alltoall(got[r])} "
                f"but rank {_set_rank(process_set)} has {_describe_alltoall(info[0])} (they may differ in the "
                "first dimension only)")
    received = got[:, 0].tolist()
    output = source.new_empty([sum(received)] + list(source.shape[1:]))
    # Split sizes count elements of the flat wire tensors: a row is row_numel elements of the dtype,
    # and more of them where the dtype travels as its float pairs or bytes (_as_wire).
    per_row = math.prod(source.shape[1:]) * _wire_factor(source.dtype)
    wire_in, wire_out = _as_wire(source).reshape(-1), _as_wire(output).reshape(-1)

    def launch():
        if group is _state.world_group:
            _note("x", "alltoall")
        return dist.all_to_all_single(wire_out, wire_in, [r * per_row for r in received],
                                      [s * per_row for s in send], group=group, async_op=True)

    received_splits = (splits.new_tensor(received) if isinstance(splits, torch.Tensor)
                       else torch.tensor(received, dtype=torch.int32))

    def finish():
        return output if splits is None else (output, received_splits)

    return _start(what, name, group, launch, finish)


def _describe_alltoall(row):
    dims = int(row[9])
    dtype = str(_CODE_DTYPE.get(int(row[1]), "unknown dtype")).replace("torch.", "")
    return f"{dtype}[*, {', '.join(str(d) for d in row[2:2 + dims - 1].tolist())}]" if dims > 1 else f"{dtype}[*]"


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Starts an alltoall: rows of `tensor` go to the ranks (splits[j] rows to rank j, or an even split),
    each rank receives its rows from every rank in rank order. synchronize() returns the output, or
    (output, received_splits) when splits were given."""
    return _alltoall_start(tensor, splits, name, process_set, "alltoall_async")


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Blocking alltoall; see alltoall_async."""
    return synchronize(_alltoall_start(tensor, splits, name, process_set, "alltoall"))


# ---------------------------------------------------------------------------------------------
# reducescatter: the reduction's first dimension split over the ranks (the first ones get one row
# more when it does not divide evenly, as Horovod's)
# ---------------------------------------------------------------------------------------------
def _scatter_rows(rows, n):
    return [rows // n + (1 if r < rows % n else 0) for r in range(n)]


def _reducescatter_start(tensor, name, op, process_set, prescale_factor, postscale_factor, what):
    _check_tensor(tensor, what)
    _check_reducible(tensor, what)
    op = _reduce_op(op, None, what)
    if tensor.dim() == 0:
        raise ValueError(f"{what}: the tensor needs at least one dimension")
    group = _group_of(process_set)
    n = _set_size(process_set)
    me = _set_rank(process_set)
    counts = _scatter_rows(tensor.shape[0], n)
    source = tensor.contiguous().clone()
    _scale(source, prescale_factor)
    reduce_scatter = getattr(dist, "reduce_scatter_tensor", None) or dist._reduce_scatter_base
    longest = counts[0]
    if len(set(counts)) == 1:
        output = tensor.new_empty([longest] + list(tensor.shape[1:]))
        def launch():
            if group is _state.world_group:
                _note("x", "reducescatter")
            return reduce_scatter(output, source, _TORCH_OP[op], group=group, async_op=True)
        result = lambda: output  # noqa: E731
    else:
        # Uneven rows: each rank's block is padded to the longest (rank 0's), reduced and scattered
        # as even blocks; every rank keeps its real rows (the padding rows only meet padding).
        padded = source.new_zeros([n * longest] + list(tensor.shape[1:]))
        offset = 0
        for r, rows in enumerate(counts):
            padded[r * longest:r * longest + rows] = source[offset:offset + rows]
            offset += rows
        block = tensor.new_empty([longest] + list(tensor.shape[1:]))
        def launch():
            if group is _state.world_group:
                _note("x", "reducescatter")
            return reduce_scatter(block, padded, _TORCH_OP[op], group=group, async_op=True)
        result = lambda: block[:counts[me]]  # noqa: E731

    def finish():
        out = result()
        _scale(out, postscale_factor)
        if op == Average:
            _divide(out, n)
        return out

    return _start(what, name, group, launch, finish)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    """Starts a reducescatter: the reduction (Average by default) of every rank's `tensor`, of which each
    rank gets its block of rows; returns a handle."""
    return _reducescatter_start(tensor, name, op, process_set, prescale_factor, postscale_factor,
                                "reducescatter_async")


def reducescatter(tensor, name=None, compression=None, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Blocking reducescatter; see reducescatter_async."""
    ctx = None
    if compression is not None:
        tensor, ctx = compression.compress(tensor)
    out = synchronize(_reducescatter_start(tensor, name, op, process_set, prescale_factor, postscale_factor,
                                           "reducescatter"))
    return compression.decompress(out, ctx) if compression is not None else out


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Starts a reducescatter of each tensor of the list; synchronize() returns the list of results."""
    handles = [_reducescatter_start(t, None, op, process_set, prescale_factor, postscale_factor,
                                    "grouped_reducescatter_async") for t in tensors]
    return _start("grouped_reducescatter_async", name, None, lambda: None, lambda: [synchronize(h) for h in handles])


def grouped_reducescatter(tensors, name=None, compression=None, op=Average, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0):
    """Blocking grouped reducescatter."""
    ctxs = None
    if compression is not None:
        pairs = [compression.compress(t) for t in tensors]
        tensors, ctxs = [p[0] for p in pairs], [p[1] for p in pairs]
    outs = synchronize(grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor, postscale_factor))
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)] if compression is not None else outs


# ---------------------------------------------------------------------------------------------
# barrier / join
# ---------------------------------------------------------------------------------------------
def barrier(process_set=global_process_set):
    """Returns when every rank of the process set has called it."""
    group = _group_of(process_set)
    if group is _state.world_group:
        _note("bar")
    _translate_errors("barrier", group, dist.barrier, group)


# Horovod's join: a rank that calls join() has run out of data; the others go on issuing operations
# and the joined rank takes part in their allreduces with zeros until every rank has joined.
#
# cohort does not negotiate operations: each rank issues its collectives and they meet by issue order.
# So every rank counts the operations it issues on the world group (_note: an increment and a tuple
# appended to a bounded record, nothing else while nobody has joined). A rank that joins announces
# "rank r joined at operation c" as an event in the job's store. A watcher thread on every rank (its
# own store connection, blocked in a store wait, so the operations' path pays nothing for it) learns of
# the event and has its rank publish the descriptor of each of its operations from #c on: those already
# issued, from the record, and every later one as it is issued. The joined rank replays them: zeros for
# an allreduce (Average divides by the whole world, as Horovod's does), a row marking it as joined for
# the small exchange that starts a broadcast, allgather or alltoall, on which every rank that has not
# joined raises Horovod's "not supported with Join" error. The last rank to join publishes "done" at its
# operation count, where every joined rank stops; join() returns that rank everywhere.
_JOINED = -2                 # the joined rank's row in a broadcast/allgather/alltoall exchange
_JOIN_RECORD = 1 << 16       # descriptors kept for the operations a rank issued before it heard of a join
_REDUCE_OP_NAME = {dist.ReduceOp.SUM: "SUM", dist.ReduceOp.AVG: "AVG", dist.ReduceOp.MIN: "MIN",
                   dist.ReduceOp.MAX: "MAX", dist.ReduceOp.PRODUCT: "PRODUCT"}
_DTYPE_NAME = {d: str(d).replace("torch.", "") for d in _DTYPE_CODE}


class _Join:
    def __init__(self):
        self.seq = 0                      # world-group operations this rank has issued (or replayed)
        self.record = collections.deque(maxlen=_JOIN_RECORD)  # (seq, descriptor) of the last ones
        self.publish_from = None          # set by the watcher: publish operations from this one on
        self.joined = {}                  # rank -> (round, operation count at its join), rounds not ended here
        self.round = 0                    # rounds of joins this rank has ended (every rank counts the same)
        self.main_store = None            # the job's store, as the main thread reaches it
        self.lock = threading.Lock()
        self.prefix = None
        self.store = None                 # the watcher's own connection to the job's store
        self.thread = None


_join = _Join()


def _note(*desc):
    """Counts an operation on the world group (desc: its kind and what a joined rank needs to take part
    in it); publishes it once some rank has joined. The record's entries are (number, kind, ...)."""
    j = _join
    seq = j.seq
    j.seq = seq + 1
    j.record.append((seq,) + desc)
    if j.publish_from is not None:
        j.main_store.set(f"{j.prefix}/op/{j.round}/{seq}", _encode(desc))


def _encode(desc):
    kind = desc[0]
    if kind == "ar":
        return f"ar {desc[1]} {_DTYPE_NAME[desc[2]]} {_REDUCE_OP_NAME[desc[3]]}"
    if kind in ("ag", "a2a"):
        return f"{kind} {desc[1]}"
    if kind == "bar":
        return "bar"
    return f"x {desc[1]}"


def _refuse_if_joined(rows, message, what):
    """A mismatch in a broadcast/allgather/alltoall exchange whose odd row is a joined rank's: raises
    Horovod's error for that operation (every rank that has not joined sees the same rows)."""
    if bool((rows.reshape(rows.shape[0], -1) == _JOINED).all(dim=1).any()):
        raise HorovodInternalError(f"{what}: {message}")


def _start_join_watcher():
    """Starts the thread that learns of other ranks' joins (for a world of more than one rank whose
    store is a TCPStore: ours, or under the script's own default group)."""
    store = _state.store
    if store is None:
        store = dist.distributed_c10d._get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = getattr(store, "underlying_store", None)  # absent before torch 2.0: no watcher
    if not isinstance(store, dist.TCPStore) or _state.size == 1:
        return
    j = _join
    j.prefix = f"cohort.horovod/join/{_state.generation}"
    j.seq, j.publish_from, j.joined, j.round = 0, None, {}, 0
    j.record.clear()
    j.main_store = store
    try:
        client = dist.TCPStore(store.host, store.port, is_master=False, timeout=_state.timeout,
                               wait_for_workers=False, use_libuv=False)
    except TypeError:
        client = dist.TCPStore(store.host, store.port, is_master=False, timeout=_state.timeout)
    j.store = client
    j.thread = threading.Thread(target=_watch_joins, args=(client, j.prefix, _state.rank),
                                name="cohort-hvd-join", daemon=True)
    j.thread.start()


def _watch_joins(client, prefix, me):
    j = _join
    k = 1
    while True:
        key = f"{prefix}/event/{k}"
        try:
            client.wait([key], datetime.timedelta(hours=1))
            event = client.get(key).decode().split()
        except Exception as e:  # noqa: BLE001 (the store's errors have no common class across torch versions)
            if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                continue
            return  # the store is gone: the job is ending
        k += 1
        if event[0] == "stop":
            if int(event[1]) == me:
                return
            continue
        rank, round_, at = int(event[1]), int(event[2]), int(event[3])
        with j.lock:
            if round_ < j.round:
                continue  # a join of a round this rank has already ended
            j.joined[rank] = (round_, at)
            if rank == me:
                continue  # this rank is in join(): it issues nothing more
            j.publish_from = at if j.publish_from is None else min(at, j.publish_from)
            # Operations this rank issued before hearing of the join; later ones publish themselves
            # (_note reads publish_from after appending to the record, so none is missed).
            issued = [(entry[0], entry[1:]) for entry in list(j.record) if entry[0] >= at]
        for seq, desc in issued:
            try:
                client.set(f"{prefix}/op/{round_}/{seq}", _encode(desc))
            except Exception:  # noqa: BLE001
                return


def _stop_join_watcher():
    j = _join
    if j.thread is None:
        return
    try:
        # Through the main connection: the watcher's is busy in its wait (a TCPStore client runs one
        # request at a time).
        k = j.main_store.add(f"{j.prefix}/events", 1)
        j.main_store.set(f"{j.prefix}/event/{k}", f"stop {_state.rank}")
        j.thread.join(timeout=5)
    except Exception:  # noqa: BLE001 (the store may already be gone when the job ends)
        pass
    j.thread = None
    j.publish_from = None


def _replay(desc, seq, device):
    """Takes part, as a joined rank, in operation #seq that the other ranks issue."""
    kind, *fields = desc.split()
    group = _state.world_group
    if kind == "ar":
        dtype = getattr(torch, fields[1])
        zeros = torch.zeros(int(fields[0]), dtype=dtype, device=device)
        _translate_errors("join", group, dist.all_reduce, zeros, getattr(dist.ReduceOp, fields[2]), group)
    elif kind == "ag":
        mine = torch.full((int(fields[0]),), _JOINED, dtype=torch.int64)
        every = torch.empty(_state.size, int(fields[0]), dtype=torch.int64)
        _translate_errors("join", group, _all_gather_into, every, mine, group)
    elif kind == "a2a":
        info = torch.full((_state.size, int(fields[0])), _JOINED, dtype=torch.int64)
        _translate_errors("join", group, dist.all_to_all_single, torch.empty_like(info), info, None, None, group)
    elif kind == "bar":
        _translate_errors("join", group, dist.barrier, group)
    else:
        raise HorovodInternalError(f"hvd.join(): operation #{seq} of the ranks that have not joined is a "
                                   f"{' '.join(fields)}, which a joined rank cannot take part in (Horovod "
                                   "allows allreduce and barrier while ranks are joined)")


def _join_counts(store, round_):
    """Every rank's operation count at its join of this round (all have joined)."""
    return [int(store.get(f"{_join.prefix}/at/{round_}/{r}")) for r in range(_state.size)]


def join(device=-1):
    """Says that this rank has run out of data; returns, once every rank has joined, the rank that
    joined last (the same on every rank).

    Until then this rank takes part in the allreduces and barriers the others still issue, with zeros
    (Average divides by the whole world's size, as Horovod's does); a broadcast, allgather or alltoall
    they issue meanwhile raises Horovod's "not supported with Join" error on them. A rank that has not
    joined and issues nothing for HOROVOD_GLOO_TIMEOUT_SECONDS makes join() raise, naming it."""
    if not _state.initialized:
        raise _not_initialized()
    if _state.size == 1:
        return 0
    j = _join
    if j.thread is None:
        raise HorovodInternalError("hvd.join(): the job's store is not a TCPStore, so joined ranks cannot "
                                   "learn the others' operations (docs/horovod.md)")
    me = _state.rank
    store = j.main_store
    at, round_ = j.seq, j.round
    store.set(f"{j.prefix}/at/{round_}/{me}", str(at))
    k = store.add(f"{j.prefix}/events", 1)
    store.set(f"{j.prefix}/event/{k}", f"join {me} {round_} {at}")
    arrived = store.add(f"{j.prefix}/arrived/{round_}", 1)
    dev = torch.device("cuda", device) if device >= 0 else torch.device("cpu")
    if arrived == _state.size:
        # The last to arrive, though not always the furthest on: a rank that joined before it may have
        # left operations in flight, which every rank must take part in. The round ends at the highest
        # count: every rank replays the others' operations up to it.
        ats = _join_counts(store, round_)
        store.set(f"{j.prefix}/op/{round_}/{max(ats)}", f"done {me}")
    seq = at
    while True:
        key = f"{j.prefix}/op/{round_}/{seq}"
        try:
            store.wait([key], _state.timeout)
        except Exception as e:  # noqa: BLE001
            if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                raise HorovodInternalError(f"hvd.join(): the job's store failed: {e}") from e
            with j.lock:
                waiting = sorted(set(range(_state.size)) - {r for r, (n, _) in j.joined.items() if n == round_}
                                 - {me})
            names = ", ".join(str(r) for r in waiting) or "?"
            raise HorovodInternalError(
                f"hvd.join(): rank {me} joined and waited {_state.timeout.total_seconds():g} s for operation "
                f"#{seq} of rank(s) {names}, which neither issued it nor joined") from None
        desc = store.get(key).decode()
        if desc.startswith("done "):
            last = int(desc.split()[1])
            break
        _replay(desc, seq, dev)
        seq += 1
    # This rank's operations from the first joiner's count on are published by its watcher while the
    # round lasts; it may not have read every join of the round yet, and once the round ends here it
    # would take them for old ones: so they are published here too (the same values) before it ends.
    first = min(_join_counts(store, round_))
    for entry in list(j.record):
        if entry[0] >= first:
            store.set(f"{j.prefix}/op/{round_}/{entry[0]}", _encode(entry[1:]))
    with j.lock:
        j.seq = seq
        j.round = round_ + 1
        j.joined = {r: (n, c) for r, (n, c) in j.joined.items() if n > round_}
        j.publish_from = min(c for _, c in j.joined.values()) if j.joined else None
    return last
