#!/bin/bash
# Launch latency, side by side in one run: whole-process wall time of `cohort run` against torchrun and
# mpirun, N workers of a trivial program each (5 counted runs after 1 warm-up, min/median/max, with
# the peers' own timing script bench/peers/launch_timing.py).
#   torchrun: torchrun311.py (python3 -m torch.distributed.run + the Python 3.11 fix) running
#             trivial_torch.py (init_process_group gloo, one barrier, destroy); default and 0.1 s monitor
#   mpirun:   mpi_trivial (MPI_Init, MPI_Barrier, MPI_Finalize), and /bin/true
#   cohort:   examples/hello --store (connect to the job's store, one barrier), and /bin/true
# Usage: bench/launch/compare_launch.sh [BUILD_DIR] [N]
set -euo pipefail
BUILD=$(realpath "${1:-build}")
N=${2:-8}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PEERS=${PEERS:-$ROOT/bench/peers}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mpicc -O2 -o "$WORK/mpi_trivial" "$PEERS/mpi_trivial.c"
export GLOO_SOCKET_IFNAME=lo
MPIRUN="mpirun --allow-run-as-root --oversubscribe --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo"
T="/usr/bin/python3 $PEERS/launch_timing.py --runs 5 --warmup 1 --"
PORT=$((29650 + RANDOM % 1000))
echo "# $(date -u +%FT%TZ) N=$N build=$BUILD"
$T "$BUILD/tools/cohort" run -n "$N" "$BUILD/examples/hello/hello" --store
$T "$BUILD/tools/cohort" run -n "$N" /bin/true
$T $MPIRUN -n "$N" "$WORK/mpi_trivial"
$T $MPIRUN -n "$N" /bin/true
(cd "$PEERS" && $T /usr/bin/python3 torchrun311.py --nproc_per_node "$N" --master_addr 127.0.0.1 \
    --master_port $PORT trivial_torch.py)
(cd "$PEERS" && $T /usr/bin/python3 torchrun311.py --monitor_interval 0.1 --nproc_per_node "$N" \
    --master_addr 127.0.0.1 --master_port $PORT trivial_torch.py)
