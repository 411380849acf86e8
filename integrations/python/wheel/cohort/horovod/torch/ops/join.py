"""Horovod's barrier and join: a rank out of data keeps taking part in the others' allreduces and
barriers (the comment above _JOINED says how), and _note, which counts every operation on
the world group for it."""
import collections
import datetime
import threading

import torch
import torch.distributed as dist

from .handles import _translate_errors
from .process_sets import _group_of, global_process_set
from .state import HorovodInternalError, _not_initialized, _state
from .tensors import _DTYPE_CODE, _all_gather_into


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
