"""Worker for test_operation_numbers_are_the_users_calls (run under `cohort run --stats`).

`calls` large all_reduces of one tensor (it moves into shared memory at the second, and is reduced in
place after that), then one more all_reduce whose size differs between the ranks: both ranks get the
MismatchError, which must name that call's number, calls + 1. Prints "MOVED <bool>" and
"RAISED <message>", then exits 3, so that the launcher keeps the flight recorder's dumps.
"""
import os
import sys

import torch
import torch.distributed as dist

import cohort_torch  # noqa: F401  (registers the backend)


def main():
    calls = int(sys.argv[1])
    dist.init_process_group("cohort")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 1 << 18  # 1 MiB of float32: above the backend's 256 KiB threshold for moving a tensor
    t = torch.full((n,), float(rank + 1))
    first, moved = t.data_ptr(), False
    for i in range(calls):
        t.fill_(float(rank + 1))
        dist.all_reduce(t)
        if i == 1:
            moved = t.data_ptr() != first
        assert t[n - 1].item() == world * (world + 1) / 2, f"call {i + 1}: {t[n - 1].item()}"
    print(f"MOVED {moved}", flush=True)
    # Call calls + 1: rank 1 passes one element fewer.
    bad = torch.ones(n - rank)
    try:
        dist.all_reduce(bad)
    except RuntimeError as e:
        print(f"RAISED {e}".replace("\n", " "), flush=True)
        os._exit(3)  # the group is broken: no destroy, no further collective
    print("NOT RAISED", flush=True)
    sys.exit(1)


if __name__ == "__main__":
    main()
