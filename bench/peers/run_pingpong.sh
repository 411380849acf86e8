#!/usr/bin/env bash
# Loopback TCP round trip (tcp_pingpong.c), a sleeping receiver against a polling one, 8 B and 64 KiB:
# RUNS process runs of each.
# Usage: bench/peers/run_pingpong.sh   (RUNS=3, ITERS=20000 round trips per batch)
set -euo pipefail
cd "$(dirname "$0")"
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
gcc -O2 -o "$bin/tcp_pingpong" tcp_pingpong.c
for ((run = 1; run <= ${RUNS:-3}; run++)); do
  for mode in block spin; do
    for bytes in 8 65536; do "$bin/tcp_pingpong" "$mode" "$bytes" "${ITERS:-20000}"; done
  done
done
