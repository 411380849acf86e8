#!/usr/bin/env bash
# Parameter-server side-by-side (issue 18): cohort's PS (`cohort run --ps N`, bench/ps_bench.cc) against
# the torch.distributed.rpc parameter-server pattern (bench/ps_torch_rpc.py), same work: 2 workers, each
# step pulls IDS random ids x DIM float32 from a sparse table of 2^20 ids and pushes a gradient for them
# (SGD on the server).
#
#   ROUNDS=5 bench/ps_side_by_side.sh [build_dir]        (about 40 s per round on the 2-core VM)
#
# Interleaved rounds, fresh processes every run: for each round, for servers in 1 2: cohort, then torch.
# Every run's RESULT line is printed as it comes, then a table of cohort rows/s / torch rows/s per round
# and the p99 step latency of each. Settings (environment): ROUNDS (5), STEPS (500), WARMUP (50),
# IDS (4096), DIM (64), MODE (pullpush; or pushpull: cohort's push_pull, one round trip per step),
# PREFILL (0; 1: cohort's workers pull every id once before the warm-up, so no timed step creates rows,
# as the torch peer's table is preallocated), RUN_TIMEOUT (seconds per run, 150), SERVERS ("1 2").
# QUIET (1): before each run, wait (up to 10 min) while a compiler, linker, ninja or ctest runs on this
# machine; a run during which one was seen is marked '*' in the table (its figures are suspect).
# A run that fails or times out is reported with its output's tail and counted; the exit status is 1
# if any did.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
ROUNDS=${ROUNDS:-5}
STEPS=${STEPS:-500}
WARMUP=${WARMUP:-50}
IDS=${IDS:-4096}
DIM=${DIM:-64}
MODE=${MODE:-pullpush}
PREFILL=${PREFILL:-0}
RUN_TIMEOUT=${RUN_TIMEOUT:-150}
QUIET=${QUIET:-1}
SERVERS=${SERVERS:-1 2}
COHORT=$BUILD/tools/cohort
PS_BENCH=$BUILD/bench/ps_bench
PYTHON=/usr/bin/python3
for f in "$COHORT" "$PS_BENCH"; do
  [[ -x $f ]] || { echo "ps_side_by_side: $f is missing (build it: ninja -C $BUILD cohort ps_bench)" >&2; exit 2; }
done
TMP=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$TMP"' EXIT

binaries() { stat -c '%n %Y' "$COHORT" "$PS_BENCH" | md5sum | cut -c1-8; }
BIN_AT_START=$(binaries)
extra=()
[[ $PREFILL == 1 ]] && extra+=(--prefill)
failures=0
declare -A cohort_rate torch_rate cohort_p99 torch_p99

busy() { ps -eo comm= | grep -qE '^(cc1plus|cc1|ld|ld.gold|ld.lld|ninja|make|ctest)$'; }
wait_quiet() {
  [[ $QUIET == 1 ]] || return 0
  local waited=0
  while busy && ((waited < 600)); do sleep 5; waited=$((waited + 5)); done
  ((waited == 0)) || echo "## waited ${waited}s for other builds/tests to finish"
}
watch_busy() {  # in the background during a run: writes the flag file when a build runs meanwhile
  while true; do busy && { touch "$1"; return; }; sleep 1; done
}

field() {  # name line -> value of name=value in line ("" when absent)
  sed -n "s/.*[[:space:]]$1=\([^[:space:]]*\).*/\1/p" <<<"$2" | head -n1
}

run_one() {  # label logfile cmd... : runs with a timeout; prints and returns the RESULT line
  local label=$1 log=$2; shift 2
  local rc=0
  wait_quiet
  rm -f "$TMP/busy"
  watch_busy "$TMP/busy" & local watcher=$!
  echo "## $label (load $(cut -d' ' -f1 /proc/loadavg), $(date -u +%H:%M:%S) UTC)"
  timeout -k 10 "$RUN_TIMEOUT" "$@" >"$log" 2>&1 || rc=$?
  kill "$watcher" 2>/dev/null || true
  wait "$watcher" 2>/dev/null || true
  RUN_MARK=
  [[ -e $TMP/busy ]] && { RUN_MARK='*'; echo "## note: a build or test ran on this machine during this run"; }
  local line
  line=$(grep -m1 '^.*RESULT impl=' "$log" | sed 's/^.*RESULT impl=/RESULT impl=/' || true)
  if [[ $rc -ne 0 || -z $line ]]; then
    echo "## $label FAILED (exit $rc$([[ $rc == 124 ]] && echo ", timed out after ${RUN_TIMEOUT}s")); last lines:" >&2
    tail -n 15 "$log" | sed 's/^/##   /' >&2
    failures=$((failures + 1))
    return 1
  fi
  echo "$line"
  RUN_LINE=$line
}

echo "## ps side-by-side: rounds=$ROUNDS steps=$STEPS warmup=$WARMUP ids=$IDS dim=$DIM mode=$MODE prefill=$PREFILL" \
  "($(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%Y-%m-%dT%H:%M:%SZ), git $(git rev-parse --short HEAD 2>/dev/null || echo ?)$(git diff --quiet HEAD -- src include tools 2>/dev/null || echo +changes)," \
  "binaries built $(date -u -r "$PS_BENCH" +%H:%M:%S) / $(date -u -r "$COHORT" +%H:%M:%S) UTC)"
for ((r = 1; r <= ROUNDS; r++)); do
  for s in $SERVERS; do
    RUN_LINE=
    if run_one "round $r cohort servers=$s" "$TMP/cohort.$r.$s.log" \
      "$COHORT" run --ps "$s" --nproc-per-node 2 --no-tag-output "$PS_BENCH" \
      --steps "$STEPS" --warmup "$WARMUP" --ids "$IDS" --dim "$DIM" --mode "$MODE" "${extra[@]}"; then
      cohort_rate[$r,$s]=$(field rows_per_s "$RUN_LINE")$RUN_MARK
      cohort_p99[$r,$s]=$(field p99_ms "$RUN_LINE")
    fi
    RUN_LINE=
    if run_one "round $r torch_rpc servers=$s" "$TMP/torch.$r.$s.log" \
      "$PYTHON" bench/ps_torch_rpc.py --servers "$s" --workers 2 --steps "$STEPS" --warmup "$WARMUP" \
      --ids "$IDS" --dim "$DIM" --timeout "$RUN_TIMEOUT"; then
      torch_rate[$r,$s]=$(field rows_per_s "$RUN_LINE")$RUN_MARK
      torch_p99[$r,$s]=$(field p99_ms "$RUN_LINE")
    fi
  done
done

echo
echo "## rows/s ratio cohort / torch_rpc per round (p99 step latency in ms); mode=$MODE prefill=$PREFILL"
printf '%-6s %-8s %14s %14s %8s %12s %12s\n' round servers cohort_rows/s torch_rows/s ratio cohort_p99 torch_p99
for s in $SERVERS; do
  ratios=()
  for ((r = 1; r <= ROUNDS; r++)); do
    c=${cohort_rate[$r,$s]:-} t=${torch_rate[$r,$s]:-}
    ratio=-
    if [[ -n $c && -n $t ]]; then
      ratio=$(awk -v c="${c%\*}" -v t="${t%\*}" 'BEGIN { printf "%.2f", c / t }')
      ratios+=("$ratio")
    fi
    printf '%-6s %-8s %14s %14s %8s %12s %12s\n' "$r" "$s" "${c:--}" "${t:--}" "$ratio" \
      "${cohort_p99[$r,$s]:--}" "${torch_p99[$r,$s]:--}"
  done
  if ((${#ratios[@]})); then
    printf '%s\n' "${ratios[@]}" | sort -g | awk -v s="$s" '{ v[NR] = $1 } END {
      m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
      printf "servers=%s: median ratio %.2f over %d rounds (min %.2f, max %.2f)\n", s, m, NR, v[1], v[NR] }'
  fi
done
if [[ $(binaries) != "$BIN_AT_START" ]]; then
  echo "## WARNING: $COHORT or $PS_BENCH was rebuilt during the comparison; its figures mix two builds" >&2
  failures=$((failures + 1))
fi
if ((failures)); then
  echo "## $failures run(s) failed" >&2
  exit 1
fi
