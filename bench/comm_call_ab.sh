#!/usr/bin/env bash
# The communicator layer's cost per small call (bench/comm_call_bench.cc), this build against another,
# interleaved round by round so that the host's load hits both alike; every round printed with the load,
# then the per-round ratios (this / base) of each benchmark's CPU time.
#
#   bench/comm_call_ab.sh build base_build [out_file]
#     ROUNDS=5  FILTER=OneRank (a --benchmark_filter regex)  MIN_TIME=0.3 (seconds per benchmark)
# base_build: a build of the commit to compare with, with bench/comm_call_bench.cc copied into its bench/
# if it predates the file (e.g. git worktree add --detach ../base <commit>; cp bench/comm_call_bench.cc
# ../base/bench/; configure and build as docs/testing.md says; ninja -C ../base/build bench/comm_call_bench).
set -uo pipefail
cd "$(dirname "$0")/.."
NEW=$(realpath "${1:-build}")/bench/comm_call_bench
BASE=$(realpath "$2")/bench/comm_call_bench
ROUNDS=${ROUNDS:-5}
FILTER=${FILTER:-OneRank}
MIN_TIME=${MIN_TIME:-0.3}
[[ -x $NEW && -x $BASE ]] || { echo "need $NEW and $BASE"; exit 1; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
[[ -n ${3:-} ]] && exec > >(tee -a "$3") 2>&1
# shellcheck source=bench/rounds_loop.sh
source bench/rounds_loop.sh
echo "# bench/comm_call_ab.sh: $ROUNDS rounds, filter $FILTER, $(date -u +%Y-%m-%dT%H:%MZ)," \
  "git $(git rev-parse --short HEAD 2>/dev/null), load $(bench_load), $(getconf _NPROCESSORS_ONLN) CPUs"
run() {  # label binary round
  "$2" --benchmark_filter="$FILTER" --benchmark_min_time="$MIN_TIME" --benchmark_format=csv 2>/dev/null |
    awk -F, -v l="$1" -v r="$3" '$1 ~ /^"BM_/ { gsub(/"/, "", $1); printf "ROUND %s %s %s %.1f\n", r, $1, l, $4 }'
}
one_round() {  # r: this build, then the base
  run new "$NEW" "$1"
  run base "$BASE" "$1"
}
interleaved_rounds "$ROUNDS" one_round --start-lines | tee "$TMP/rounds"
python3 - "$TMP/rounds" <<'PY'
import sys
t = {}
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) == 5 and f[0] == "ROUND":
        t.setdefault(f[2], {}).setdefault(f[3], {})[int(f[1])] = float(f[4])
print("\n## CPU ns per call, every round; this build / base per round\n")
for name, v in t.items():
    n, b = v.get("new", {}), v.get("base", {})
    ratios = " ".join(f"{n[r] / b[r]:.2f}" for r in sorted(n) if r in b and b[r] > 0)
    print(f"{name}: this {' '.join(f'{n[r]:.1f}' for r in sorted(n))} | base {' '.join(f'{b[r]:.1f}' for r in sorted(b))} | ratio {ratios}")
PY
