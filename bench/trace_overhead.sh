#!/usr/bin/env bash
# What observability costs (docs/observability.md, docs/performance.md): the same 2-rank jobs with the
# flight recorder off (COHORT_FLIGHT_RECORDER=0), on (the default) and with the timeline on
# (--timeline), interleaved round by round with fresh processes, every round printed.
#
#   bench/trace_overhead.sh [build_dir] [rounds] [out_file]      (about 4 minutes with 5 rounds)
#   JOBS=8B bench/trace_overhead.sh ...                            (only the 8 B allreduce; also 64MiB, main)
#
# Jobs: `cohort bench allreduce` at 8 B (5 trials of 100,000 iterations) and at 64 MiB (5 trials of 20),
# the median trial; and the main job (fashion_mnist --model mlp, 1 epoch: samples/s as it prints it).
# Fixed iteration counts keep the timeline under COHORT_TIMELINE_MAX_EVENTS (1,000,000 per rank), so
# every operation of the timed trials is recorded.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=$(realpath "${1:-build}")
ROUNDS=${2:-5}
OUT=${3:-/dev/stdout}
COHORT=$BUILD/tools/cohort
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
exec > >(tee -a "$OUT") 2>&1

# run_mode MODE CMD...: the command under `cohort run -n 2` in one of the three modes.
run_mode() {
  local mode=$1; shift
  case $mode in
    off) COHORT_FLIGHT_RECORDER=0 "$COHORT" run -n 2 --no-tag-output "$@" ;;
    recorder) "$COHORT" run -n 2 --no-tag-output "$@" ;;
    timeline) "$COHORT" run -n 2 --no-tag-output --timeline "$TMP/trace.json" "$@" ;;
  esac
}
bench_us() {  # mode bytes iterations -> the time column (us) of rank 0's table row
  run_mode "$1" "$COHORT" bench allreduce -b "$2" -e "$2" -n "$3" --trials 5 2>&1 | awk '$1 ~ /^[0-9]+$/ && $1 == '"$(numfmt --from=iec "$2")"' {print $6}'
}
train_sps() {  # mode -> samples/s
  run_mode "$1" "$BUILD/examples/fashion_mnist/fashion_mnist" --model mlp --epochs 1 2>&1 |
    sed -n 's/.*samples\/s: \([0-9.]*\).*/\1/p'
}

echo "# trace overhead, $ROUNDS interleaved rounds, $(date -u +%Y-%m-%dT%H:%MZ), load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# round  job                   off   recorder   timeline"
JOBS=${JOBS:-8B 64MiB main}
for round in $(seq 1 "$ROUNDS"); do
  for job in "allreduce 8B (us)" "allreduce 64MiB (us)" "main job (samples/s)"; do
    [[ " $JOBS " == *" $(echo "$job" | awk '{print $1 == "main" ? "main" : $2}') "* ]] || continue
    line="$round  $(printf '%-20s' "$job")"
    for mode in off recorder timeline; do
      case $job in
        "allreduce 8B"*) v=$(bench_us $mode 8 100000) ;;
        "allreduce 64MiB"*) v=$(bench_us $mode 64M 20) ;;
        *) v=$(train_sps $mode) ;;
      esac
      line+="  $(printf '%9s' "${v:-?}")"
    done
    echo "$line"
  done
done
