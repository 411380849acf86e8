#!/usr/bin/python3
"""Wall time of a whole command, as a user waits for it: `--warmup` uncounted runs, then `--runs` timed
ones, each timed with time.monotonic() around subprocess.run (stdin from /dev/null, output discarded).
Prints one line: min/median/max seconds, the exit codes seen and the command.
Usage: launch_timing.py [--runs 5] [--warmup 1] -- COMMAND [ARG ...]
"""
import argparse
import statistics
import subprocess
import time

parser = argparse.ArgumentParser()
parser.add_argument("--runs", type=int, default=5)
parser.add_argument("--warmup", type=int, default=1)
parser.add_argument("command", nargs=argparse.REMAINDER)
args = parser.parse_args()
command = args.command[1:] if args.command[:1] == ["--"] else args.command

walls, codes = [], set()
for i in range(args.warmup + args.runs):
    start = time.monotonic()
    done = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.monotonic() - start
    if i >= args.warmup:
        walls.append(wall)
        codes.add(done.returncode)
print(f"wall_s min={min(walls):.3f} median={statistics.median(walls):.3f} max={max(walls):.3f} "
      f"runs={args.runs} rcs={sorted(codes)} cmd={' '.join(command)}")
