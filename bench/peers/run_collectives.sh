#!/usr/bin/env bash
# The collective peers side by side on this host, in interleaved rounds (separate launches), so that the
# host's drift hits every peer alike:
#   allreduce, n = 2 and 4: torch.distributed gloo, Open MPI default (vader shared memory), Open MPI forced
#     over TCP, Gloo C++ AllreduceRing and AllreduceRingChunked;
#   broadcast and allgather, n = 2, 1 MiB and 64 MiB: torch gloo, Open MPI default and TCP.
# Prints the RESULT lines (with round=R in front); feed them to aggregate.py for tables. Needs Open MPI
# (mpicc, mpirun), python3-torch and libgloo-dev.
# Usage: bench/peers/run_collectives.sh [ROUNDS=3]
#   SIZES=8,1024,...  allreduce sizes (default 8 B .. 256 MiB); TRIALS, MIN_TIME: per size (default 5, 0.5 s)
#   NS="2 4"          rank counts for allreduce; OP_SIZES=1048576,67108864: broadcast and allgather sizes
set -euo pipefail
cd "$(dirname "$0")"
rounds=${1:-3}
sizes=${SIZES:-8,1024,65536,1048576,4194304,16777216,67108864,268435456}
op_sizes=${OP_SIZES:-1048576,67108864}
trials=${TRIALS:-5}
min_time=${MIN_TIME:-0.5}
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
mpicc -O2 -o "$bin/bench_mpi" bench_mpi.c -lm
g++ -O2 -std=c++17 -o "$bin/bench_gloo" bench_gloo.cc -lgloo -lpthread
export GLOO_SOCKET_IFNAME=lo BENCH_GLOO=$bin/bench_gloo
# Open MPI skips the loopback interface unless told; the TCP runs also leave out shared memory and IPv6.
mpirun=(mpirun --allow-run-as-root --oversubscribe --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo)
mpi_tcp=(--mca pml ob1 --mca btl tcp,self --mca btl_tcp_disable_family 6)
port=$((29600 + RANDOM % 200))
torch() {  # N OP SIZES
  port=$((port + 1))
  /usr/bin/python3 torchrun311.py --nproc_per_node "$1" --master_addr 127.0.0.1 --master_port "$port" \
    bench_torch.py --op "$2" --sizes "$3" --trials "$trials" --min-time "$min_time" 2>&1
}
results() { grep RESULT | sed "s/^/round=$round /"; }
for ((round = 1; round <= rounds; round++)); do
  echo "# round $round $(date -u +%FT%TZ)"
  for n in ${NS:-2 4}; do
    torch "$n" allreduce "$sizes" | results
    "${mpirun[@]}" -n "$n" "$bin/bench_mpi" allreduce "$sizes" "$trials" "$min_time" 2>&1 | results
    "${mpirun[@]}" "${mpi_tcp[@]}" -n "$n" "$bin/bench_mpi" allreduce "$sizes" "$trials" "$min_time" -tcp 2>&1 | results
    ./run_gloo.sh "$n" ring "$sizes" "$trials" "$min_time" 2>&1 | results
    ./run_gloo.sh "$n" ring_chunked "$sizes" "$trials" "$min_time" 2>&1 | results
  done
  for op in broadcast allgather; do
    torch 2 "$op" "$op_sizes" | results
    "${mpirun[@]}" -n 2 "$bin/bench_mpi" "$op" "$op_sizes" "$trials" "$min_time" 2>&1 | results
    "${mpirun[@]}" "${mpi_tcp[@]}" -n 2 "$bin/bench_mpi" "$op" "$op_sizes" "$trials" "$min_time" -tcp 2>&1 | results
  done
done
echo "# done $(date -u +%FT%TZ)"
