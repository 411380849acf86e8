"""Horovod's process sets, each served by a cohort subgroup of torch.distributed, and the world group
the global process set runs on (built at init, rebuilt after a failure)."""
import torch.distributed as dist

from .state import _not_initialized, _state


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


def _build_world_group():
    """Builds (or rebuilds, after a failure) the group the global process set runs on."""
    store = dist.PrefixStore(f"cohort.horovod/{_state.generation}", _state.store)
    dist.init_process_group("cohort", store=store, rank=_state.rank, world_size=_state.size,
                            timeout=_state.timeout)
    _state.world_group = dist.group.WORLD
