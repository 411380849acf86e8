#!/usr/bin/env bash
# How long the peers' launchers take to run a job that does nothing, whole-process wall time
# (launch_timing.py: 1 warm-up, then RUNS counted runs; min/median/max), for N = 2, 4, 8 workers:
#   torchrun (torchrun311.py) running trivial_torch.py, with its default --monitor_interval (5 s) and 0.1 s;
#   mpirun running mpi_trivial (MPI_Init, a barrier, MPI_Finalize);
# and two reference points: importing torch, and mpirun -n N /bin/true.
# Usage: bench/peers/run_launch.sh   (NS="2 4 8", RUNS=5)
set -euo pipefail
cd "$(dirname "$0")"
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
mpicc -O2 -o "$bin/mpi_trivial" mpi_trivial.c
export GLOO_SOCKET_IFNAME=lo
mpirun=(mpirun --allow-run-as-root --oversubscribe --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo)
timing=(/usr/bin/python3 launch_timing.py --runs "${RUNS:-5}" --)
torchrun=(/usr/bin/python3 torchrun311.py --master_addr 127.0.0.1 --master_port $((29650 + RANDOM % 100)))
"${timing[@]}" /usr/bin/python3 -c 'import torch'
"${timing[@]}" /usr/bin/python3 -c 'import torch.distributed.run'
for n in ${NS:-2 4 8}; do
  "${timing[@]}" "${torchrun[@]}" --nproc_per_node "$n" trivial_torch.py
  "${timing[@]}" "${torchrun[@]}" --monitor_interval 0.1 --nproc_per_node "$n" trivial_torch.py
  "${timing[@]}" "${mpirun[@]}" -n "$n" "$bin/mpi_trivial"
  "${timing[@]}" "${mpirun[@]}" -n "$n" /bin/true
done
