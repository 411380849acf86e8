#!/usr/bin/env bash
# Issue 51's small messages at the shm group's level, for a loaded host: the minimum of many short trials
# (bench/shm_collectives, no communicator layer: bench/comm_call_ab.sh measures that) with a broadcast's
# root returning early (COHORT_SHM_EARLY_ROOT=1, the default) and waiting for its receivers (=0), and Open
# MPI (bench/peers/bench_mpi.c, vader/sm), interleaved in rounds; every round printed with the load.
# The minimum is what a round can show when the scheduler leaves the two ranks alone for one trial.
#
#   bench/coll_small_min.sh [build_dir] [out_file]
#     ROUNDS=5  SIZES=8,64,512  OPS="allreduce broadcast allgather"  TRIALS=21  MIN_TIME=0.01
#     COMM=1: cohort's calls go through a Communicator (bench/shm_collectives COHORT_BENCH_COMM=1: the
#     layer a program calls, over the same group), so the figures compare with `cohort bench`'s
#     CLAIM=1: also cohort with COHORT_SHM_CLAIM_LINES=0 ("no-claim": a rank takes its next round's lines
#     for writing when it writes them, not while it waits; docs/algorithms-shm.md, "Small messages")
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=$(realpath "${1:-build}")
ROUNDS=${ROUNDS:-5}
SIZES=${SIZES:-8,64,512}
OPS=${OPS:-allreduce broadcast allgather}
TRIALS=${TRIALS:-21}
MIN_TIME=${MIN_TIME:-0.01}
COMM=${COMM:-0}
CLAIM=${CLAIM:-0}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cp "$BUILD/bench/shm_collectives" "$TMP/shm_collectives" || exit 1
[[ -n ${2:-} ]] && exec > >(tee -a "$2") 2>&1
mpicc -O2 -o "$TMP/bench_mpi" bench/peers/bench_mpi.c -lm || exit 1
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo)
# shellcheck source=bench/rounds_loop.sh
source bench/rounds_loop.sh
# ROUND <round> <op> <bytes> <peer> <min us>
results() {  # round peer
  grep RESULT | sed -E 's/.* op=([a-z]+) .*bytes=([0-9]+).*time_us_min=([0-9.]+).*/\1 \2 \3/' |
    awk -v r="$1" -v p="$2" '{ print "ROUND", r, $1, $2, p, $3 }'
}
echo "# bench/coll_small_min.sh: $ROUNDS rounds, 2 ranks bound to cores 0 and 1, sizes $SIZES, min of $TRIALS" \
  "trials of >= $MIN_TIME s, $([[ $COMM == 1 ]] && echo "through the communicator" || echo "group level"), $(date -u +%Y-%m-%dT%H:%MZ), git $(git rev-parse --short HEAD 2>/dev/null)," \
  "load $(bench_load), $(getconf _NPROCESSORS_ONLN) CPUs"
one_round() {  # r: every op, cohort (root returning early, and waiting) then Open MPI
  local op r=$1
  for op in $OPS; do
    COHORT_BENCH_COMM=$COMM COHORT_BENCH_BIND=1 COHORT_SHM_EARLY_ROOT=1 "$TMP/shm_collectives" "$op" "$SIZES" \
      "$TRIALS" "$MIN_TIME" 2>&1 | results "$r" cohort
    if [[ $CLAIM == 1 ]]; then
      COHORT_BENCH_COMM=$COMM COHORT_BENCH_BIND=1 COHORT_SHM_CLAIM_LINES=0 "$TMP/shm_collectives" "$op" "$SIZES" \
        "$TRIALS" "$MIN_TIME" 2>&1 | results "$r" no-claim
    fi
    if [[ $op == broadcast ]]; then
      COHORT_BENCH_COMM=$COMM COHORT_BENCH_BIND=1 COHORT_SHM_EARLY_ROOT=0 "$TMP/shm_collectives" "$op" "$SIZES" "$TRIALS" "$MIN_TIME" 2>&1 |
        results "$r" cohort-root-waits
    fi
    "${MPIRUN[@]}" -n 2 "$TMP/bench_mpi" "$op" "$SIZES" "$TRIALS" "$MIN_TIME" "" 2>&1 | results "$r" mpi
  done
}
interleaved_rounds "$ROUNDS" one_round --start-lines | tee "$TMP/rounds"
python3 - "$TMP/rounds" <<'PY'
import sys
t, order = {}, []
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) != 6 or f[0] != "ROUND":
        continue
    key = (f[2], int(f[3]))
    if key not in order:
        order.append(key)
    t.setdefault(key, {}).setdefault(f[4], {})[int(f[1])] = float(f[5])
print("\n## Minimum of the trials per round (us); per-round ratios\n")
for key in order:
    c, m, w, n = (t[key].get(p, {}) for p in ("cohort", "mpi", "cohort-root-waits", "no-claim"))
    line = f"{key[0]} {key[1]} B: cohort {' '.join(f'{c[r]:.2f}' for r in sorted(c))}"
    if n:
        line += f" | no-claim {' '.join(f'{n[r]:.2f}' for r in sorted(n))}"
        line += f" | cohort/no-claim {' '.join(f'{c[r] / n[r]:.2f}' for r in sorted(c) if n.get(r))}"
    if w:
        line += f" | root waits {' '.join(f'{w[r]:.2f}' for r in sorted(w))}"
    line += f" | Open MPI {' '.join(f'{m[r]:.2f}' for r in sorted(m))}"
    line += f" | cohort/Open MPI {' '.join(f'{c[r] / m[r]:.2f}' for r in sorted(c) if m.get(r))}"
    if w:
        line += f" | early/waits {' '.join(f'{c[r] / w[r]:.2f}' for r in sorted(c) if w.get(r))}"
    if c and m:
        line += f" | cohort slowest round {max(c.values()):.2f} vs Open MPI fastest {min(m.values()):.2f}: " \
                f"{'met' if max(c.values()) <= min(m.values()) else 'NOT met'}"
    print(line)
PY
