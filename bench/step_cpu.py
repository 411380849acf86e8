#!/usr/bin/env python3
"""Where a training run's wall time per step goes, per process, from the kernel's own accounting.

    bench/step_cpu.py [--from A] [--to B] [--match NAME] COMMAND...

Runs COMMAND (a `cohort run` of an example, or the example alone), and when its output says
"step: A/" and then "step: B/" (the examples' lead prints every 10th step) reads, for every
descendant process whose name is NAME (default: the command's own program name), the sum over its
threads of /proc/PID/task/TID/schedstat: time on a CPU and time runnable but waiting for one. Per step
of the window: on CPU (ms), waiting for a CPU (ms), and the share of the wall time on a CPU. The rest
of a step (wall - on CPU - waiting) is time the process slept: its own waits for a peer, I/O.

These figures do not depend on the machine being quiet: CPU time per step says how much work a step
took; the share on a CPU says how much of its CPU the scheduler gave the process. Prints one line:

    sps 286.4 step 166.0 ms | pid 5720 cpu0 153.8 ms on CPU, 3.1 ms waiting, 93% | pid 5721 cpu1 ...
"""
import argparse
import os
import re
import subprocess
import sys
import time


def descendants(root):
    children = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            stat = open(f"/proc/{p}/stat").read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(p))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def process_times(pid):
    """(ns on a CPU, ns waiting for one, the CPU its main thread last ran on) summed over its threads."""
    run = wait = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    for tid in tids:
        try:
            fields = open(f"/proc/{pid}/task/{tid}/schedstat").read().split()
        except OSError:
            continue
        run += int(fields[0])
        wait += int(fields[1])
    cpu = int(stat[stat.rfind(")") + 2:].split()[36])  # field 39: the CPU it last ran on
    return run, wait, cpu


def snapshot(root, name):
    procs = {}
    for pid in descendants(root):
        try:
            comm = open(f"/proc/{pid}/comm").read().strip()
        except OSError:
            continue
        if comm == name:
            t = process_times(pid)
            if t:
                procs[pid] = t
    return time.monotonic(), procs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from", dest="first", type=int, default=10)
    ap.add_argument("--to", dest="last", type=int, default=30)
    ap.add_argument("--match", default="")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    if not a.command:
        ap.error("no command")
    # The process name the kernel shows (comm): the program's file name, at most 15 characters.
    name = a.match or next((os.path.basename(w) for w in reversed(a.command) if "/" in w), "")[:15]
    proc = subprocess.Popen(a.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    snaps, tail, sps = {}, [], None
    for line in proc.stdout:
        tail = (tail + [line])[-5:]
        m = re.search(r"step: (\d+)/", line)
        if m and int(m.group(1)) in (a.first, a.last) and int(m.group(1)) not in snaps:
            snaps[int(m.group(1))] = snapshot(proc.pid, name)
        m = re.search(r"samples/s: ([\d.]+)", line)
        if m:
            sps = m.group(1)
    proc.wait()
    if sps is None or a.first not in snaps or a.last not in snaps:
        sys.stdout.write(f"failed (exit {proc.returncode}, no step {a.first} and {a.last} lines of {name}): "
                         + " / ".join(l.strip() for l in tail) + "\n")
        return 1
    (t0, p0), (t1, p1) = snaps[a.first], snaps[a.last]
    steps = a.last - a.first
    wall_ms = (t1 - t0) * 1e3 / steps
    parts = [f"sps {sps} step {wall_ms:.1f} ms"]
    for pid in sorted(p1):
        if pid not in p0:
            continue
        run = (p1[pid][0] - p0[pid][0]) / 1e6 / steps
        wait = (p1[pid][1] - p0[pid][1]) / 1e6 / steps
        parts.append(f"pid {pid} cpu{p1[pid][2]} {run:.1f} ms on CPU, {wait:.1f} ms waiting, {100 * run / wall_ms:.0f}%")
    print(" | ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
