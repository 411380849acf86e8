#!/usr/bin/python3
"""The smallest torch.distributed job, for timing a launcher: join the group (gloo, env://), one barrier, leave."""
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
