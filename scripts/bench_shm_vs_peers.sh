#!/bin/bash
# Intra-host collectives, 2 ranks, side by side in one run: cohort shm::Group (bench/shm_collectives),
# Open MPI with its default components (btl vader = shared memory) and torch.distributed gloo, plus
# this machine's memcpy bandwidth (bench/peers/membw.c), all with the peers' method (bench_mpi.c).
# Rounds interleave the peers so that the noisy host's drift hits all of them alike.
# Usage: scripts/bench_shm_vs_peers.sh [rounds=2] [out=perf-shm-raw.txt]   (build bench/shm_collectives first)
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS=${PEERS:-$ROOT/bench/peers}  # the peers' programs (bench/peers/README.md)
ROUNDS=${1:-2}
OUT=${2:-$ROOT/perf-shm-raw.txt}
SIZES=8,1024,65536,1048576,4194304,16777216,67108864,268435456
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mpicc -O2 -o "$TMP/bench_mpi" $PEERS/bench_mpi.c -lm
gcc -O3 -march=native -fopenmp -o "$TMP/membw" $PEERS/membw.c
export GLOO_SOCKET_IFNAME=lo
MPIRUN="mpirun --allow-run-as-root --oversubscribe --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo"
PORT=$((29700 + RANDOM % 200))
COHORT=$ROOT/build/bench/shm_collectives
for ((round = 1; round <= ROUNDS; round++)); do
  echo "# round $round $(date -u +%FT%TZ) load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT"
  for t in 1 2; do
    OMP_NUM_THREADS=$t OMP_PROC_BIND=spread "$TMP/membw" 256 11 | grep RESULT | sed "s/^/round=$round /" | tee -a "$OUT"
  done
  for op in allreduce allgather broadcast; do
    "$COHORT" $op $SIZES 2>&1 | grep RESULT | sed "s/^/round=$round /" | tee -a "$OUT"
    $MPIRUN -n 2 "$TMP/bench_mpi" $op $SIZES 2>&1 | grep RESULT | sed "s/^/round=$round /" | tee -a "$OUT"
    PORT=$((PORT + 1))
    (cd $PEERS && /usr/bin/python3 torchrun311.py --nproc_per_node 2 --master_addr 127.0.0.1 --master_port $PORT \
      bench_torch.py --op $op --sizes $SIZES 2>&1 | grep RESULT | sed "s/^/round=$round /" | tee -a "$OUT")
  done
done
echo "# done $(date -u +%FT%TZ) load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT"
