#!/usr/bin/env python3
"""Launch to first collective, builds side by side: `cohort run -n N examples/barrier/barrier` of each
build directory given, interleaved, ROUNDS timed runs each after one warm-up; prints median, min, max.

    python3 bench/launch/launch_to_barrier.py ROUNDS N BUILD_DIR [BUILD_DIR ...]
"""
import statistics
import subprocess
import sys
import time

rounds, n, builds = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
times = {b: [] for b in builds}
for i in range(rounds + 1):
    for b in builds:
        start = time.perf_counter()
        subprocess.run([f"{b}/tools/cohort", "run", "-n", n, f"{b}/examples/barrier/barrier"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if i > 0:  # the first round warms the page cache
            times[b].append(time.perf_counter() - start)
for b, t in times.items():
    print(f"{b}: median {statistics.median(t) * 1000:.1f} ms (min {min(t) * 1000:.1f}, max {max(t) * 1000:.1f}), "
          f"{len(t)} runs")
