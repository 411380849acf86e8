#!/usr/bin/env bash
# Issue 51's small messages side by side on one host: allreduce, broadcast and allgather at 8 B, 64 B and
# 512 B, cohort (`cohort bench OP`) against Open MPI (`mpirun ... bench_mpi OP`, its vader/sm BTL), in
# interleaved rounds (fresh processes each time, cohort then cohort through the slots then Open MPI for
# each case, so that the host's load hits all alike), every round printed with the load, then the goal
# checked on all rounds.
#
#   bench/coll_small_side_by_side.sh [build_dir] [out_file]
#     ROUNDS=5  SIZES="8 64 512"  N=2 (ranks)  OPS="allreduce broadcast allgather"
#     TRIALS=3 MIN_TIME=0.3: per case, as bench/coll_side_by_side.sh (median of the trials)
#     SLOTS=0: leave out cohort with COHORT_SHM_INLINE=0 (the small calls staged through the slots, as on
#     main before the inline path: docs/algorithms-shm.md, "Small messages")
#     BASE=other_build_dir: also that build's cohort ("cohort-base"), in the same rounds: a change measured
#     against the commit before it, both beside Open MPI under the same load
#   About 40 s per round on an idle host.
#
# Method (bench/peers/README.md, "Method", same on both sides): fp32, sum, root 0; the size is the whole
# buffer (allgather's output of N blocks); TRIALS trials of >= MIN_TIME s after a warm-up; a trial's time
# per op is the slowest rank's; the median of the trials; the same buffer every iteration.
# Goal (issue 51): per op and size, cohort's slowest round takes no longer than Open MPI's fastest.
# Small-message latency is the host's scheduling as much as the link's: on a loaded host (see the load on
# every round line) both sides swing by 10-100x between rounds; compare rounds, and rerun on a quiet host.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=$(realpath "${1:-build}")

ROUNDS=${ROUNDS:-5}
SIZES=${SIZES:-8 64 512}
N=${N:-2}
OPS=${OPS:-allreduce broadcast allgather}
TRIALS=${TRIALS:-3}
MIN_TIME=${MIN_TIME:-0.3}
SLOTS=${SLOTS:-1}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# A copy, so that a rebuild while the rounds run does not mix two builds in one table.
cp "$BUILD/tools/cohort" "$TMP/cohort" || exit 1
COHORT=$TMP/cohort
BASE=${BASE:-}
if [[ -n $BASE ]]; then
  cp "$(realpath "$BASE")/tools/cohort" "$TMP/cohort-base" || exit 1
fi
[[ -n ${2:-} ]] && exec > >(tee -a "$2") 2>&1

MPIRUN=(mpirun --allow-run-as-root --oversubscribe --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo)
mpicc -O2 -o "$TMP/bench_mpi" bench/peers/bench_mpi.c -lm || exit 1
# shellcheck source=bench/rounds_loop.sh
source bench/rounds_loop.sh

# One line per measurement: ROUND <round> <op> <bytes> <peer> <time us>
cohort_case() {  # round op size inline(1/0) [binary label]
  local out peer=cohort bin=${5:-$COHORT}
  [[ $4 == 0 ]] && peer=cohort-slots
  [[ -n ${6:-} ]] && peer=$6
  out=$(COHORT_SHM_INLINE=$4 "$bin" run -n "$N" --no-tag-output "$bin" bench "$2" -b "$3" -e "$3" \
    --trials "$TRIALS" --min-time "$MIN_TIME" 2>&1)
  awk -v r="$1" -v op="$2" -v p="$peer" '!/^#/ && NF >= 9 && $1 ~ /^[0-9]+$/ { print "ROUND", r, op, $1, p, $6 }' <<<"$out"
  grep -q "^# Out of bounds values : 0 OK" <<<"$out" || { echo "cohort bench $2 $3 failed:"; tail -5 <<<"$out"; }
}
mpi_case() {  # round op size
  "${MPIRUN[@]}" -n "$N" "$TMP/bench_mpi" "$2" "$3" "$TRIALS" "$MIN_TIME" "" 2>&1 | grep RESULT |
    sed -E 's/.*bytes=([0-9]+).*time_us_median=([0-9.]+).*/\1 \2/' |
    awk -v r="$1" -v op="$2" '{ print "ROUND", r, op, $1, "mpi", $2 }'
}

echo "# bench/coll_small_side_by_side.sh: $ROUNDS rounds, $N ranks, sizes $SIZES, $TRIALS trials of >= $MIN_TIME s," \
  "$(date -u +%Y-%m-%dT%H:%MZ), git $(git rev-parse --short HEAD 2>/dev/null), load $(bench_load), $(getconf _NPROCESSORS_ONLN) CPUs"
[[ -n $BASE ]] && echo "# cohort-base: $("$TMP/cohort-base" --version 2>&1 | head -1) from $BASE"
one_round() {  # round: every case, each peer in turn
  local size op
  for size in $SIZES; do
    for op in $OPS; do
      cohort_case "$1" "$op" "$size" 1
      [[ -n $BASE ]] && cohort_case "$1" "$op" "$size" 1 "$TMP/cohort-base" cohort-base
      [[ $SLOTS == 1 ]] && cohort_case "$1" "$op" "$size" 0
      mpi_case "$1" "$op" "$size"
    done
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
    _, r, op, size, peer, us = f
    key = (op, int(size))
    if key not in order:
        order.append(key)
    t.setdefault(key, {}).setdefault(peer, {})[int(r)] = float(us)
peers = [p for p in ("cohort", "cohort-base", "cohort-slots", "mpi") if any(p in t[k] for k in order)]
names = {"cohort": "cohort", "cohort-base": "cohort-base", "cohort-slots": "cohort via slots", "mpi": "Open MPI"}
print("\n## Every round: time per op in us (median of the trials; the slowest rank's)\n")
print("| op | size | " + " | ".join(names[p] + " rounds" for p in peers) + " |")
print("|---|---:|" + "---|" * len(peers))
for key in order:
    cells = []
    for p in peers:
        v = t[key].get(p, {})
        cells.append(" ".join(f"{v[r]:.2f}" for r in sorted(v)) or "-")
    print(f"| {key[0]} | {key[1]} B | " + " | ".join(cells) + " |")
print("\n## Goal: cohort's slowest round <= Open MPI's fastest\n")
for key in order:
    c, m = t[key].get("cohort", {}), t[key].get("mpi", {})
    if not c or not m:
        print(f"{key[0]} {key[1]} B: missing a side (cohort {len(c)} rounds, Open MPI {len(m)})")
        continue
    s = t[key].get("cohort-slots", {})
    extra = f"; cohort via slots fastest {min(s.values()):.2f} us, slowest {max(s.values()):.2f} us" if s else ""
    extra += f"; cohort/Open MPI per round {' '.join(f'{c[r] / m[r]:.2f}' for r in sorted(c) if r in m and m[r] > 0)}"
    b = t[key].get("cohort-base", {})
    if b:
        # Per round, cohort / cohort-base: the change under the same load (both beside Open MPI).
        ratios = [c[r] / b[r] for r in sorted(c) if r in b and b[r] > 0]
        extra += (f"; cohort-base fastest {min(b.values()):.2f} us, slowest {max(b.values()):.2f} us, "
                  f"cohort/base per round {' '.join(f'{x:.2f}' for x in ratios)}")
    print(f"{key[0]} {key[1]} B: cohort slowest {max(c.values()):.2f} us (fastest {min(c.values()):.2f}), "
          f"Open MPI fastest {min(m.values()):.2f} us (slowest {max(m.values()):.2f}){extra}: "
          f"{'met' if max(c.values()) <= min(m.values()) else 'NOT met'}")
PY
