#!/usr/bin/env bash
# What one large collective call costs each rank on one host, cohort (`cohort bench OP`) against Open MPI
# (bench/peers/bench_mpi.c), in CPU time, page faults and process_vm_readv calls per call, from
# `perf stat` on every rank: where a loaded host stretches the wall time, the CPU time per call still
# says whether one side does more work (docs/algorithms-shm.md, "The copy limit").
#
#   bench/coll_cpu_per_call.sh [build_dir] [out_file]
#     ROUNDS=2  SIZE=64M  N=2 (ranks)  OPS="allgather alltoall"
#     MPI_BASE=<git revision>: also bench_mpi.c as of that revision (peer mpi-base), e.g. 04a3de8
#
# Each peer runs twice in a round, short and long (fresh processes); per rank, every figure per call =
# (long - short) / (calls long - calls short), so that the setup (MPI_Init, the group's creation,
# touching the rotated sets) cancels out. The calls are counted by the kernel: one process_vm_readv
# per call and rank on both sides at this size (2 ranks; the tracepoint
# syscalls:sys_enter_process_vm_readv); with N > 2 each call makes N-1, and the line says so. Also the
# wall time per call the bench itself reports (median of its trials, slowest rank). Rotated buffers
# (--no-cache-reuse / no-cache-reuse) on both sides. CPU time includes the waits' spinning: both sides
# poll while the other rank copies.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=$(realpath "${1:-build}")
ROUNDS=${ROUNDS:-2}
SIZE=${SIZE:-64M}
N=${N:-2}
OPS=${OPS:-allgather alltoall}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cp "$BUILD/tools/cohort" "$TMP/cohort" || exit 1
COHORT=$TMP/cohort
[[ -n ${2:-} ]] && exec > >(tee -a "$2") 2>&1
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo)
mpicc -O2 -o "$TMP/bench_mpi" bench/peers/bench_mpi.c -lm || exit 1
if [[ -n ${MPI_BASE:-} ]]; then
  git show "$MPI_BASE:bench/peers/bench_mpi.c" >"$TMP/bench_mpi_base.c" &&
    mpicc -O2 -o "$TMP/bench_mpi_base" "$TMP/bench_mpi_base.c" -lm || exit 1
fi
EVENTS=task-clock,page-faults,syscalls:sys_enter_process_vm_readv
perf stat -x, -e "$EVENTS" true 2>/dev/null || { echo "perf stat cannot count $EVENTS here"; exit 1; }

# shellcheck source=bench/rounds_loop.sh
source bench/rounds_loop.sh

# One run: prints "RUN <wall us per call>" and one "RANK <cpu ms> <faults> <readv calls>" per rank.
run_peer() {  # peer op length(short|long) dir
  local peer=$1 op=$2 len=$3 dir=$4 wall
  mkdir -p "$dir"
  if [[ $peer == cohort ]]; then
    local iters=4
    [[ $len == long ]] && iters=34
    wall=$("$COHORT" run -n "$N" --no-tag-output sh -c "exec perf stat -x, -e $EVENTS -o $dir/rank.\$COHORT_RANK \
      $COHORT bench $op -b $SIZE -e $SIZE -n $iters -w 1 --trials 1 --no-cache-reuse" 2>&1 |
      awk '!/^#/ && NF >= 9 && $1 ~ /^[0-9]+$/ { print $6 }')
  else
    local bin=$TMP/bench_mpi min_time=0.05
    [[ $peer == mpi-base ]] && bin=$TMP/bench_mpi_base
    # Its iterations follow the time: long enough for about as many calls as cohort's on an idle pair.
    [[ $len == long ]] && min_time=2.5
    wall=$("${MPIRUN[@]}" -n "$N" sh -c "exec perf stat -x, -e $EVENTS -o $dir/rank.\$OMPI_COMM_WORLD_RANK \
      $bin $op $(numfmt --from=iec "$SIZE") 1 $min_time '' no-cache-reuse" 2>&1 |
      sed -nE 's/.*time_us_median=([0-9.]+).*/\1/p')
  fi
  echo "RUN ${wall:-failed}"
  local f
  for f in "$dir"/rank.*; do
    awk -F, '$3 == "task-clock" { c = $1 } $3 == "page-faults" { p = $1 }
             $3 ~ /process_vm_readv/ { v = $1 } END { print "RANK", c, p, v }' "$f"
  done
}

one_round() {  # round
  local op peer peers=(cohort mpi)
  [[ -n ${MPI_BASE:-} ]] && peers+=(mpi-base)
  for op in $OPS; do
    for peer in "${peers[@]}"; do
      run_peer "$peer" "$op" short "$TMP/$1/$op/$peer/short" >"$TMP/short.txt"
      run_peer "$peer" "$op" long "$TMP/$1/$op/$peer/long" >"$TMP/long.txt"
      python3 - "$1" "$op" "$peer" "$N" "$TMP/short.txt" "$TMP/long.txt" <<'PY'
import sys
r, op, peer, n = sys.argv[1:5]
def read(path):
    wall, ranks = None, []
    for line in open(path):
        f = line.split()
        if f[0] == "RUN":
            wall = f[1]
        elif f[0] == "RANK" and len(f) == 4:
            ranks.append([float(x) for x in f[1:]])
    return wall, ranks
ws, short = read(sys.argv[5])
wl, long_ = read(sys.argv[6])
if not short or len(short) != len(long_):
    print(f"PERCALL round {r} {op} {peer}: a run failed (short {ws}, long {wl})")
    sys.exit()
readvs_per_call = int(n) - 1
cells = []
for s, l in zip(short, long_):
    calls = (l[2] - s[2]) / readvs_per_call
    if calls < 10:  # Open MPI's runs last a time, not a count: on a loaded host they can end close
        cells.append(f"only {calls:g} calls between the short and the long run")
        continue
    cells.append(f"CPU {(l[0] - s[0]) / calls:.2f} ms, faults {(l[1] - s[1]) / calls:.1f}")
print(f"PERCALL round {r} {op} {peer}: wall {float(wl) / 1e3:.2f} ms per call (long run); per rank: "
      + "; ".join(cells) + f" ({readvs_per_call} process_vm_readv per call and rank)")
PY
    done
  done
}

echo "# bench/coll_cpu_per_call.sh: $ROUNDS rounds, $N ranks, $SIZE, rotated buffers, $(date -u +%Y-%m-%dT%H:%MZ)," \
  "git $(git rev-parse --short HEAD 2>/dev/null), load $(bench_load), $(getconf _NPROCESSORS_ONLN) CPUs"
interleaved_rounds "$ROUNDS" one_round --start-lines
