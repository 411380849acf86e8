"""Horovod's elastic API (`hvd.elastic.run`, `hvd.elastic.TorchState`) on cohort's restarts (docs/horovod.md).

Horovod keeps the workers alive when a host is lost: the survivors catch HorovodInternalError, restore
their last commit from memory and go on. cohort instead ends the generation and starts every worker
again (an elastic job's next generation, `cohort run --nnodes MIN:MAX`; a restart, `--max-restarts`), so
the memory of a surviving process is gone. A commit is therefore also written to a file, one per local
rank of each host, under the job's id:

    $TMPDIR/cohort-hvd-elastic-<uid>/<job id>/<host>.local<LOCAL_RANK>.pt

A worker of the next generation (same host, same local rank) reads it back before its first step, and
`sync()` then hands the newest commit among the ranks (a node that joined has none) to every rank. The
file of a rank is removed when its training function returns; a job that fails for good leaves them
(the folder is this user's only, mode 0700).
"""
import copy
import os
import socket
import tempfile

import torch

from cohort.horovod.torch.functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                                            broadcast_parameters)
from cohort.horovod.torch.mpi_ops import HorovodInternalError, HostsUpdatedInterrupt, size

__all__ = ["run", "State", "ObjectState", "TorchState", "HorovodInternalError", "HostsUpdatedInterrupt"]


def _commit_path():
    """This rank's commit file, or None outside a launcher's job (a world of one keeps commits in memory)."""
    job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("COHORT_JOB_ID")
    local = os.environ.get("LOCAL_RANK", os.environ.get("HOROVOD_LOCAL_RANK"))
    if not job or local is None:
        return None
    top = os.path.join(tempfile.gettempdir(), f"cohort-hvd-elastic-{os.getuid()}")
    os.makedirs(top, mode=0o700, exist_ok=True)
    st = os.lstat(top)
    if not os.path.isdir(top) or os.path.islink(top) or st.st_uid != os.getuid():
        raise RuntimeError(f"hvd.elastic: refusing the folder {top}: it is not this user's own folder")
    folder = os.path.join(top, job.replace("/", "_"))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    # The host is named too: hosts that share a $TMPDIR (a network filesystem), or agents that stand for
    # hosts on one machine (COHORT_HOST_ID, as cohort's tests run them), must not share files.
    host = socket.gethostname() + ("." + os.environ["COHORT_HOST_ID"] if os.environ.get("COHORT_HOST_ID") else "")
    return os.path.join(folder, f"{host.replace('/', '_')}.local{int(local)}.pt")


class State:
    """Horovod's elastic State: commit() saves (memory and this rank's file), restore() goes back to the last
    commit, sync() makes every rank hold the newest commit among them."""

    def __init__(self, **kwargs):
        self._reset_callbacks = []
        self._path = _commit_path()
        self.commits = 0  # how many commits this state has had, across generations (the newest wins in sync)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._extra_names = list(kwargs)

    def register_reset_callbacks(self, callbacks):
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Saves the state (Horovod's commit): after a lost rank, training resumes from here."""
        self.commits += 1
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Horovod raises HostsUpdatedInterrupt here when hosts were added or removed. Under cohort a
        membership change ends the generation and restarts every worker, which then resumes from the last
        commit: a running worker never sees one, so there is nothing to raise."""

    # -- what a subclass keeps: a picklable snapshot, and how to put it back --
    def _snapshot(self):
        return {name: copy.deepcopy(getattr(self, name)) for name in self._extra_names}

    def _apply(self, snapshot):
        for name, value in snapshot.items():
            setattr(self, name, copy.deepcopy(value))

    def save(self):
        self._saved = (self.commits, self._snapshot())
        if self._path is not None:
            # Written whole, then renamed: a rank killed while saving leaves the previous commit.
            tmp = f"{self._path}.{os.getpid()}.tmp"
            torch.save({"commits": self.commits, "state": self._saved[1]}, tmp)
            os.replace(tmp, self._path)

    def restore(self):
        """Back to the last commit (in this process, or in the file the last generation left)."""
        if getattr(self, "_saved", None) is None:
            return
        self.commits = self._saved[0]
        self._apply(self._saved[1])

    def _load_previous_generation(self):
        """The commit this host's local rank left before the job restarted, if any."""
        if self._path is None or not os.path.exists(self._path):
            return False
        saved = torch.load(self._path)
        self._saved = (saved["commits"], saved["state"])
        self.restore()
        return True

    def sync(self):
        """Every rank takes the newest commit among the ranks (lowest rank on a tie): a node that joined, or a
        rank whose file was lost with its host, gets the state the others trained to."""
        if size() == 1:
            return
        commits = allgather_object(self.commits, name="cohort.elastic.commits")
        root = max(range(len(commits)), key=lambda r: (commits[r], -r))
        self._sync_from(root)
        self.commits = commits[root]
        self.save()

    def _sync_from(self, root):
        snapshot = broadcast_object(self._snapshot(), root_rank=root, name="cohort.elastic.state")
        self._apply(snapshot)

    def _finished(self):
        if self._path is not None and os.path.exists(self._path):
            os.remove(self._path)
            try:
                os.rmdir(os.path.dirname(self._path))  # the job's folder, once its last rank finished
            except OSError:
                pass


class ObjectState(State):
    """Horovod's ObjectState: picklable attributes, kept and synchronised as a whole."""


class TorchState(State):
    """Horovod's TorchState: a model and an optimizer (their state_dicts) and other picklable attributes."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        self.model = model
        self.optimizer = optimizer
        super().__init__(**kwargs)

    def _snapshot(self):
        snap = super()._snapshot()
        if self.model is not None:
            snap["__model__"] = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            snap["__optimizer__"] = copy.deepcopy(self.optimizer.state_dict())
        return snap

    def _apply(self, snapshot):
        snapshot = dict(snapshot)
        if "__model__" in snapshot:
            self.model.load_state_dict(snapshot.pop("__model__"))
        if "__optimizer__" in snapshot:
            self.optimizer.load_state_dict(snapshot.pop("__optimizer__"))
        super()._apply(snapshot)

    def _sync_from(self, root):
        # Tensors as Horovod sends them (the parameters and optimizer state by broadcast), the rest pickled.
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=root)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=root)
        extras = broadcast_object(State._snapshot(self), root_rank=root, name="cohort.elastic.extras")
        State._apply(self, extras)


def run(func):
    """Horovod's `@hvd.elastic.run`: `func(state, ...)` resumes from the last commit.

    Before the first call the state is restored from the commit this rank left in the job's previous
    generation (or restart), and synchronised to the newest commit among the ranks. A lost rank makes the
    survivors' collectives raise HorovodInternalError; cohort then stops the job's workers and starts them
    again (elastic generations, --max-restarts), so the error is left to end this process: the next
    generation resumes from the file. HostsUpdatedInterrupt (never raised by cohort itself) syncs and goes on.
    """

    def wrapper(state, *args, **kwargs):
        if state._load_previous_generation():
            state.on_reset()
        state.sync()
        while True:
            try:
                result = func(state, *args, **kwargs)
                state._finished()
                return result
            except HostsUpdatedInterrupt as interrupt:
                if not interrupt.skip_sync:
                    state.sync()
                state.on_reset()

    return wrapper
