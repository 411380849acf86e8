#!/usr/bin/python3
"""torchrun for Debian 12's torch 1.13 on Python 3.11: the unmodified torch.distributed.run, one function fixed.

Why: `python3 -m torch.distributed.run` (torchrun) as shipped dies before starting any worker with
    AttributeError: 'NoneType' object has no attribute 'get'
torch 1.13 parses its --redirects/--tee values with Std.from_str, which looks the number up by iterating
the IntFlag `Std`. Python 3.11 changed IntFlag iteration to yield only single-bit members, so NONE (0)
and ALL (3) are never found and from_str("0"), the default, returns None. torch 2.x fixed this upstream.

What: Std.from_str is replaced by one that builds the member from the number (Std(int(v))), accepting
and rejecting exactly what the original's regular expressions do; then torchrun's own main() runs with
the same command line. Use it wherever the docs say torchrun:
    GLOO_SOCKET_IFNAME=lo /usr/bin/python3 bench/peers/torchrun311.py --nproc_per_node 2 \\
        --master_addr 127.0.0.1 --master_port 29500 train.py
"""
import re

from torch.distributed.elastic.multiprocessing import api


def _std_from_str(cls, value):
    if re.match(api._VALUE_REGEX, value):  # one setting for every rank, e.g. "0"
        return cls(int(value))
    if re.match(api._MAPPING_REGEX, value):  # per local rank, e.g. "0:3,1:0"
        pairs = (item.split(":") for item in value.split(","))
        return {int(rank): cls(int(std)) for rank, std in pairs}
    raise ValueError(f"{value} does not match: <{api._VALUE_REGEX}> or <{api._MAPPING_REGEX}>")


api.Std.from_str = classmethod(_std_from_str)

if __name__ == "__main__":
    from torch.distributed.run import main

    main()
