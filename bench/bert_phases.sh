#!/usr/bin/env bash
# Issue 51's swing, phase by phase: BERT-mini's 2-rank job and the 2-process ceiling in interleaved
# rounds, every process run with `bert --trace-phases 10` (examples/common/phase_times.h), so that a
# slow run says in which phase its CPU went (forward, backward and its gradient waits, the optimizer's
# step) and whether the core was slower at that moment (the fixed probes after each step).
#
#   bench/bert_phases.sh BUILD [out_file]      ROUNDS=6 STEPS=40 ZERO=0
#
# Per round, fresh processes each:
#   job       BUILD/tools/cohort run -n 2 BUILD/examples/bert/bert --zero $ZERO
#   ceiling   two one-process runs at once, one per CPU (taskset), each in a session of its own
#             (setsid), as bench/bert_swing.sh runs them
# Every process prints one summary line (phases over the steps after the first 10, ms per step: wall /
# thread CPU / process CPU, the waits, faults, switches, the probes); the round's line gives samples/s
# and, per process, the step's thread CPU and the probes side by side.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
# shellcheck source=bench/rounds_loop.sh
source bench/rounds_loop.sh  # bench_load, interleaved_rounds
[[ $# -ge 1 ]] || { echo "usage: $0 BUILD [out_file]" >&2; exit 2; }
BUILD=$(realpath "$1") || exit 2
ROUNDS=${ROUNDS:-6}
STEPS=${STEPS:-40}
ZERO=${ZERO:-0}
((STEPS > 20)) || { echo "STEPS must be above 20 (the first 10 are warm-up)" >&2; exit 2; }
[[ -x $BUILD/tools/cohort && -x $BUILD/examples/bert/bert ]] || { echo "$BUILD: no tools/cohort or examples/bert/bert" >&2; exit 2; }
[[ -n ${2:-} ]] && exec > >(tee -a "$2") 2>&1
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
args=(--max-steps "$STEPS" --test-samples 64 --trace-phases 10)

# "label: sps S | rank R step CPU C ms, fma F ms, read M ms | ..." from a run's output.
digest() {  # label file
  awk -v label="$1" '/^samples\/s:/ {sps = $2}
    / phases, ms per step/ {
      cpu = $0; sub(/.* step [0-9.]+ \/ /, "", cpu); sub(/ .*/, "", cpu)
      fma = $0; sub(/.*probes fma /, "", fma); sub(/ ms.*/, "", fma)
      rd = $0; sub(/.*16 MiB read /, "", rd); sub(/ ms.*/, "", rd)
      ranks = ranks sprintf(" | rank %s step cpu %s ms, fma %s ms, read %s ms", $2, cpu, fma, rd) }
    END { printf "%s: sps %s%s\n", label, sps == "" ? "failed" : sps, ranks }' "$2"
}
one_round() {
  local r=$1 c pids=()
  "$BUILD/tools/cohort" run -n 2 --no-tag-output "$BUILD/examples/bert/bert" "${args[@]}" --zero "$ZERO" >"$TMP/job" 2>&1
  grep " phases, ms per step" "$TMP/job" | sed "s/^/ROUND $r job /"
  for c in 0 1; do
    OMP_NUM_THREADS=1 setsid -w taskset -c "$c" "$BUILD/examples/bert/bert" "${args[@]}" --threads 1 \
      >"$TMP/ceiling$c" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"  # these two only: a bare wait would also wait for the tee of the out_file
  for c in 0 1; do grep " phases, ms per step" "$TMP/ceiling$c" | sed "s/^/ROUND $r ceiling$c /"; done
  echo "ROUND $r summary $(digest job "$TMP/job") || $(digest ceiling0 "$TMP/ceiling0") || $(digest ceiling1 "$TMP/ceiling1")"
}
echo "# bench/bert_phases.sh: BERT-mini, 2 ranks, --zero $ZERO, $STEPS steps, $ROUNDS rounds, $(date -u +%FT%TZ)" \
  "$(uname -n), $(getconf _NPROCESSORS_ONLN) CPUs, build $(git -C "$BUILD/.." rev-parse --short HEAD 2>/dev/null || echo '?')," \
  "autogroups $(cat /proc/sys/kernel/sched_autogroup_enabled 2>/dev/null || echo '?')"
interleaved_rounds "$ROUNDS" one_round --start-lines
