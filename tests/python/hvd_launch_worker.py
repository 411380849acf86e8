"""One rank of a Horovod-style script under horovodrun's line (`horovodrun -np 2 python3 this.py`) or plain
`mpirun -np 2 python3 this.py`.

`import horovod.torch` must be cohort's (no Horovod is installed in the test's environment), hvd's ranks
and sizes must be what the launcher set (HOROVOD_*, or Open MPI's OMPI_COMM_WORLD_*), and a collective
must add up. Prints
"HVD OK rank=R" at the end; a failed check raises.
"""
import atexit
import os
import socket

import torch

import horovod.torch as hvd



checked = {}


def _ended_by_hvd_at_exit():
    # Registered before hvd.init(), so it runs after the shutdown hvd.init() registers (atexit is last in,
    # first out): Horovod's examples never call hvd.shutdown(), and hvd must end its groups itself.
    assert not hvd.is_initialized(), "hvd was still initialized at exit: its groups outlive the script"
    if "rank" in checked:  # every check above passed
        print(f"HVD OK rank={checked['rank']}", flush=True)


atexit.register(_ended_by_hvd_at_exit)
hvd.init()
assert hvd.__name__ == "cohort.horovod.torch", hvd.__name__
if "HOROVOD_RANK" in os.environ:  # horovodrun's line
    env = {k: int(os.environ[f"HOROVOD_{k}"]) for k in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK",
                                                        "CROSS_SIZE")}
    # The host as -H names it; without -H, this machine (cohort names it as its tags do).
    assert os.environ["HOROVOD_HOSTNAME"] == socket.gethostname(), os.environ["HOROVOD_HOSTNAME"]
else:  # plain mpirun: Open MPI's variables, one host
    env = {k: int(os.environ[f"OMPI_COMM_WORLD_{k}"]) for k in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE")}
    env.update(CROSS_RANK=0, CROSS_SIZE=1)
got = dict(RANK=hvd.rank(), SIZE=hvd.size(), LOCAL_RANK=hvd.local_rank(), LOCAL_SIZE=hvd.local_size(),
           CROSS_RANK=hvd.cross_rank(), CROSS_SIZE=hvd.cross_size())
assert got == env, f"hvd says {got}, the launcher's variables say {env}"
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
assert total.item() == hvd.size() * (hvd.size() + 1) / 2, total
checked["rank"] = env["RANK"]  # "HVD OK" comes at exit, once hvd has shut itself down
