#!/usr/bin/env bash
# One run of every side-by-side comparison in docs/performance.md: cohort and the peers of
# bench/peers/ (Open MPI shared memory and TCP, torch.distributed gloo, torchrun, TCPStore,
# iperf3, memcpy), one after another on this machine, so each table compares like with like.
#
#   bench/side_by_side.sh [build_dir] [out_file]      (about 12 minutes on the 2-core VM)
#
# `cohort run` binds each of its 2 workers to a CPU (--bind-to auto, its default), as mpirun does by
# default for 2 ranks; torchrun (gloo) does not bind.
#
# Method as in bench/peers/README.md: 2 ranks, fp32 sum, in place, auto iteration count per trial,
# time = max over ranks, median of the trials; fewer trials than the peers' reference run (3 x 0.3 s)
# to keep the whole comparison short. Every line it prints starts with the section it belongs to.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=$(realpath "${1:-build}")
OUT=${2:-/dev/stdout}
PEERS=$(realpath bench/peers)
COHORT=$BUILD/tools/cohort
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
exec > >(tee -a "$OUT") 2>&1

MPIRUN="mpirun --allow-run-as-root --oversubscribe --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo"
MPI_TCP="--mca pml ob1 --mca btl tcp,self --mca btl_tcp_disable_family 6"
SIZES=8,1024,65536,1048576,16777216,67108864,268435456
export GLOO_SOCKET_IFNAME=lo
mpicc -O2 -o "$TMP/bench_mpi" "$PEERS/bench_mpi.c" -lm
mpicc -O2 -o "$TMP/mpi_trivial" "$PEERS/mpi_trivial.c"
cp "$PEERS/torchrun311.py" "$PEERS/bench_torch.py" "$PEERS/trivial_torch.py" "$TMP/"
# shellcheck source=bench/rounds_loop.sh
source bench/rounds_loop.sh

say() { echo "## $* (load: $(bench_load), $(date -u +%H:%M:%S) UTC)"; }
cohort_bench() {  # transport op [bench args...]
  local transport=$1 op=$2; shift 2
  COHORT_TRANSPORT=$transport "$COHORT" run -n 2 --no-tag-output "$COHORT" bench "$op" --trials 3 --min-time 0.3 "$@"
}
gloo_bench() {  # op sizes
  /usr/bin/python3 "$TMP/torchrun311.py" --nproc_per_node 2 --master_addr 127.0.0.1 --master_port $((29800 + RANDOM % 100)) \
    "$TMP/bench_torch.py" --op "$1" --sizes "$2" --trials 3 --min-time 0.3 2>&1 | grep RESULT
}

say "memory bandwidth"
"$COHORT" bench memcpy
say "iperf3 loopback, 1 stream, 5 s"
iperf3 -s -B 127.0.0.1 -p 5299 -1 >/dev/null 2>&1 & sleep 0.5
iperf3 -c 127.0.0.1 -p 5299 -t 5 -P 1 | grep -E "sender|receiver"

say "allreduce over TCP: cohort (COHORT_TRANSPORT=tcp)"
cohort_bench tcp allreduce -b 8 -e 8
cohort_bench tcp allreduce -b 1K -e 256M -f 4
say "allreduce over TCP: Open MPI btl tcp,self"
$MPIRUN $MPI_TCP -n 2 "$TMP/bench_mpi" allreduce $SIZES 3 0.3 -tcp | grep RESULT
say "allreduce: torch.distributed gloo"
gloo_bench allreduce $SIZES

say "allreduce on one host: cohort (default: shared memory)"
cohort_bench auto allreduce -b 8 -e 8
cohort_bench auto allreduce -b 1K -e 256M -f 4
say "allreduce on one host: Open MPI default (vader shared memory)"
$MPIRUN -n 2 "$TMP/bench_mpi" allreduce $SIZES 3 0.3 | grep RESULT
for op in allgather broadcast; do
  say "$op on one host: cohort"
  cohort_bench auto $op -b 8 -e 8
  cohort_bench auto $op -b 1K -e 256M -f 4
  say "$op on one host: Open MPI default (vader)"
  $MPIRUN -n 2 "$TMP/bench_mpi" $op $SIZES 3 0.3 | grep RESULT
  say "$op: torch.distributed gloo"
  gloo_bench $op $SIZES
done

say "start-up, 8 ranks: communicator + one barrier"
/usr/bin/python3 "$PEERS/launch_timing.py" -- "$COHORT" run -n 8 "$BUILD/examples/barrier/barrier"
/usr/bin/python3 "$PEERS/launch_timing.py" -- $MPIRUN -n 8 "$TMP/mpi_trivial"
/usr/bin/python3 "$PEERS/launch_timing.py" --runs 3 -- /usr/bin/python3 "$TMP/torchrun311.py" --nproc_per_node 8 \
  --master_addr 127.0.0.1 --master_port 29650 "$TMP/trivial_torch.py"
say "launcher alone, 8 workers of /bin/true"
/usr/bin/python3 "$PEERS/launch_timing.py" -- "$COHORT" run -n 8 /bin/true
/usr/bin/python3 "$PEERS/launch_timing.py" -- $MPIRUN -n 8 /bin/true

say "store join: cohort bench store"
"$COHORT" bench store --clients 1024,4096,16384 --reps 3
say "store join: torch TCPStore (store_bench.py K 4 3)"
(ulimit -n 20000; for n in 1024 4096; do /usr/bin/python3 "$PEERS/store_bench.py" $n 4 3 | tail -n 2; done)
say "done"
