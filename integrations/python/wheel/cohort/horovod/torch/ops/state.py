"""What every part of cohort's Horovod shares: Horovod's reduce-op constants and error classes, and
the one per-process state that init() fills in and every operation reads."""
import threading

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


def _not_initialized():
    return ValueError("Horovod has not been initialized; use hvd.init().")
