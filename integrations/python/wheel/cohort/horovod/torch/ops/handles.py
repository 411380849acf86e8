"""Handles: an operation in flight (torch's Work and what turns its buffers into Horovod's result),
poll() and synchronize(), and the translation of the backend's failures into HorovodInternalError,
with the rebuild of the world group after a mismatch so that the next operation runs."""
import itertools
import time

import torch.distributed as dist

from .process_sets import _build_world_group, _new_group, global_process_set
from .state import HorovodInternalError, _not_initialized, _state

_handle_ids = itertools.count(1)


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


class _AllWork:
    """Several torch Works as one (a grouped operation's handle)."""

    def __init__(self, works):
        self.works = works

    def is_completed(self):
        return all(w.is_completed() for w in self.works)

    def wait(self):
        for w in self.works:
            w.wait()
