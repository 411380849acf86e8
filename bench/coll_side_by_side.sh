#!/usr/bin/env bash
# Issue 51's side-by-side on one host in one command: every collective that moves large data, cohort
# (`cohort bench OP`) against Open MPI (`mpirun ... bench_mpi OP`, its vader/sm BTL on one host), in
# interleaved rounds (fresh processes each time, cohort then Open MPI for each case, so that the host's
# load hits both alike), every round printed with the load, then the goals checked on all rounds.
#
#   bench/coll_side_by_side.sh [build_dir] [out_file]
#     ROUNDS=3  SIZES="64M 256M"  N=2 (ranks)  OPS="allgather reduce_scatter alltoall gather scatter broadcast allreduce"
#     CACHE_REUSE=1: time on one reused buffer instead of --no-cache-reuse (the default here: buffer sets
#     over twice the L3, rotated per iteration, on both sides)
#     STAGED=1: also cohort with COHORT_SHM_SINGLE_COPY=0 (peer cohort-staged: the paths before single copy,
#     as on main before issue 51), in the same interleaved rounds
#     SHARED=1: also cohort with every buffer from allocate_shared (`--buffers shared`, peer cohort-shared:
#     the peers copy each other's buffers through their own mappings, no process_vm_readv; docs/algorithms-shm.md,
#     "From shared buffers"), in the same interleaved rounds; its goals are checked too
#     BASE=path/to/another/cohort: also that build (peer cohort-base, e.g. main's before a change), in the
#     same interleaved rounds, so that a change is measured against its base under the same load
#     MPI_BASE=<git revision>: also Open MPI with bench/peers/bench_mpi.c as of that revision (peer
#     mpi-base), in the same rounds (e.g. 04a3de8, before its rotated input sets were written: they read
#     the kernel's zero page there, docs/algorithms-shm.md, "The copy limit")
#   About 2 minutes per round at 2 ranks on an idle 2-core host, several times that under load.
#
# Method (bench/peers/README.md, "Method", same on both sides): fp32, sum, root 0; the size is the whole
# buffer of N blocks (allgather's output, alltoall's input, ...); 3 trials of >= 0.3 s after a warm-up;
# a trial's time per op is the slowest rank's; the median of the trials. busbw as nccl-tests: allreduce
# 2(N-1)/N x algbw, broadcast 1 x, the others (N-1)/N x.
# Goals (issue 51): per op and size, cohort's slowest round >= 1.5x Open MPI's fastest (busbw); in each
# round, allgather and reduce_scatter at 64 MiB take <= 0.6 of the time of cohort's allreduce of 64 MiB.
# Each cohort round also prints its link line: which copy path the large transfers took ("large
# transfers: single copy (process_vm_readv ...)" or "off (...)", docs/algorithms-shm.md, "Single copy").
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=$(realpath "${1:-build}")

ROUNDS=${ROUNDS:-3}
SIZES=${SIZES:-64M 256M}
N=${N:-2}
OPS=${OPS:-allgather reduce_scatter alltoall gather scatter broadcast allreduce}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# A copy, so that a rebuild while the rounds run does not mix two builds in one table.
cp "$BUILD/tools/cohort" "$TMP/cohort" || exit 1
COHORT=$TMP/cohort
if [[ -n ${BASE:-} ]]; then cp "$BASE" "$TMP/cohort-base" || exit 1; fi
[[ -n ${2:-} ]] && exec > >(tee -a "$2") 2>&1

cohort_flag=--no-cache-reuse
mpi_flag=no-cache-reuse
if [[ ${CACHE_REUSE:-0} == 1 ]]; then cohort_flag="" mpi_flag=""; fi
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo)
mpicc -O2 -o "$TMP/bench_mpi" bench/peers/bench_mpi.c -lm || exit 1
if [[ -n ${MPI_BASE:-} ]]; then
  git show "$MPI_BASE:bench/peers/bench_mpi.c" >"$TMP/bench_mpi_base.c" &&
    mpicc -O2 -o "$TMP/bench_mpi_base" "$TMP/bench_mpi_base.c" -lm || exit 1
fi

# shellcheck source=bench/rounds_loop.sh
source bench/rounds_loop.sh
bytes_of() { numfmt --from=iec "$1"; }

# One line per measurement: ROUND <round> <op> <bytes> <peer> <time us> <busbw GB/s>
cohort_case() {  # round op size [staged|base|shared]
  local out peer=cohort single=1 bin=$COHORT buffers=()  # none: the default (private), which older builds know
  [[ ${4:-} == staged ]] && { peer=cohort-staged; single=0; }
  [[ ${4:-} == shared ]] && { peer=cohort-shared; buffers=(--buffers shared); }
  [[ ${4:-} == base ]] && { peer=cohort-base; bin=$TMP/cohort-base; }
  # shellcheck disable=SC2086
  out=$(COHORT_SHM_SINGLE_COPY=$single "$bin" run -n "$N" --no-tag-output "$bin" bench "$2" -b "$3" -e "$3" --trials 3 --min-time 0.3 \
    "${buffers[@]}" $cohort_flag 2>&1)
  if [[ $peer == cohort && ($1 == 1 || $2 == allgather) ]]; then grep "^# link:" <<<"$out" | sed "s/^# link:/LINK round $1 $2:/"; fi
  # Which rank copied what on the single-copy path (cohort bench's last lines, one per rank).
  grep "^# copies, rank" <<<"$out" | sed "s/^# copies,/COPIES round $1 $2 $peer:/"
  awk -v r="$1" -v op="$2" -v p="$peer" '!/^#/ && NF >= 9 && $1 ~ /^[0-9]+$/ { print "ROUND", r, op, $1, p, $6, $8 }' <<<"$out"
  grep -q "^# Out of bounds" <<<"$out" || { echo "cohort bench $2 $3 failed:"; tail -5 <<<"$out"; }
}
mpi_case() {  # round op size [base]
  local peer=mpi bin=$TMP/bench_mpi
  [[ ${4:-} == base ]] && { peer=mpi-base; bin=$TMP/bench_mpi_base; }
  "${MPIRUN[@]}" -n "$N" "$bin" "$2" "$(bytes_of "$3")" 3 0.3 "" $mpi_flag 2>&1 | grep RESULT |
    sed -E 's/.*bytes=([0-9]+).*time_us_median=([0-9.]+).*busbw_GBps=([0-9.]+).*/\1 \2 \3/' |
    awk -v r="$1" -v op="$2" -v p="$peer" '{ print "ROUND", r, op, $1, p, $2, $3 }'
}

echo "# bench/coll_side_by_side.sh: $ROUNDS rounds, $N ranks, sizes $SIZES, ${cohort_flag:-one reused buffer}," \
  "$(date -u +%Y-%m-%dT%H:%MZ), git $(git rev-parse --short HEAD 2>/dev/null), load $(bench_load)," \
  "L3 $(lscpu | sed -n 's/^L3 cache: *//p'), $(nproc) CPUs"
one_round() {  # round: every case, each peer in turn
  local size op
  for size in $SIZES; do
    for op in $OPS; do
      cohort_case "$1" "$op" "$size"
      [[ ${STAGED:-0} == 1 ]] && cohort_case "$1" "$op" "$size" staged
      [[ ${SHARED:-0} == 1 ]] && cohort_case "$1" "$op" "$size" shared
      [[ -n ${BASE:-} ]] && cohort_case "$1" "$op" "$size" base
      mpi_case "$1" "$op" "$size"
      [[ -n ${MPI_BASE:-} ]] && mpi_case "$1" "$op" "$size" base
    done
  done
}
interleaved_rounds "$ROUNDS" one_round --start-lines | tee "$TMP/rounds"

python3 - "$TMP/rounds" <<'PY'
import sys
t, bw, order = {}, {}, []
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) != 7 or f[0] != "ROUND":
        continue
    _, r, op, size, peer, us, busbw = f
    key = (op, int(size))
    if key not in order:
        order.append(key)
    t.setdefault(key, {}).setdefault(peer, {})[int(r)] = float(us)
    bw.setdefault(key, {}).setdefault(peer, {})[int(r)] = float(busbw)
def mib(b):
    return f"{b / 2**20:g} MiB"
print("\n## Every round: time per op in ms (busbw GB/s); ratio = cohort busbw / Open MPI busbw, same round\n")
extra = [p for p in ("cohort-shared", "cohort-staged", "cohort-base", "mpi-base") if any(p in t[k] for k in order)]
judged = [p for p in ("cohort", "cohort-shared") if any(p in t[k] for k in order)]
print("| op | size | round | cohort | " + "".join(p.replace("-", " ") + " | " for p in extra) + "Open MPI | ratio |")
print("|---|---|---:|---:|" + "---:|" * len(extra) + "---:|---:|")
def cell(key, peer, r):
    return f"{t[key][peer][r] / 1e3:.2f} ({bw[key][peer][r]:.2f})" if r in t[key].get(peer, {}) else "-"
for key in order:
    c, m = t[key].get("cohort", {}), t[key].get("mpi", {})
    for r in sorted(set(c) | set(m)):
        ratio = f"{m[r] / c[r]:.2f}x" if r in c and r in m else "-"
        print(f"| {key[0]} | {mib(key[1])} | {r} | {cell(key, 'cohort', r)} | "
              + "".join(f"{cell(key, p, r)} | " for p in extra) + f"{cell(key, 'mpi', r)} | {ratio} |")
for peer in judged:
    print(f"\n## Goal: {peer}'s slowest round >= 1.5x Open MPI's fastest (busbw)\n")
    for key in order:
        c, m = bw[key].get(peer, {}), bw[key].get("mpi", {})
        if not c or not m:
            print(f"{key[0]} {mib(key[1])}: missing a side ({peer} {len(c)} rounds, Open MPI {len(m)})")
            continue
        v = min(c.values()) / max(m.values())
        print(f"{key[0]} {mib(key[1])}: {peer} slowest {min(c.values()):.2f} GB/s, Open MPI fastest "
              f"{max(m.values()):.2f} GB/s: {v:.2f}x ({'met' if v >= 1.5 else 'NOT met'})")
    print(f"\n## Goal: allgather and reduce_scatter <= 0.6 of {peer}'s allreduce time, same size, same round\n")
    for op in ("allgather", "reduce_scatter"):
        for (o, size) in order:
            if o != op or ("allreduce", size) not in t:
                continue
            a, ar = t[op, size].get(peer, {}), t["allreduce", size].get(peer, {})
            rounds = sorted(set(a) & set(ar))
            if not rounds:
                continue
            ratios = [a[r] / ar[r] for r in rounds]
            status = "met" if max(ratios) <= 0.6 else "NOT met"
            print(f"{op} {mib(size)} / allreduce {mib(size)}: "
                  + ", ".join(f"round {r} {x:.2f}" for r, x in zip(rounds, ratios)) + f" ({status} in every round)")
PY
