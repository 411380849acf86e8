#!/usr/bin/env bash
# This host's memory bandwidth (membw.c): RUNS process runs of REPS repetitions each, 1 and 2 threads,
# MIB MiB buffers. Needs gcc with OpenMP.
# Usage: bench/peers/run_membw.sh   (RUNS=3, REPS=11, MIB=256, THREADS="1 2")
set -euo pipefail
cd "$(dirname "$0")"
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
gcc -O3 -march=native -fopenmp -o "$bin/membw" membw.c
for ((run = 1; run <= ${RUNS:-3}; run++)); do
  for t in ${THREADS:-1 2}; do OMP_NUM_THREADS=$t OMP_PROC_BIND=spread "$bin/membw" "${MIB:-256}" "${REPS:-11}"; done
done
